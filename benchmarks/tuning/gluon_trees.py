"""The Gluon prefill's default launches timed from whichever pagedfuse tree PYTHONPATH
names, to compare two versions of the kernel in turns (one process per tree: a kernel
change with no plan switch to A/B it in one process)::

    PYTHONPATH=OLD python3 benchmarks/tuning/gluon_trees.py old out.jsonl
    PYTHONPATH=NEW python3 benchmarks/tuning/gluon_trees.py new out.jsonl   # and again

Each case: bench_prefill.py's Case (light), the gluon_prefill backend with no plan, the
median of three CUDA graph timings (bench_ms); one JSON line per case appended to the file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules

import bench_prefill as bp  # noqa: E402

CASES = (("qwen35", "int8_kv", (64, 8192, 4)), ("qwen35", "int8_kv", (16, 4096, 64)),
         ("tinyllama", "int8_kv", (64, 8192, 4)), ("llama3_8b", "int8_kv", (64, 8192, 4)),
         ("llama3_8b", "int8_kv", (16, 4096, 64)))


def main(tag: str, path: str) -> None:
    from pagedfuse.ops.backends import get_backend

    backend = get_backend("gluon_prefill")
    for geometry, kind, shape in CASES:
        call = bp.Case(bp.GEOMETRIES[geometry], *shape, light=True).call(kind)
        out = torch.empty_like(call.query)
        backend.run(call, out, None)  # compiled before timing
        ms = sorted(bp.bench_ms(lambda c=call, o=out: backend.run(c, o, None))
                    for _ in range(3))[1]
        row = {"tree": tag, "geometry": geometry, "kind": kind, "shape": shape, "ms": ms}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        del call, out
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

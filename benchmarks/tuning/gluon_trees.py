"""The Gluon prefill's default launches timed from whichever pagedfuse tree PYTHONPATH
names, to compare two versions of the kernel in turns (one process per tree: a kernel
change with no plan switch to A/B it in one process)::

    PYTHONPATH=OLD python3 benchmarks/tuning/gluon_trees.py old out.jsonl [SET]
    PYTHONPATH=NEW python3 benchmarks/tuning/gluon_trees.py new out.jsonl [SET]   # and again

SET: "short" (default: INT8 K+V's short queries and q_len 64 chunks) or "prompts" (bf16 and
INT8 K on bench_prefill.py's prompts and 2K chunks at every geometry). Each case:
bench_prefill.py's Case (light), the gluon_prefill backend with no plan, the median of
three CUDA graph timings (bench_ms); one JSON line per case appended to the file. The
kernels are compiled first, in parallel processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules

import bench_prefill as bp  # noqa: E402

CASES = {
    "short": (("qwen35", "int8_kv", (64, 8192, 4)), ("qwen35", "int8_kv", (16, 4096, 64)),
              ("tinyllama", "int8_kv", (64, 8192, 4)), ("llama3_8b", "int8_kv", (64, 8192, 4)),
              ("llama3_8b", "int8_kv", (16, 4096, 64))),
    "prompts": tuple((g, kind, shape) for g in bp.GEOMETRIES for kind in ("bf16", "int8_k")
                     for shape in bp.PROMPT_CASES),
}


def _compile_job(job: tuple) -> str:
    """Run one case once (a worker process), which leaves its kernels in Triton's disk cache."""
    from pagedfuse.ops.backends import get_backend

    geometry, kind, shape = job
    call = bp.Case(bp.GEOMETRIES[geometry], *shape, light=True).call(kind)
    get_backend("gluon_prefill").run(call, torch.empty_like(call.query), None)
    torch.cuda.synchronize()
    return f"{geometry} {kind} {shape}"


def main(tag: str, path: str, cases: str = "short") -> None:
    from pagedfuse.ops.backends import get_backend

    bp.precompile(list(CASES[cases]), 8, _compile_job)
    backend = get_backend("gluon_prefill")
    for geometry, kind, shape in CASES[cases]:
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
    main(*sys.argv[1:4])

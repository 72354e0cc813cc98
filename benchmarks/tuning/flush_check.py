"""How much of each kernel's time is the L2 flush's write-back, at llama3_8b.

bench_decode.py times graph replays with triton's do_bench, which flushes the L2 by zeroing
256 MB: every replay starts with up to an L2 of dirty lines to write back. A decode step in
serving follows kernels that mostly read (weight GEMMs), which leave clean lines. This
times each method after zeroing 256 MB, after reading 256 MB, and with no flush (where the
replay's own launch is no longer hidden behind a flush kernel)::

    python benchmarks/tuning/flush_check.py

Contiguous SDPA here is cuDNN's (bench_decode.py's table takes the faster of cuDNN and
flash; at B=8 flash is faster).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules

import torch  # noqa: E402
from decode_cases import GEOMETRIES, Case, contiguous_out, pf_call  # noqa: E402
from timing import captured, flush_buffer, median_replay_us  # noqa: E402

POINTS = ((8, 8192), (64, 8192), (8, 32768))
REPLAYS = 50


def check_point(batch: int, length: int, flushes: dict[str, Callable]) -> None:
    case = Case(GEOMETRIES["llama3_8b"], batch, length)
    methods = {
        "contiguous SDPA": lambda: contiguous_out(case),
        **{kind: (lambda k=kind: pf_call(case, k)) for kind in ("bf16", "int8_kv", "int8_k")},
    }
    for name, fn in methods.items():
        graph = captured(fn)
        cells = ", ".join(f"{label} {median_replay_us(graph, flush, REPLAYS):.1f}"
                          for label, flush in flushes.items())
        print(f"llama3_8b B={batch} L={length} {name}: {cells}", flush=True)


def main() -> None:
    buf = flush_buffer()
    flushes = {"zero 256 MB": buf.zero_, "read 256 MB": lambda: buf.max(),
               "none": lambda: None}
    for batch, length in POINTS:
        check_point(batch, length, flushes)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

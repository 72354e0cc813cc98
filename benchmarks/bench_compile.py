"""Compile-time cost of the rewrite: Dynamo tracing of the preset decoder with a plain inner
compiler, against the same with pagedfuse in front of it, as the layer count grows.

For each layer count the decoder (a preset's attention geometry, one decode step) is traced
from a fresh Dynamo state twice: with a plain inner compiler (returns the graph as is) and
with ``pagedfuse.backend(inner=<that plain compiler>)``. Reported per count: the plain first
call (Dynamo's own tracing, plus one eager run of the graph), the pagedfuse first call, their
difference, and the time spent inside the pagedfuse backend (the rewrite itself), with that
time as a fraction of Dynamo's tracing. Every attention site must be rewritten. Prints a
table; --json keeps the record (summarize.py reads benchmarks/results/bench_compile.json).

    .venv/bin/python benchmarks/bench_compile.py [--layers 8 32 64 128] [--preset tinyllama]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

import pagedfuse
from pagedfuse.models import PagedDecoder, preset

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench_compile.json"


def plain(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    return gm.forward


class Timed:
    """A backend wrapper that adds up the seconds spent inside ``backend``."""

    def __init__(self, backend: Callable) -> None:
        self.backend, self.seconds = backend, 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        start = time.perf_counter()
        try:
            return self.backend(gm, example_inputs)
        finally:
            self.seconds += time.perf_counter() - start


def first_call(model: PagedDecoder, inputs: tuple, backend: Callable) -> float:
    """Seconds of the first call of ``torch.compile(model)`` from a fresh Dynamo state."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    compiled(*inputs)
    return time.perf_counter() - start


def measure(preset_name: str, layers: int, repeat: int) -> dict:
    config = preset(preset_name, num_layers=layers)
    model = PagedDecoder(config).eval()
    cache = model.new_cache(batch=2, max_len=64)
    cache.append(torch.zeros(2, 8, dtype=torch.int64))  # a prefilled prompt
    inputs = (*cache.append(torch.zeros(2, 1, dtype=torch.int64)), cache.layers)
    plain_s, fused_s, rewrite_s = [], [], []
    with torch.no_grad():
        for _ in range(repeat):
            plain_s.append(first_call(model, inputs, Timed(plain)))
            pagedfuse.clear_reports()
            timed = Timed(pagedfuse.backend(inner=plain))
            fused_s.append(first_call(model, inputs, timed))
            rewrite_s.append(timed.seconds)
            rewritten = sum(r.num_rewritten for r in pagedfuse.reports())
            if rewritten != layers:
                raise RuntimeError(f"{layers} layers: {rewritten} sites rewritten")
    dynamo, fused, rewrite = min(plain_s), min(fused_s), min(rewrite_s)
    return {"layers": layers, "dynamo_s": dynamo, "pagedfuse_s": fused,
            "added_s": fused - dynamo, "rewrite_s": rewrite,
            "rewrite_fraction": rewrite / dynamo, "repeat": repeat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--preset", default="tinyllama")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case (min is kept)")
    parser.add_argument("--json", type=Path,
                        help=f"write the record here (e.g. {RESULTS.relative_to(ROOT)}); "
                        "default: print only")
    args = parser.parse_args()
    measure(args.preset, 1, 1)  # warm-up: one-time costs (imports, first traces) land here
    rows = []
    print(f"{'layers':>6} {'dynamo s':>9} {'+pagedfuse s':>13} {'added s':>8} "
          f"{'rewrite s':>10} {'rewrite/dynamo':>15}")
    for layers in args.layers:
        row = measure(args.preset, layers, args.repeat)
        rows.append(row)
        print(f"{layers:>6} {row['dynamo_s']:>9.2f} {row['pagedfuse_s']:>13.2f} "
              f"{row['added_s']:>8.2f} {row['rewrite_s']:>10.3f} "
              f"{row['rewrite_fraction']:>14.1%}", flush=True)
    if not args.json:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.platform(), "torch": torch.__version__,
        "preset": args.preset, "threads": torch.get_num_threads(), "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

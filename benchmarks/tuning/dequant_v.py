"""INT8 K+V prefill two ways on the Gluon kernel: V widened inside it (the INT8 K+V kernel)
against a dequantized copy of the call's pages first (triton_pages.dequantize_v, then the
INT8 K kernel), with triton_prefill's INT8 K+V beside them; what gluon_prefill's
DEQUANT_V_FROM and the INT8 K+V entries of FASTER were chosen from.

Each point is a CUDA graph replay (bench_prefill's timer), the variants timed in turns over
ROUNDS rounds (median), on bench_prefill.py's cases of every geometry and two between
q_len 64 and 512 (BETWEEN), with the error
against fp32 attention on the unquantized K/V over that of fp32 dequantize-then-attend::

    python benchmarks/tuning/dequant_v.py out.json [below]  # below: only the cases whose
        # queries are shorter than DEQUANT_V_FROM
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules

import bench_prefill as bp  # noqa: E402

from pagedfuse import envs  # noqa: E402

ROUNDS = 3
PROBE = "INT8 K+V prefill: V widened in the Gluon kernel against a dequantized copy"
# between bench_prefill's q_len 64 and 512 cases, where DEQUANT_V_FROM's crossover lies
# (bench_prefill's cases have none there)
BETWEEN = ((16, 4096, 128), (8, 4096, 256))


def _runners(call) -> dict:
    """Zero-argument launches of each way, each into its own output."""
    from pagedfuse.ops.backends import get_backend, gluon_prefill
    from pagedfuse.ops.gluon_prefill import prefill_into
    from pagedfuse.ops.triton_pages import dequantize_v

    gluon, triton = get_backend("gluon_prefill"), get_backend("triton_prefill")
    width = gluon_prefill.compact_pages(call)
    outs = {name: torch.empty_like(call.query) for name in ("in_kernel", "dequant", "triton")}

    def in_kernel():
        with envs.overridden("PAGEDFUSE_DEQUANT_SCRATCH_MB", "0"):
            gluon.run(call, outs["in_kernel"], None)

    def dequant():  # the copy and the INT8 K kernel on it, at any query length
        prefill_into(dequantize_v(call, width, call.geometry.batch), outs["dequant"])

    return {
        "in_kernel": (in_kernel, outs["in_kernel"]),
        "dequant": (dequant, outs["dequant"]),
        "triton": (lambda: triton.run(call, outs["triton"], None), outs["triton"]),
        "copy_only": (lambda: dequantize_v(call, width, call.geometry.batch), None),
    }


def main(path: str, only_below: bool = False) -> None:
    from pagedfuse.ops.backends import gluon_prefill

    rows = []
    # q_len 4 is memory-bound: never copied
    cases = [c for c in (*bp.CASES[:-1], *BETWEEN)
             if not only_below or c[2] < gluon_prefill.DEQUANT_V_FROM]
    for g in bp.GEOMETRIES:
        for batch, length, q_len in cases:
            case = bp.Case(bp.GEOMETRIES[g], batch, length, q_len)
            refs = bp.references(case)
            call = case.call("int8_kv")
            runners = _runners(call)
            ms = bp.in_turns({name: fn for name, (fn, _) in runners.items()}, ROUNDS)
            deq = bp.rel_err(refs["int8_kv"], refs["fp32"])
            for name, (_, out) in runners.items():
                row = {"geometry": g, "case": case.name, "way": name,
                       "ms": ms[name],
                       "copy_mb": gluon_prefill.compact_bytes(call) / 2**20,
                       "taken": gluon_prefill.dequantizes_v(call)}
                if out is not None:
                    row["err_over_deq"] = bp.rel_err(out, refs["fp32"]) / deq
                rows.append(row)
                print(row, flush=True)
            del case, refs, runners
            torch.cuda.empty_cache()
    bp.write_probe(path, PROBE, __doc__, rows)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["below"])

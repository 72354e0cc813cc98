"""Short queries on the CUDA C++ decode: what cuda_decode's ``defers`` rule was chosen from.

At B=64, L=8192 (bench_prefill.py's cases), each point a CUDA graph replay (bench_prefill's
bench_ms), with the relative difference to triton_prefill's output::

    python benchmarks/tuning/short_columns.py short out.json   # q_len 2/4/8: the decode's
        # column plans (n-tiles x column groups) with each count of KV heads per CTA built,
        # against the Gluon and Triton prefill kernels
    python benchmarks/tuning/short_columns.py decode out.json  # q_len 1, the default plan:
        # run it from two trees (PYTHONPATH) in turns to compare two builds

kv_gbs: the K/V (and scale) bytes one call reads per second; over the copy bandwidth
(4.3 TB/s on the H200) it is the fraction of the byte floor.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules

import bench_prefill as bp  # noqa: E402

GEOMETRIES = ("llama3_8b", "tinyllama", "qwen35")
Q_LENS = (2, 4, 8)
BATCH, LENGTH = 64, 8192


def _runner(name: str, call, plan=None):
    """A zero-argument launch of backend ``name`` into its own output."""
    from pagedfuse.ops.backends import get_backend

    backend = get_backend(name)
    out = torch.empty_like(call.query)
    return (lambda: backend.run(call, out, plan) or out), out


def _row(case, kind: str, fn) -> dict:
    fn()
    ms = bp.bench_ms(fn)
    return {"ms": ms, "kv_gbs": case.kv_bytes(kind) / ms / 1e6}


def decode(path: str) -> None:
    from pagedfuse.ops.backends import cuda_decode

    rows = []
    for g in GEOMETRIES:
        case = bp.Case(bp.GEOMETRIES[g], BATCH, LENGTH, 1, light=True)
        for kind in bp.KINDS:
            call = case.call(kind)
            fn, _ = _runner("cuda_decode", call, cuda_decode.make_plan(call))
            rows.append({"geometry": g, "kind": kind, "q_len": 1, **_row(case, kind, fn)})
            print(rows[-1], flush=True)
        del case
        torch.cuda.empty_cache()
    Path(path).write_text(json.dumps(rows, indent=1))


def _compile(job: tuple) -> str:
    """Run the prefill kernels of one point once (bench_prefill.precompile's worker)."""
    g, q_len, kind = job
    call = bp.Case(bp.GEOMETRIES[g], BATCH, LENGTH, q_len, light=True).call(kind)
    for name in ("gluon_prefill", "triton_prefill"):
        _runner(name, call)[0]()
    torch.cuda.synchronize()
    return f"{g} q{q_len} {kind}"


def short(path: str) -> None:
    from pagedfuse.ops import cuda_native
    from pagedfuse.ops.backends import cuda_decode

    bp.precompile([(g, q, k) for g in GEOMETRIES for q in Q_LENS for k in bp.KINDS],
                  12, _compile)
    rows = []
    for g in GEOMETRIES:
        for q_len in Q_LENS:
            case = bp.Case(bp.GEOMETRIES[g], BATCH, LENGTH, q_len, light=True)
            for kind in bp.KINDS:
                call = case.call(kind)
                ref_fn, ref = _runner("triton_prefill", call)
                ref_fn()
                ref = ref.float().clone()
                geo = call.geometry
                native = cuda_native.kind_of(call.key_cache, call.value_cache)
                built = cuda_native.decode_variant(call.device, native,
                                                   geo.head_dim).max_column_tiles
                methods = {}
                for tiles in (t for t in cuda_native.COLUMN_TILES if t <= built):
                    columns = cuda_native.columns_for(q_len, geo.group, tiles)
                    variant = cuda_native.decode_variant(call.device, native, geo.head_dim,
                                                         columns.tiles)
                    for heads in cuda_native.heads_counts(variant, geo.num_kv_heads):
                        config = cuda_decode.native_config(
                            native, geo.head_dim, geo.num_kv_heads, geo.batch * columns.groups,
                            call.device, heads=heads, tiles=columns.tiles)
                        plan = cuda_decode.make_plan(call, config=config, columns=columns)
                        label = (f"decode t{columns.tiles} g{columns.groups} h{heads} "
                                 f"s{plan.splits}")
                        methods[label] = ("cuda_decode", plan)
                default = cuda_decode.make_plan(call)
                print(f"{g} q{q_len} {kind}: the default plan takes t{default.columns.tiles} "
                      f"g{default.columns.groups} h{default.config.heads} s{default.splits}",
                      flush=True)
                methods["gluon"] = ("gluon_prefill", None)
                methods["triton"] = ("triton_prefill", None)
                for label, (name, plan) in methods.items():
                    fn, out = _runner(name, call, plan)
                    row = {"geometry": g, "kind": kind, "q_len": q_len, "method": label,
                           **_row(case, kind, fn)}
                    row["diff"] = float((out.float() - ref).norm() / ref.norm())
                    rows.append(row)
                    print(row, flush=True)
            del case
            torch.cuda.empty_cache()
    Path(path).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    {"decode": decode, "short": short}[sys.argv[1]](sys.argv[2])

"""How fast INT8 K prefill could be on the Gluon kernel if its softmax were bf16's.

INT8 K's consumers turn each int32 score into fp32 (an integer add of MAGIC, its bits read as
a float) and apply the key's scale (an FFMA) before the softmax bf16 runs as it is. This
probe loads the kernel module again under other names with that step replaced, so that the
variants compile as kernels of their own and run in turns in one process:

- ``int8_k``: as shipped;
- ``add``: the add kept, no key scale (the cost of one scale per key tile, not per key);
- ``bare``: the int32 bits read as fp32, nothing added: bf16's loop but for the int8 MMA;
- ``bare_ns``: ``bare`` with no key scales loaded either (the producer's share);
- ``int8_k_ns``: as shipped but for the key scales, all 1 and never loaded;
- ``int8_k_l2``: as shipped but each tile's key scales those of block 0's slots, so that
  their loads wait for no block id and find L2 warm.

Every variant but ``int8_k`` computes wrong numbers (they time the kernel, not its output),
so only ``int8_k``'s error is reported. Over bf16, ``int8_k_ns`` bounds what an INT8 K kernel
of this design could reach with the per-score steps it needs, ``bare_ns`` what it could
with none of them::

    python benchmarks/tuning/int8_bound.py out.json   # H200: every variant and bf16, in turns
    python benchmarks/tuning/int8_bound.py --asm      # offline sm_90: registers, spills, loop

Each point is a CUDA graph replay (bench_prefill's bench_ms), the median of ROUNDS.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules

import bench_prefill as bp  # noqa: E402

import pagedfuse.ops  # noqa: E402
from pagedfuse.ops.gluon_prefill import MAGIC  # noqa: E402  (the kernel's own, for _add)

ROUNDS = 5
PROBE = "INT8 K prefill with bf16's softmax: the scores' add and key scale taken out"
GEOMETRIES = ("llama3_8b", "qwen35", "tinyllama")  # the 1.3x bar's 128 and 256, and 64
CASES = bp.PROMPT_CASES


@gluon.jit
def _add(s_int, k_scale):
    return (s_int + MAGIC).to(gl.float32, bitcast=True)


@gluon.jit
def _bare(s_int, k_scale):
    return s_int.to(gl.float32, bitcast=True)


@gluon.jit
def _ones(s_ptr, st, blk, slot, kvh, ok):
    return gl.where(ok, 1.0, 0.0)


@gluon.jit
def _block_0(s_ptr, st, blk, slot, kvh, ok):
    return gl.load(s_ptr + slot * st[1] + kvh * st[2], mask=ok, other=0.0)


PATCHES = {"int8_k": {}, "add": {"_key_scaled": _add}, "bare": {"_key_scaled": _bare},
           "bare_ns": {"_key_scaled": _bare, "_scales": _ones},
           "int8_k_ns": {"_scales": _ones}, "int8_k_l2": {"_scales": _block_0}}
_modules: dict[str, object] = {}


def kernel_module(variant: str):
    """pagedfuse.ops.gluon_prefill loaded anew as its own module, with ``variant``'s
    functions replaced."""
    if variant not in _modules:
        path = Path(pagedfuse.ops.__file__).with_name("gluon_prefill.py")
        spec = importlib.util.spec_from_file_location(f"gluon_prefill_{variant}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, fn in PATCHES[variant].items():
            if not hasattr(module, name):  # renamed there: the variant would be int8_k's
                raise SystemExit(f"int8_bound.py: gluon_prefill.py has no {name} to replace")
            setattr(module, name, fn)
        _modules[variant] = module
    return _modules[variant]


def runners(case) -> dict:
    """Zero-argument launches of bf16 and each INT8 K variant, each into its own output."""
    from pagedfuse.ops.gluon_prefill import prefill_into

    calls = {"bf16": case.call("bf16"), "int8": case.call("int8_k")}
    ways = {"bf16": (prefill_into, calls["bf16"])}
    ways |= {v: (kernel_module(v).prefill_into, calls["int8"]) for v in PATCHES}
    outs = {name: torch.full_like(case.q, float("nan")) for name in ways}
    return {name: (lambda f=f, c=c, o=outs[name]: f(c, o), outs[name])
            for name, (f, c) in ways.items()}


def _compile_job(job: tuple) -> str:
    """Compile (by running once) one case's launches into Triton's disk cache (a worker)."""
    g, shape = job
    case = bp.Case(bp.GEOMETRIES[g], *shape, light=True)
    for fn, _ in runners(case).values():
        fn()
    torch.cuda.synchronize()
    return f"{g} {shape}"


def measure(path: str) -> None:
    bp.precompile([(g, c) for g in GEOMETRIES for c in CASES], 6, _compile_job)
    rows = []
    for g in GEOMETRIES:
        for shape in CASES:
            case = bp.Case(bp.GEOMETRIES[g], *shape)
            refs = bp.references(case)
            ways = runners(case)
            ms = bp.in_turns({name: fn for name, (fn, _) in ways.items()}, ROUNDS)
            row = {"geometry": g, "case": case.name, "ms": ms,
                   "speed_over_bf16": {n: ms["bf16"] / t for n, t in ms.items()},
                   "tflops": {n: case.flops() / t / 1e9 for n, t in ms.items()},
                   "err": {n: bp.rel_err(ways[n][1], refs["fp32"]) for n in ("bf16", "int8_k")},
                   "err_int8_k_over_deq": bp.rel_err(ways["int8_k"][1], refs["fp32"])
                   / bp.rel_err(refs["int8_k"], refs["fp32"])}
            rows.append(row)
            print(g, case.name, {n: f"{t:.4f} ms {row['speed_over_bf16'][n]:.3f}x"
                                 for n, t in ms.items()}, flush=True)
            del case, refs, ways
            torch.cuda.empty_cache()
    bp.write_probe(path, PROBE, __doc__, rows)


@contextlib.contextmanager
def _as_kernel_module(module):
    """prefill_asm.compile_gluon imports pagedfuse.ops.gluon_prefill: give it ``module``."""
    import pagedfuse.ops.gluon_prefill as canonical

    name = "pagedfuse.ops.gluon_prefill"
    sys.modules[name] = pagedfuse.ops.gluon_prefill = module
    try:
        yield
    finally:
        sys.modules[name] = pagedfuse.ops.gluon_prefill = canonical


def offline() -> None:
    import prefill_asm as pa

    from pagedfuse.ops.backends import gluon_prefill as gb

    for g in GEOMETRIES:
        for kind, variants in (("bf16", ("int8_k",)), ("int8_k", tuple(PATCHES))):
            call = pa.small_call(bp.GEOMETRIES[g], kind, 8192)
            for v in variants:
                with _as_kernel_module(kernel_module(v)):
                    info = pa.inspect(pa.compile_gluon(call, gb.default_plan(call)))
                loop = info.get("sass_loop", {})
                print(g, kind if kind == "bf16" else v, {k: info.get(k) for k in
                      ("registers", "spill_bytes")}, "loop", loop.get("min"), loop.get("max"),
                      flush=True)


if __name__ == "__main__":
    offline() if sys.argv[1:] == ["--asm"] else measure(sys.argv[1])

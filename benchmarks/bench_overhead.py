"""Host cost of one eager call of each pagedfuse op at decode shapes, per kernel backend.

For each device (the CPU, and CUDA when present), each geometry and each op (the float op,
the INT8 op with int8 K+V and with int8 K + bf16 V, quantize_int8 of the query) it times
wall µs per call of ``torch.ops.pagedfuse.*.default`` with positional arguments, as the
rewritten graph calls it (keywords cost the dispatcher about 2.4 µs more on this project's
CPU), under ``torch.inference_mode()`` and in grad mode (no input requires grad: what a
compiled graph outside inference_mode pays),
with PAGEDFUSE_BACKEND naming each backend that takes the call. Beside each it times the
pieces: the backend's ``run`` alone on a prebuilt call, ``build_call`` (check_metadata and
the PagedCall), and ``check_values`` where the op runs it (always on the CPU).

On CUDA the calls are not synchronized inside the timed loop, so the time is the host's
(the launches queue on the GPU; the context is short so the GPU keeps up). On the CPU the
kernel runs on the host too, so ``run`` is part of the call; ``op - run`` is the overhead
(one page of keys there keeps the kernel short). A peer row times
F.scaled_dot_product_attention on the same call with contiguous K/V: PyTorch's own host cost
for one attention call. ``--noop`` adds a row per op for a backend
that runs nothing (``noop``, registered for the run at the top priority): the host path
alone, dispatch, checks, choice and output allocation (on the CPU with check_values, which
the op runs there on every call; on CUDA without).
Where pagedfuse._host (csrc/host) is built, a repeated call signature is launched from C++
without entering Python (only check_values runs there, where the op runs it), so the op's
time can be below that of the Python ``run`` piece; a backend without a C++ launcher (the
reference, noop) runs its every call through the Python path. The record says which
(``host_path``).
The lines are printed; --json DIR keeps each device's record as DIR/overhead-<device>-<time>.json
(benchmarks/results/ is where summarize.py reads them).

    python benchmarks/bench_overhead.py [--device cpu|cuda|all] [--threads 1] [--json DIR]
        [--geometries tinyllama ...] [--backends cuda_decode ...] [--noop]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

import pagedfuse.ops  # noqa: F401  (registers torch.ops.pagedfuse.*)
from pagedfuse import envs
from pagedfuse.ops import library
from pagedfuse.ops.backends import (
    Backend,
    all_backends,
    reason,
    register_backend,
    unregister_backend,
)
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall
from pagedfuse.ops.validate import build_call, check_values, value_checks_enabled

GEOMETRIES = {"tinyllama": (32, 4, 64), "llama3_8b": (32, 8, 128), "qwen35": (24, 4, 256)}
BATCH, PAGE = 1, 16
# Keys per sequence: on the GPU the B=1 latency point; on the CPU one page, so that the
# kernel's own time (also on the host there) does not drown the rest of the call.
LENGTH = {"cuda": 1536, "cpu": 16}
KINDS = ("bf16", "int8_kv", "int8_k")
OPS = torch.ops.pagedfuse


def _run_nothing(call: PagedCall, out: torch.Tensor, plan: object) -> None:
    """The noop backend's kernel."""


def noop_backend(device: torch.device) -> Backend:
    """A backend of ``device`` that takes every call and runs nothing (--noop)."""
    return Backend(name="noop", device=device.type, priority=1 << 30,
                   head_dims={FLOAT_OP: None, INT8_OP: None}, run=_run_nothing)


def per_call_us(fn: Callable[[], object], device: torch.device, calls: int,
                reps: int) -> dict[str, float]:
    """Median and best over ``reps`` loops of wall µs per call of ``fn``, each loop of
    ``calls`` calls (synchronized before and after a loop, not inside it)."""
    for _ in range(max(10, calls // 10)):
        fn()
    loops = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        loops.append((time.perf_counter() - start) / calls * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return {"median": statistics.median(loops), "best": min(loops)}


def decode_args(geo: tuple[int, int, int], kind: str, device: torch.device) -> dict:
    """A decode call's op arguments: B sequences of L keys in shuffled pages, bf16 query."""
    hq, hkv, d = geo
    length = LENGTH[device.type]
    gen = torch.Generator().manual_seed(0)
    pages = -(-length // PAGE)
    blocks = BATCH * pages
    cache = lambda: torch.randn(blocks, PAGE, hkv, d, generator=gen).to(  # noqa: E731
        device=device, dtype=torch.bfloat16)
    key, value = cache(), cache()
    args = dict(query=torch.randn(BATCH, hq, d, generator=gen).to(device, torch.bfloat16),
                key_cache=key, value_cache=value,
                block_table=torch.randperm(blocks, generator=gen).view(BATCH, pages).to(
                    device, torch.int32),
                seq_lens=torch.full((BATCH,), length, dtype=torch.int32, device=device),
                query_start_loc=torch.arange(BATCH + 1, dtype=torch.int32, device=device),
                scale=d ** -0.5, causal=True, attn_bias=None, max_seq_len=length,
                max_query_len=1)
    if kind != "bf16":
        args["key_cache"], args["key_scale"] = OPS.quantize_int8(key)
        args["value_scale"] = None
        if kind == "int8_kv":
            args["value_cache"], args["value_scale"] = OPS.quantize_int8(value)
    return args


def to_call(args: dict) -> PagedCall:
    return build_call(INT8_OP if "key_scale" in args else FLOAT_OP, args["query"],
                      args["key_cache"], args["value_cache"], args.get("key_scale"),
                      args.get("value_scale"), args["block_table"], args["seq_lens"],
                      args["query_start_loc"], args["scale"], args["causal"],
                      args["attn_bias"], args["max_seq_len"], args["max_query_len"])


def measure_attention(device: torch.device, geo: tuple[int, int, int], kind: str,
                      calls: int, reps: int, backends: set[str] | None = None) -> list[dict]:
    """One row per backend that takes this decode call on ``device`` (of ``backends``, if
    given)."""
    args = decode_args(geo, kind, device)
    op = (OPS.paged_attention if kind == "bf16" else OPS.paged_attention_int8).default
    positional = [args[a.name] for a in op._schema.arguments if not a.kwarg_only]
    call = to_call(args)
    out = torch.empty_like(args["query"])
    pieces = {"build_call": per_call_us(lambda: to_call(args), device, calls, reps)}
    if value_checks_enabled(device):
        pieces["check_values"] = per_call_us(lambda: check_values(
            call.geometry, call.block_table, call.seq_lens, call.query_start_loc, None,
            call.max_seq_len, call.max_query_len), device, calls, reps)
    rows = []
    for backend in all_backends():
        if backend.device not in (None, device.type) or reason(backend, call) or (
                backends is not None and backend.name not in backends):
            continue
        row = {"backend": backend.name, **pieces,
               "run": per_call_us(partial(backend.run, call, out, None), device, calls, reps)}
        with envs.overridden("PAGEDFUSE_BACKEND", backend.name):
            with torch.inference_mode():
                row["op_inference_mode"] = per_call_us(partial(op, *positional), device, calls,
                                                       reps)
            row["op_grad_mode"] = per_call_us(partial(op, *positional), device, calls, reps)
        rows.append(row)
    return rows


def measure_quantize(device: torch.device, geo: tuple[int, int, int], calls: int,
                     reps: int) -> dict:
    """quantize_int8 of a decode query (the INT8 op's first step on CUDA)."""
    hq, _, d = geo
    quantize = partial(OPS.quantize_int8.default,
                       torch.randn(BATCH, hq, d, device=device, dtype=torch.bfloat16))
    with torch.inference_mode():
        inference = per_call_us(quantize, device, calls, reps)
    return {"backend": "default", "op_inference_mode": inference,
            "op_grad_mode": per_call_us(quantize, device, calls, reps)}


def measure_sdpa(device: torch.device, geo: tuple[int, int, int], calls: int,
                 reps: int) -> dict:
    """The peer: F.scaled_dot_product_attention on the same decode call with contiguous K/V
    (enable_gqa), i.e. PyTorch's own host cost for one attention call on this machine."""
    hq, hkv, d = geo
    length = LENGTH[device.type]
    q = torch.randn(BATCH, hq, 1, d, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(BATCH, hkv, length, d, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, enable_gqa=True)
    with torch.inference_mode():
        inference = per_call_us(sdpa, device, calls, reps)
    return {"backend": "torch sdpa (peer)", "op_inference_mode": inference,
            "op_grad_mode": per_call_us(sdpa, device, calls, reps)}


def measure(device: torch.device, calls: int, reps: int, geometries: list[str],
            backends: set[str] | None, noop: bool = False) -> list[dict]:
    if noop:
        register_backend(noop_backend(device))
        if backends is not None:
            backends = backends | {"noop"}
    try:
        return _measure(device, calls, reps, geometries, backends)
    finally:
        if noop:
            unregister_backend("noop")


def _measure(device: torch.device, calls: int, reps: int, geometries: list[str],
             backends: set[str] | None) -> list[dict]:
    rows = []
    for gname in geometries:
        geo = GEOMETRIES[gname]
        found = [{"kind": kind, **row} for kind in KINDS
                 for row in measure_attention(device, geo, kind, calls, reps, backends)]
        found.append({"kind": "bf16", **measure_sdpa(device, geo, calls, reps)})
        found.append({"kind": "quantize_int8", **measure_quantize(device, geo, calls, reps)})
        for row in found:
            row = {"device": device.type, "geometry": gname, **row}
            rows.append(row)
            print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    cells = [f"{key} {row[key]['median']:.1f}/{row[key]['best']:.1f}" for key in
             ("op_inference_mode", "op_grad_mode", "run", "build_call", "check_values")
             if key in row]
    return (f"{row['device']} {row['geometry']} {row['kind']} [{row['backend']}]: "
            + ", ".join(cells) + " µs (median/best loop)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: the CPU kernels' time varies least)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    parser.add_argument("--reps", type=int, default=7, help="timed loops")
    parser.add_argument("--json", type=Path, metavar="DIR",
                        help="write each device's record into DIR (default: print only)")
    parser.add_argument("--label", default="", help="appended to the JSON's file name")
    parser.add_argument("--geometries", nargs="+", choices=tuple(GEOMETRIES),
                        default=list(GEOMETRIES))
    parser.add_argument("--backends", nargs="+", metavar="NAME",
                        help="time only these backends (default: every one that takes the call)")
    parser.add_argument("--noop", action="store_true",
                        help="also time a backend that runs nothing: the host path alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        devices.remove("cuda")
    for name in devices:
        device = torch.device(name)
        rows = measure(device, args.calls, args.reps, args.geometries,
                       set(args.backends) if args.backends else None, args.noop)
        stamp = datetime.datetime.now(datetime.timezone.utc)
        record = {
            "benchmark": "bench_overhead", "date": stamp.isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(device) if name == "cuda" else
            platform.processor() or platform.machine(),
            "torch": torch.__version__, "python": platform.python_version(),
            "threads": args.threads, "host_path": library.HOST is not None, "batch": BATCH,
            "length": LENGTH[name], "page": PAGE,
            "calls_per_loop": args.calls, "loops": args.reps,
            "env": {var: getattr(envs, var) for var in ("PAGEDFUSE_PDL", "PAGEDFUSE_BALANCED",
                                                        "PAGEDFUSE_CHECKS")},
            "unit": "wall µs per call (median and best loop), op calls with positional "
                    "arguments", "rows": rows,
        }
        if args.json:
            label = f"-{args.label}" if args.label else ""
            args.json.mkdir(parents=True, exist_ok=True)
            path = args.json / f"overhead-{name}-{stamp:%Y%m%d-%H%M%S}{label}.json"
            path.write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {path}")


if __name__ == "__main__":
    main()

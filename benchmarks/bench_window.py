"""Sliding-window decode on the GPU: pagedfuse with window_left against the peers, one table.

One decode problem (default: llama3_8b's geometry, B=64, L=32768, window 4096, page 16,
random block permutation, bf16 queries, NHD caches; decode_cases.Case), every method timed
side by side in one run by timing.bench (one call in a CUDA graph, replayed after an L2
flush):

- pagedfuse with the window, bf16 and INT8 K+V (the ops' default path: the CUDA C++ decode
  where built), bf16 with the window and a soft cap, and bf16 with the window forced onto
  the Triton kernel;
- pagedfuse without the window (the full context), bf16 and INT8 K+V;
- the eager code transformers runs: gather every page, then SDPA with a sliding-window mask;
- FlexAttention with a sliding-window block mask over the same pages (flex_paged.py, under
  torch.compile).

Each method's fraction of the window's byte floor: the bytes of the K/V (and scales) inside
the window in its cache format, plus the query and the output, over the copy bandwidth
measured in the same run (and of its own floor: the full context's bytes for the rows
without the window). Errors are against float32 attention over the keys the method attends
to.

    python benchmarks/bench_window.py --json results/window_h200_DATE.json

summarize.py turns the newest record under results/ into benchmarks/README.md's table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import decode_cases
import timing
import torch
import torch.nn.functional as F
from bench_decode import _reason, environment
from decode_cases import GEOMETRIES, OPS, Case, gather_pages, rel_err
from timing import bench

from pagedfuse.ops.backends import choose, get_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP
from pagedfuse.ops.validate import build_call

BENCHMARK = "window"  # the JSON's "benchmark": what summarize.py reads it as
REPS = dict(warmup=5, rep=25)


def floor_bytes(case: Case, kind: str, window: int | None) -> int:
    """Bytes a decode over the last ``window`` keys (None: all) must move: their K/V (and
    scales) in ``kind``'s format, the query and the output."""
    keys = case.length if window is None else min(window, case.length)
    return case.bytes(kind) * keys // case.length + 2 * case.q.numel() * case.q.element_size()


def reference(case: Case, window: int | None, softcap: float | None) -> torch.Tensor:
    """float32 attention of each query over its sequence's last ``window`` keys (None: all;
    every sequence is case.length long), [B, Hq, D]."""
    hq, hkv, d = case.geo
    keys = case.length if window is None else min(window, case.length)
    q = case.q.float().view(case.batch, hkv, hq // hkv, d)
    k = case.k_contig[:, :, -keys:].float()
    v = case.v_contig[:, :, -keys:].float()
    s = q @ k.transpose(-1, -2) * case.scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    return (s.softmax(-1) @ v).reshape(case.q.shape)


def eager_window_sdpa(case: Case, window: int) -> torch.Tensor:
    """What transformers' paged SDPA path runs for a sliding-window layer at decode: every
    page gathered, then SDPA with a mask of the keys in the window."""
    k, v = gather_pages(case.k, case.table), gather_pages(case.v, case.table)
    pos = torch.arange(k.shape[2], device=k.device)
    lens = case.seq_lens[:, None]
    visible = (pos < lens) & (pos >= lens - window)
    return F.scaled_dot_product_attention(case.q[:, :, None], k, v,
                                          attn_mask=visible[:, None, None], scale=case.scale,
                                          enable_gqa=True)


def _op(case: Case, kind: str, window: int | None, softcap: float | None = None):
    """The op's call over ``kind``'s caches (hints: the length and one query token, as the
    rewrite passes them)."""
    k, v, ks, vs = case.caches(kind)
    options = dict(window_left=window, softcap=softcap)
    if ks is None:
        return lambda: OPS.paged_attention(case.q, k, v, *case.block_args, case.scale, False,
                                           None, case.length, 1, **options)
    return lambda: OPS.paged_attention_int8(case.q, k, v, ks, vs, *case.block_args,
                                            case.scale, False, None, case.length, 1, **options)


def _backend(case: Case, kind: str, name: str, window: int) -> Callable[[], torch.Tensor]:
    """The named backend's kernel on the windowed call (its own launch plan)."""
    k, v, ks, vs = case.caches(kind)

    def run() -> torch.Tensor:
        call = build_call(FLOAT_OP if ks is None else INT8_OP, case.q, k, v, ks, vs,
                          *case.block_args, case.scale, False, None, case.length, 1,
                          window_left=window)
        out = torch.empty_like(case.q)
        get_backend(name).run(call, out)
        return out

    return run


def _flex(case: Case, window: int, general: bool = False) -> Callable[[], torch.Tensor]:
    """FlexAttention's sliding-window call, set up (and compiled) on its first call; torch's
    PagedAttention is experimental, so it is imported only here. ``general``: its general
    kernel instead of the decode kernel it picks for power-of-two head groups."""
    from flex_paged import paged_flex_call
    from torch.nn.attention.flex_attention import flex_attention

    fn = None

    def call() -> torch.Tensor:
        nonlocal fn
        if fn is None:
            fn = paged_flex_call(case.q, case.k, case.v, case.table, case.seq_lens,
                                 case.scale, torch.compile(flex_attention, dynamic=False),
                                 window_left=window, general=general)
        return fn()

    return call


class Method(NamedTuple):
    kind: str  # the cache format its floor counts (decode_cases.KINDS)
    window: int | None  # the keys it attends to: the window, or None for all
    softcap: float | None
    fn: Callable[[], torch.Tensor]


def methods(case: Case, window: int, softcap: float, flex: bool) -> dict[str, Method]:
    timed = {
        "pagedfuse window bf16": Method("bf16", window, None, _op(case, "bf16", window)),
        "pagedfuse window INT8 K+V": Method("int8_kv", window, None,
                                            _op(case, "int8_kv", window)),
        f"pagedfuse window bf16, softcap {softcap:g}": Method(
            "bf16", window, softcap, _op(case, "bf16", window, softcap)),
        "pagedfuse window bf16, Triton": Method("bf16", window, None,
                                                _backend(case, "bf16", "triton", window)),
        "pagedfuse full context bf16": Method("bf16", None, None, _op(case, "bf16", None)),
        "pagedfuse full context INT8 K+V": Method("int8_kv", None, None,
                                                  _op(case, "int8_kv", None)),
        "eager gather + SDPA, window mask": Method("bf16", window, None,
                                                   lambda: eager_window_sdpa(case, window)),
    }
    if flex:
        timed["FlexAttention, sliding-window block mask"] = Method("bf16", window, None,
                                                                   _flex(case, window))
        group = case.q.shape[1] // case.k.shape[2]
        if group & (group - 1) == 0:  # its decode kernel ran above; else the general one did
            timed["FlexAttention, sliding-window block mask, general kernel"] = Method(
                "bf16", window, None, _flex(case, window, general=True))
    return timed


def run(case: Case, window: int, softcap: float, flex: bool, bw: float,
        record: Callable[[list[dict]], None]) -> list[dict]:
    """Times, fractions of the window's byte floor and of the method's own, and errors of
    every method; ``record`` gets the rows after each method (a run cut short keeps what it
    measured)."""
    refs: dict[tuple, torch.Tensor] = {}
    rows = []
    for name, m in methods(case, window, softcap, flex).items():
        row = {"method": name, "kind": m.kind, "window": m.window, "softcap": m.softcap}
        try:
            out = m.fn()
            row["us"] = bench(m.fn, REPS)
        except Exception as exc:  # a peer that cannot run is reported, not fatal
            row["us"], row["error"] = None, _reason(exc)
            print(f"{name} failed:\n" + "".join(traceback.format_exception(exc)[-3:]),
                  file=sys.stderr)
        else:
            seconds = row["us"] * 1e-6
            row["window_floor"] = floor_bytes(case, m.kind, window) / bw / seconds
            row["floor"] = floor_bytes(case, m.kind, m.window) / bw / seconds
            key = (m.window, m.softcap)
            if key not in refs:
                refs[key] = reference(case, *key)
            row["err"] = rel_err(out.reshape(case.q.shape), refs[key])
            print(f"{name}: {row['us']:.1f} µs, {row['window_floor']:.1%} of the window's "
                  f"byte floor, rel err {row['err']:.1e}", flush=True)
        rows.append(row)
        record(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geo", choices=list(GEOMETRIES), default="llama3_8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--softcap", type=float, default=50.0,
                        help="the soft cap of the capped pagedfuse row (Gemma2's 50)")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    parser.add_argument("--flush", choices=("zero", "read"), default=timing.FLUSH,
                        help="how the L2 is cleared before each timed replay (timing.py)")
    parser.add_argument("--json", help="write the run's rows and environment here")
    args = parser.parse_args()
    bw = decode_cases.configure(decode_cases.LAYOUT, args.flush, [args.geo])
    start = time.time()
    command = " ".join(["python benchmarks/bench_window.py", *sys.argv[1:]])
    case = Case(GEOMETRIES[args.geo], args.batch, args.length)
    k, v, _, _ = case.caches("bf16")
    windowed = build_call(FLOAT_OP, case.q, k, v, None, None, *case.block_args, case.scale,
                          False, None, case.length, 1, window_left=args.window)
    problem = {"geometry": args.geo, "geo": list(case.geo), "B": args.batch, "L": args.length,
               "window": args.window, "page": decode_cases.PAGE,
               "window_kv_gb": case.bytes("bf16") * args.window / args.length / 1e9,
               "windowed_backend": choose(windowed).name}

    def record(rows: list[dict]) -> None:
        if args.json:
            env = environment(bw, command, time.time() - start)
            Path(args.json).write_text(json.dumps(
                {"benchmark": BENCHMARK, "env": env, "problem": problem, "rows": rows},
                indent=1) + "\n")

    print(f"{args.geo} {case.geo} B={args.batch} L={args.length} window {args.window}: the "
          f"windowed decode runs {problem['windowed_backend']}", flush=True)
    run(case, args.window, args.softcap, not args.no_flex, bw, record)


if __name__ == "__main__":
    main()

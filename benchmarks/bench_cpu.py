"""CPU decode benchmark: pagedfuse's C++ kernels against eager gather + SDPA, in one run.

Decode (one query token per sequence), B=8 sequences of L=4096 keys in pages of 16 whose
block table is a random permutation. Peers: eager ``cache[block_table]`` gather + reshape +
``F.scaled_dot_product_attention(enable_gqa=True)`` with a length mask; the same SDPA on K/V
that are already contiguous; pagedfuse fp32; pagedfuse int8 (K and V int8, per-token scales).
Reports the median time, speed-up over eager, achieved bandwidth (bytes of K/V and scales that
must be read / time) and its fraction of a measured copy bandwidth.

Windowed decode (Gemma2's attention: 16 query heads over 8 KV heads of 256, bf16 cache),
B=4 sequences of L=32768 keys: pagedfuse with window_left=4096 against the same call over the
full context and against the window's byte floor (its K/V bytes at the copy bandwidth), so
the table shows that the window reads only its own pages.

Prints a markdown section (date, machine, command, tables); --json keeps the record
(summarize.py reads benchmarks/results/).

    .venv/bin/python benchmarks/bench_cpu.py [--reps 10] [--threads 2] [--json cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedfuse import envs
from pagedfuse.ops import cpu  # also registers torch.ops.pagedfuse.*

SHAPES = ((32, 8, 128), (24, 4, 256))  # (Hq, Hkv, D)
BATCH, LENGTH, PAGE = 8, 4096, 16
EAGER, CONTIGUOUS, FUSED_FP32, FUSED_INT8 = (
    "eager gather + SDPA", "SDPA, contiguous K/V", "pagedfuse fp32", "pagedfuse int8 (K, V)")
WINDOW_SHAPE = (16, 8, 256)  # (Hq, Hkv, D) of Gemma2-9B
WINDOW_BATCH, WINDOW_LENGTH, WINDOW = 4, 32768, 4096
WINDOWED, FULL = f"pagedfuse, window {WINDOW}", "pagedfuse, full context"


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="bench_cpu", unit="case", file=sys.stderr)


def median_ms(fn: Callable[[], object], reps: int, warmup: int,
              flush: torch.Tensor | None = None) -> float:
    """Median wall time; with ``flush``, a buffer larger than the last-level cache is
    rewritten before each run, so every run reads K/V from memory as a real decode step does
    (a model's caches across its layers do not fit in L3; this machine's L3 is large)."""
    for _ in range(warmup):
        fn()
    times = []
    for rep in range(reps):
        if flush is not None:
            flush.fill_(rep)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def copy_bandwidth_gbs(reps: int) -> float:
    """Bytes read + written per second by a large tensor copy (well beyond the caches)."""
    src = torch.randn(128 * 2**20)  # 512 MiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), reps, 1)
    return 2 * src.numel() * src.element_size() / (ms * 1e6)


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in
                  subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                  if line.startswith("Model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores"


def cases(num_q_heads: int, num_kv_heads: int, head_dim: int):
    """(name, fn, bytes that must be read) for every peer at one shape."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = BATCH * LENGTH // PAGE
    query = torch.randn(BATCH, num_q_heads, head_dim, generator=gen)
    k_cache = torch.randn(num_blocks, PAGE, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, PAGE, num_kv_heads, head_dim, generator=gen)
    table = torch.randperm(num_blocks, generator=gen).view(BATCH, -1).to(torch.int32)
    seq_lens = torch.full((BATCH,), LENGTH, dtype=torch.int32)
    starts = torch.arange(BATCH + 1, dtype=torch.int32)
    scale = head_dim**-0.5
    q4 = query[:, :, None, :]  # [B, Hq, 1, D]
    mask = (torch.arange(LENGTH)[None, :] < seq_lens[:, None])[:, None, None, :]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, L, D] through the block table."""
        return cache[table].reshape(BATCH, LENGTH, num_kv_heads, head_dim).transpose(1, 2)

    def eager():
        return F.scaled_dot_product_attention(q4, gather(k_cache), gather(v_cache),
                                              attn_mask=mask, scale=scale, enable_gqa=True)

    k_flat, v_flat = gather(k_cache).contiguous(), gather(v_cache).contiguous()

    def contiguous():
        return F.scaled_dot_product_attention(q4, k_flat, v_flat, attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    def fused_fp32():
        return torch.ops.pagedfuse.paged_attention(query, k_cache, v_cache, table, seq_lens,
                                                   starts, scale, False)

    k_i8, k_scale = torch.ops.pagedfuse.quantize_int8(k_cache)
    v_i8, v_scale = torch.ops.pagedfuse.quantize_int8(v_cache)

    def fused_int8():
        return torch.ops.pagedfuse.paged_attention_int8(query, k_i8, v_i8, k_scale, v_scale,
                                                        table, seq_lens, starts, scale, False)

    kv_fp32 = 2 * k_cache.numel() * 4
    kv_int8 = 2 * (k_i8.numel() + k_scale.numel() * 4)
    return [(EAGER, eager, kv_fp32), (CONTIGUOUS, contiguous, kv_fp32),
            (FUSED_FP32, fused_fp32, kv_fp32), (FUSED_INT8, fused_int8, kv_int8)]


def windowed_cases(dtype: torch.dtype = torch.bfloat16):
    """(name, fn, bytes that must be read) for decode with and without the window."""
    num_q_heads, num_kv_heads, head_dim = WINDOW_SHAPE
    gen = torch.Generator().manual_seed(0)
    num_blocks = WINDOW_BATCH * WINDOW_LENGTH // PAGE
    shape = (num_blocks, PAGE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(WINDOW_BATCH, num_q_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen).view(WINDOW_BATCH, -1).to(torch.int32)
    seq_lens = torch.full((WINDOW_BATCH,), WINDOW_LENGTH, dtype=torch.int32)
    starts = torch.arange(WINDOW_BATCH + 1, dtype=torch.int32)
    args = (query, k_cache, v_cache, table, seq_lens, starts, head_dim**-0.5, True)

    def windowed():
        return torch.ops.pagedfuse.paged_attention(*args, window_left=WINDOW)

    def full():
        return torch.ops.pagedfuse.paged_attention(*args)

    per_key = 2 * num_kv_heads * head_dim * k_cache.element_size()  # K and V of one key
    return [(WINDOWED, windowed, WINDOW_BATCH * WINDOW * per_key),
            (FULL, full, WINDOW_BATCH * WINDOW_LENGTH * per_key)]


def windowed_table(reps: int, warmup: int, flush: torch.Tensor | None,
                   copy_gbs: float) -> list[str]:
    """Markdown lines: each call's time, the bytes it must read, and the window's floor."""
    rows = ["| impl | ms | MiB read | GB/s | of copy BW | window floor ms | of floor |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    times, floor_ms = {}, 0.0
    for name, fn, nbytes in windowed_cases():
        ms = times[name] = median_ms(fn, reps, warmup, flush)
        if name == WINDOWED:
            floor_ms = nbytes / (copy_gbs * 1e6)
        gbs = nbytes / (ms * 1e6)
        rows.append(f"| {name} | {ms:.2f} | {nbytes / 2**20:.0f} | {gbs:.1f} "
                    f"| {gbs / copy_gbs:.0%} | {floor_ms:.2f} | {floor_ms / ms:.0%} |")
    rows += ["", f"window {WINDOW} of {WINDOW_LENGTH}: {times[FULL] / times[WINDOWED]:.2f}x "
                 f"faster than the full context (the bytes: {WINDOW_LENGTH / WINDOW:.0f}x)"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10, help="timed runs per case (median)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="also write the markdown section to this file")
    parser.add_argument("--json", help="write the record (environment and rows) here")
    parser.add_argument("--flush-mib", type=int, default=1024,
                        help="buffer rewritten before each timed run to evict K/V from the "
                             "caches (0: keep caches warm)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    copy_gbs = copy_bandwidth_gbs(args.reps)
    flush = torch.empty(args.flush_mib * 2**18) if args.flush_mib else None
    header = ("| Hq, Hkv, D | impl | ms | speed-up vs eager | GB/s | of copy BW |\n"
              "|---|---|---:|---:|---:|---:|")
    rows, summary, records = [], [], []
    bar = _progress(4 * len(SHAPES))
    for shape in SHAPES:
        times = {}
        for name, fn, nbytes in cases(*shape):
            ms = times[name] = median_ms(fn, args.reps, args.warmup, flush)
            eager_ms = times[EAGER]
            gbs = nbytes / (ms * 1e6)
            rows.append(f"| {shape} | {name} | {ms:.2f} | {eager_ms / ms:.2f}x | {gbs:.1f} "
                        f"| {gbs / copy_gbs:.0%} |")
            records.append({"shape": list(shape), "impl": name, "ms": ms,
                            "speedup_vs_eager": eager_ms / ms, "gbs": gbs,
                            "of_copy_bw": gbs / copy_gbs})
            if bar is not None:
                bar.update()
        summary.append(f"{shape}: fp32 {times[EAGER] / times[FUSED_FP32]:.2f}x eager, "
                       f"int8 {times[FUSED_FP32] / times[FUSED_INT8]:.2f}x fp32")
    if bar is not None:
        bar.close()
    windowed_rows = windowed_table(args.reps, args.warmup, flush, copy_gbs)

    invocation = shlex.join([sys.executable, *sys.argv])
    command = f"PAGEDFUSE_CPU_ISA={envs.PAGEDFUSE_CPU_ISA} {invocation}"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = "\n".join([
        f"\n## CPU decode, {stamp}\n",
        f"- machine: {machine()}; torch {torch.__version__}; {args.threads} threads; "
        f"ISA {cpu.selected_isa()}",
        f"- command: `{command}`",
        f"- decode B={BATCH}, L={LENGTH}, page {PAGE}, random block permutation, fp32 query; "
        f"median of {args.reps} runs after {args.warmup} warm-up; "
        + (f"{args.flush_mib} MiB rewritten before each run (K/V come from memory)"
           if args.flush_mib else "caches left warm"),
        f"- measured copy bandwidth (read + write): {copy_gbs:.1f} GB/s\n",
        header, *rows, "", "pagedfuse speed-ups: " + "; ".join(summary), "",
        f"### Windowed decode, B={WINDOW_BATCH}, L={WINDOW_LENGTH}, window {WINDOW}, "
        f"(Hq, Hkv, D) {WINDOW_SHAPE}, bf16 cache, causal\n",
        *windowed_rows, ""])
    print(section)
    if args.out:
        with open(args.out, "w") as f:
            f.write(section)
    if args.json:
        env = {"date": stamp, "machine": machine(), "torch": torch.__version__,
               "threads": args.threads, "isa": cpu.selected_isa(), "command": command,
               "copy_bandwidth_gbs": copy_gbs, "batch": BATCH, "length": LENGTH, "page": PAGE,
               "reps": args.reps, "flush_mib": args.flush_mib}
        with open(args.json, "w") as f:
            json.dump({"benchmark": "cpu_decode", "env": env, "rows": records}, f, indent=1)


if __name__ == "__main__":
    main()

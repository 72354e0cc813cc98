"""How fast can any kernel read the paged cache? The bound under the decode targets.

A Triton kernel that does nothing but read: one program per (sequence, KV head, split) walks
its share of the sequence's pages through the block table and sums its K and V rows (and,
for INT8 caches, their scales): one float out per program. Its best time over a few warp,
pipeline and split settings is timed (timing.bench: a CUDA graph replay after the
L2 flush), for bf16 caches on the same bytes laid out four ways: the contiguous
[B, Hkv, L, D] K/V that contiguous SDPA reads (as 16-token pages in order), the table's
random 16-token pages (NHD), the same pages in order, and random pages in HND; for INT8 K
and INT8 K+V caches on random pages in NHD and HND. Next to them: contiguous bf16 SDPA (the
best of cuDNN and flash) and pagedfuse's decode of the same cache. Where the reader itself
misses a target's ratio to SDPA, a decode would have to read the pages faster than a kernel
that does nothing else::

    python benchmarks/tuning/page_read.py                          # bf16, B=64, L=8192 and 32768
    python benchmarks/tuning/page_read.py --kind int8_kv --batch 8 --lengths 32768 --flush read
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: shared modules

import timing  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from decode_cases import GEOMETRIES, Case, best_contiguous, pf_call  # noqa: E402
from decode_sweeps import TARGET_RATIOS  # noqa: E402
from timing import bench, copy_bandwidth  # noqa: E402

CONFIGS = ((4, 2), (4, 3), (8, 3), (8, 4))  # (num_warps, pipeline stages) tried per layout
REPS = dict(warmup=5, rep=20)


@triton.jit
def _read_pages(k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, out_ptr, n_pages, splits, chunk,
                s_block, s_token, s_head, ss_block, ss_token, ss_head, s_table,
                HEADS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, K_SCALES: tl.constexpr,
                V_SCALES: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    split, rest = pid % splits, pid // splits
    row, head = rest // HEADS, rest % HEADS
    lo = split * chunk
    hi = tl.minimum(n_pages, lo + chunk)
    tokens = tl.arange(0, PAGE)
    offs = tokens[:, None] * s_token + tl.arange(0, D)[None, :]
    acc = tl.zeros([PAGE, D], dtype=tl.float32)
    scale_acc = tl.zeros([PAGE], dtype=tl.float32)
    for i in tl.range(lo, hi, num_stages=STAGES):
        block = tl.load(table_ptr + row * s_table + i).to(tl.int64)
        base = block * s_block + head * s_head
        acc += tl.load(k_ptr + base + offs).to(tl.float32)
        acc += tl.load(v_ptr + base + offs).to(tl.float32)
        at = block * ss_block + head * ss_head + tokens * ss_token
        if K_SCALES:
            scale_acc += tl.load(ks_ptr + at)
        if V_SCALES:
            scale_acc += tl.load(vs_ptr + at)
    tl.store(out_ptr + pid, tl.sum(acc) + tl.sum(scale_acc))


def page_reader(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, warps: int,
                stages: int, splits: int = 1, ks: torch.Tensor | None = None,
                vs: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
    """A call that reads every page ``table`` lists from the [blocks, page, H, D] views k
    and v (any strides, D innermost) for each of their H heads, and with INT8 caches the
    pages' scales ks, vs ([blocks, page, H] views; INT8 K: vs None): [rows * H * splits]
    sums."""
    _, page, heads, d = k.shape
    assert k.stride() == v.stride() and k.stride(3) == 1, "K and V laid out alike, D inner"
    assert vs is None or ks is not None and ks.stride() == vs.stride(), "V scales: K's too"
    out = torch.empty(table.shape[0] * heads * splits, device=k.device, dtype=torch.float32)
    n_pages = table.shape[1]
    chunk = -(-n_pages // splits)
    ks_, vs_ = (k if ks is None else ks), (v if vs is None else vs)  # placeholders unread
    s_scales = (0, 0, 0) if ks is None else ks.stride()

    def call() -> torch.Tensor:
        _read_pages[(out.numel(),)](k, v, ks_, vs_, table, out, n_pages, splits, chunk,
                                    *k.stride()[:3], *s_scales, table.stride(0), HEADS=heads,
                                    PAGE=page, D=d, K_SCALES=ks is not None,
                                    V_SCALES=vs is not None, STAGES=stages,
                                    num_warps=warps)
        return out

    return call


def contiguous_pages(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k, v, table) of the contiguous [B, Hkv, L, D] K/V as the pages in order of a cache
    with one head: sequence b's head h is table row b * Hkv + h."""
    (_, hkv, d), page = case.geo, case.k.shape[1]
    rows, per_row = case.batch * hkv, case.length // page
    k, v = (x.view(rows * per_row, page, 1, d) for x in (case.k_contig, case.v_contig))
    table = torch.arange(rows * per_row, device=k.device, dtype=torch.int32)
    return k, v, table.view(rows, per_row)


def _total(*xs: torch.Tensor) -> float:
    return float(sum(x.sum(dtype=torch.float64) for x in xs))


def best_us(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, batch: int,
            ks: torch.Tensor | None = None, vs: torch.Tensor | None = None) -> float:
    """The reader's fastest median over CONFIGS (and, at small batches, split counts), once
    its sums over all the pages are seen to match the sum of all of K, V and the scales."""
    scales = tuple(x for x in (ks, vs) if x is not None)
    reference = _total(k, v, *scales)
    total = float(page_reader(k, v, table, *CONFIGS[0], 1, ks, vs)().double().sum())
    if abs(total - reference) > 1e-4 * (abs(reference) + 1e4):
        raise AssertionError(f"the page reader summed {total}, expected {reference}")
    splits = (1,) if batch >= 64 else (2, 4, 8, 16)
    return min(bench(page_reader(k, v, table, w, s, n, ks, vs), REPS)
               for w, s in CONFIGS for n in splits)


LAYOUTS = {"random NHD": dict(hnd=False), "in order NHD": dict(hnd=False, shuffle=False),
           "random HND": dict(hnd=True)}


def measure(kind: str, geo: tuple[int, int, int], batch: int,
            length: int) -> dict[str, tuple[float, int]]:
    """name -> (µs, bytes read) of the reader in each layout, of contiguous bf16 SDPA and of
    pagedfuse's decode of the cache."""
    times, nbytes = {}, {}
    for name, kwargs in LAYOUTS.items():
        if kind != "bf16" and name == "in order NHD":
            continue
        case = Case(geo, batch, length, **kwargs)
        if not times:
            times["contiguous SDPA"] = min(best_contiguous(case, REPS).values())
            nbytes["contiguous SDPA"] = case.bytes("bf16")
            if kind == "bf16":
                times["reader, contiguous"] = best_us(*contiguous_pages(case), batch)
        k, v, ks, vs = case.caches(kind)
        times[f"reader, {name}"] = best_us(k, v, case.table, batch, ks, vs)
        if name != "in order NHD":
            times[f"pagedfuse {kind}, {name}"] = bench(lambda c=case: pf_call(c, kind), REPS)
        nbytes.update((key, case.bytes(kind)) for key in times if key not in nbytes)
        del case
        torch.cuda.empty_cache()
    return {name: (us, nbytes[name]) for name, us in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=("bf16", "int8_k", "int8_kv"), default="bf16")
    parser.add_argument("--geos", nargs="+", choices=list(GEOMETRIES), default=list(GEOMETRIES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--flush", choices=("zero", "read"), default=timing.FLUSH,
                        help="the L2 flush before each timed replay (timing.py)")
    args = parser.parse_args()
    timing.FLUSH = args.flush
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {args.flush} flush; target {args.kind} <= "
          f"{TARGET_RATIOS[args.kind]}x contiguous SDPA", flush=True)
    for gname in args.geos:
        for length in args.lengths:
            times = measure(args.kind, GEOMETRIES[gname], args.batch, length)
            sdpa, _ = times["contiguous SDPA"]
            floor_us = times[f"reader, {next(iter(LAYOUTS))}"][1] / bw * 1e6
            print(f"page read {args.kind} {gname} B={args.batch} L={length}: " + ", ".join(
                f"{name} {us:.1f} ({nbytes / us / 1e6:.2f} TB/s, {us / sdpa:.3f}x)"
                for name, (us, nbytes) in times.items()) + f"; floor {floor_us:.1f}",
                flush=True)


if __name__ == "__main__":
    main()

"""How fast can any kernel read the paged cache? The bound under bf16's 1.0x target.

A Triton kernel that does nothing but read: one program per (sequence, KV head) walks the
sequence's pages through the block table and sums its K and V rows (one float out per
program). Its best time over a few warp and pipeline settings is timed (bench_decode's
bench: a CUDA graph replay after the L2 flush) on the same bytes laid out four ways: the
contiguous [B, Hkv, L, D] K/V that contiguous SDPA reads (as 16-token pages in order), the
table's random 16-token pages (NHD), the same pages in order, and random pages in HND.
Next to them: contiguous SDPA (the best of cuDNN and flash) and pagedfuse's bf16 decode on
the random NHD pages. If the reader itself is slower on random pages than SDPA on
contiguous K/V, no paged decode can reach 1.0x there::

    python benchmarks/page_read.py            # B=64, L=8192 and 32768, all geometries
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from bench_decode import GEOMETRIES, Case, _pf_call, bench, best_contiguous, copy_bandwidth

CONFIGS = ((4, 2), (4, 3), (8, 3), (8, 4))  # (num_warps, pipeline stages) tried per layout
REPS = dict(warmup=5, rep=20)


@triton.jit
def _read_pages(k_ptr, v_ptr, table_ptr, out_ptr, n_pages, s_block, s_token, s_head,
                s_table, HEADS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                STAGES: tl.constexpr):
    pid = tl.program_id(0)
    row, head = pid // HEADS, pid % HEADS
    offs = tl.arange(0, PAGE)[:, None] * s_token + tl.arange(0, D)[None, :]
    acc = tl.zeros([PAGE, D], dtype=tl.float32)
    for i in tl.range(0, n_pages, num_stages=STAGES):
        block = tl.load(table_ptr + row * s_table + i).to(tl.int64)
        base = block * s_block + head * s_head
        acc += tl.load(k_ptr + base + offs).to(tl.float32)
        acc += tl.load(v_ptr + base + offs).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def page_reader(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, warps: int,
                stages: int) -> Callable[[], torch.Tensor]:
    """A call that reads every page ``table`` lists from the [blocks, page, H, D] views k
    and v (any strides, 16-token pages) for each of their H heads: [rows * H] sums."""
    blocks, page, heads, d = k.shape
    assert k.stride() == v.stride() and k.stride(3) == 1, "K and V laid out alike, D inner"
    out = torch.empty(table.shape[0] * heads, device=k.device, dtype=torch.float32)

    def call() -> torch.Tensor:
        _read_pages[(out.numel(),)](k, v, table, out, table.shape[1], k.stride(0), k.stride(1),
                                    k.stride(2), table.stride(0), HEADS=heads, PAGE=page, D=d,
                                    STAGES=stages, num_warps=warps)
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


def best_us(k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, reference: float) -> float:
    """The reader's fastest median over CONFIGS, once its sums over all the pages are seen to
    match ``reference`` (the sum of all of K and V)."""
    total = float(page_reader(k, v, table, *CONFIGS[0])().double().sum())
    if abs(total - reference) > 1e-4 * (abs(reference) + 1e4):
        raise AssertionError(f"the page reader summed {total}, expected {reference}")
    return min(bench(page_reader(k, v, table, w, s), REPS) for w, s in CONFIGS)


LAYOUTS = {"random NHD": dict(hnd=False), "in order NHD": dict(hnd=False, shuffle=False),
           "random HND": dict(hnd=True)}


def measure(geo: tuple[int, int, int], batch: int, length: int) -> tuple[dict, int]:
    """name -> µs of the reader in each layout, contiguous SDPA and pagedfuse's bf16 decode;
    and the K/V bytes."""
    times = {}
    for name, kwargs in LAYOUTS.items():
        case = Case(geo, batch, length, **kwargs)
        reference = float(case.k_contig.sum(dtype=torch.float64)
                          + case.v_contig.sum(dtype=torch.float64))
        if not times:
            times["reader, contiguous"] = best_us(*contiguous_pages(case), reference)
            times["contiguous SDPA"] = min(best_contiguous(case, REPS).values())
            times["pagedfuse bf16, random NHD"] = bench(lambda c=case: _pf_call(c, "bf16"),
                                                        REPS)
        times[f"reader, {name}"] = best_us(case.k, case.v, case.table, reference)
        nbytes = case.bytes("bf16")
        del case
        torch.cuda.empty_cache()
    return times, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geos", nargs="+", choices=list(GEOMETRIES), default=list(GEOMETRIES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for gname in args.geos:
        for length in args.lengths:
            times, nbytes = measure(GEOMETRIES[gname], args.batch, length)
            sdpa = times["contiguous SDPA"]
            print(f"page read {gname} B={args.batch} L={length}: " + ", ".join(
                f"{name} {us:.1f} ({nbytes / us / 1e6:.2f} TB/s, {us / sdpa:.3f}x)"
                for name, us in times.items()) + f"; floor {nbytes / bw * 1e6:.1f}", flush=True)


if __name__ == "__main__":
    main()

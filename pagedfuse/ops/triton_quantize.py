"""Triton kernel for quantize_int8: symmetric per-row int8, bit-exact with the reference.

Exactness needs IEEE division (Triton's plain ``/`` is approximate on the GPU) and rounding
half to even: on the GPU libdevice's rint (one instruction); under Triton's CPU interpreter,
which has no libdevice, the same rounding built from floor(). A NaN is carried explicitly
(tl.max and tl.minimum drop NaN on the GPU): the row's maximum propagates it, so a row
holding one has scale NaN, and an element whose quotient is NaN is stored as 0, as in the
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagedfuse.ops.call import next_power_of_2

# 8 warps over a program's 4096 elements: on the H200 0.77-0.91x the time of 4 warps with
# floor()'s rounding and a second reduction for NaN (the prefill queries of
# benchmarks/bench_prefill.py; benchmarks/results/prefill_summary.md)
WARPS = 8


@triton.jit
def round_half_even(x):
    """Nearest integer, ties to even (exact for |x| < 2**23)."""
    r = tl.floor(x)
    frac = x - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, rows, row_len, BLOCK: tl.constexpr,
                          ROWS: tl.constexpr, RINT: tl.constexpr):
    """Rows [pid * ROWS, pid * ROWS + ROWS): many rows per program, since a program per
    128-element row spends its time being scheduled (a query of 8K tokens x 32 heads is
    262144 rows). RINT: libdevice's rint rounds (a GPU)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK)
    valid = (row < rows)[:, None] & (offs < row_len)[None, :]
    at = row[:, None] * row_len + offs[None, :]
    x = tl.load(x_ptr + at, mask=valid, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.reduce(tl.abs(x), 1, _nan_max), 127.0)
    safe = tl.where(scale > 0.0, scale, 1.0)
    y = tl.math.div_rn(x, safe[:, None])
    if RINT:
        q = libdevice.rint(y)
    else:
        q = round_half_even(y)
    q = tl.minimum(tl.maximum(tl.where(q != q, 0.0, q), -127.0), 127.0)
    tl.store(q_ptr + at, q.to(tl.int8), mask=valid)
    tl.store(s_ptr + row, scale, mask=row < rows)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_int8, scale = max|x| / 127 as float32) over the last dim, 4096 elements per
    program (the Triton kernels' query quantization, and quantize_int8 on CUDA where the
    CUDA C++ library does not run)."""
    row_len = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    s = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if q.numel() == 0:
        return q, s.zero_()  # no rows, or empty rows whose max|x| is taken as 0
    rows = x.reshape(-1, row_len).contiguous()
    block = next_power_of_2(row_len)
    per_program = max(1, 4096 // block)
    grid = (triton.cdiv(rows.shape[0], per_program),)
    _quantize_rows_kernel[grid](rows, q, s, rows.shape[0], row_len, BLOCK=block,
                                ROWS=per_program, RINT=rows.is_cuda, num_warps=WARPS)
    return q, s

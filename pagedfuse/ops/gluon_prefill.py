"""Gluon paged prefill for INT8 K on Hopper: Q·K^T of the next key tile runs during this
tile's softmax.

Triton's ``tl.dot`` waits for each Q·K^T wgmma where it is issued (its pipeliner keeps only
a loop-carried accumulator in flight), so the int8 tensor-core time is never hidden behind
the softmax (benchmarks/results/prefill_summary.md). Gluon places the wait by hand: per key
tile j the loop issues tile j+1's int8 ``warpgroup_mma`` (s8 x s8 -> s32) asynchronously, runs
tile j's softmax and P·V, and only then waits for it.

Layout of the work: grid (head pack, query tile, sequence) as in triton_prefill.py (the
longest causal tiles first); a tile holds ``block_m`` rows, token-major over ``pack`` query
heads of one GQA group, 64 rows per warpgroup. Q is quantized once per (token, head) before
the kernel and kept in shared memory. K, V and the key scales of each tile are gathered
through the block table with cp.async (16-token pages: TMA cannot gather them) into
NVMMA-swizzled shared memory, ``stages`` buffers deep (tile i in buffer i % stages; the copy
of tile j + stages - 1 is issued at step j, so each copy has one step to land). Scores:
int32 -> fp32 by their bits (0x4B400000 + x is the float 1.5 * 2**23 + x for |x| < 2**22)
and one FFMA with the key's scale; the row's q_scale * softmax scale * log2(e) joins the
exp2's FMA. Softmax online in fp32, log2 domain; P·V is a bf16/fp16 wgmma with P from
registers and V from shared memory.

Causal masking is bottom-right aligned; tiles wholly above the diagonal are never visited,
and only tiles that reach past the first row's last key or the sequence take the masked
softmax. Lengths and block ids are clamped as in triton_prefill.py, so no value moves a
read outside the cache or the table; keys past a tile's last needed key are zero-filled,
not read. No host synchronisation: a launch captures in a CUDA graph. NaN and Inf follow
triton_prefill.py's documented semantics and deviations (the tensor-core P·V on the
diagonal multiplies a NaN or Inf in V into rows that do not read that key; an INT8 K scale
above about 2.7e31 makes the score NaN).

Requires Triton with Gluon (3.5+; checked with 3.6) and compute capability 9.0 exactly
(wgmma). Imported only by the gluon_prefill backend's ``run``, never at package import.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from pagedfuse.ops.backends.gluon_prefill import GluonPlan, check_plan, default_plan
from pagedfuse.ops.call import PagedCall
from pagedfuse.ops.triton_paged import LOG2E
from pagedfuse.ops.triton_quantize import quantize_int8

MAGIC = gl.constexpr(0x4B400000)  # the bits of the float 1.5 * 2**23
MAGIC_F = gl.constexpr(12582912.0)


@gluon.jit
def _cache_blocks(blk, num_blocks):
    """Block ids as ``cache[block_table]`` reads them ([-num_blocks, 0) wraps), clamped into
    the cache."""
    blk = blk.to(gl.int64)
    blk = gl.where(blk < 0, blk + num_blocks, blk)
    return gl.minimum(gl.maximum(blk, 0), num_blocks - 1)


@gluon.jit
def _copy_tile(k_buf, v_buf, ks_buf, k_ptr, v_ptr, ks_ptr, bt_row_ptr, start, end, kvh,
               num_blocks, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
               stride_ksb, stride_kst, stride_ksh, stride_btn,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
               COPY: gl.constexpr):
    """cp.async of key tile [start, start + BLOCK_N) into one buffer: K and V rows and the
    key scales, gathered through the block table; keys >= ``end`` are zero-filled, not
    read."""
    offs_n = start + gl.arange(0, BLOCK_N, gl.SliceLayout(1, COPY))
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, COPY))
    ok = offs_n < end
    blk = gl.load(bt_row_ptr + (offs_n // PAGE) * stride_btn, mask=ok, other=0)
    blk = _cache_blocks(blk, num_blocks)
    slot = offs_n % PAGE
    k_row = blk * stride_kb + slot * stride_kt + kvh * stride_kh
    v_row = blk * stride_vb + slot * stride_vt + kvh * stride_vh
    mask = ok[:, None]
    cp.async_copy_global_to_shared(k_buf, k_ptr + k_row[:, None] + offs_d[None, :], mask=mask)
    cp.async_copy_global_to_shared(v_buf, v_ptr + v_row[:, None] + offs_d[None, :], mask=mask)
    cp.async_copy_global_to_shared(
        ks_buf, ks_ptr + blk * stride_ksb + slot * stride_kst + kvh * stride_ksh, mask=ok)


@gluon.jit
def _probs(s, m_i, row_scale, offs_n, row_end, MASKED: gl.constexpr):
    """Tile weights exp2(s * row_scale - m) and the new row maxima, from key-scaled scores
    ``s``. MASKED: key n counts for row i only below row_end[i]; otherwise every key counts
    and the scale folds into the exp2's FMA (row_scale >= 0)."""
    if MASKED:
        x = gl.where(offs_n[None, :] < row_end[:, None], s * row_scale[:, None], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(x, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = gl.exp2(x - m_use[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * row_scale)
        m_use = m_new
        p = gl.exp2(s * row_scale[:, None] - m_use[:, None])
    return p, m_new, m_use


@gluon.jit
def gluon_prefill_kernel(
    q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    sm_scale_log2, num_tokens, num_q_heads, num_blocks, max_blocks,
    stride_qt, stride_qh, stride_qst, stride_qsh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst, stride_ksh, stride_btb,
    stride_btn,
    GROUP: gl.constexpr, PACK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    COPY_TPW_D: gl.constexpr,
):
    """Grid (num_q_heads / PACK, query tiles, batch); num_warps = BLOCK_M // 16."""
    NUM_WARPS: gl.constexpr = BLOCK_M // 16
    TOKENS: gl.constexpr = BLOCK_M // PACK
    # 16-byte cp.async per thread and row piece (int8 K: one, 16-bit V: two)
    COPY: gl.constexpr = gl.BlockedLayout([1, 16], [32 // COPY_TPW_D, COPY_TPW_D],
                                          [NUM_WARPS, 1], [1, 0])
    QK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                 instr_shape=[16, BLOCK_N, 32])
    PV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                 instr_shape=[16, HEAD_DIM, 16])
    half: gl.constexpr = out_ptr.dtype.element_ty
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=PV, k_width=2)
    Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.int8)
    K_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.int8)
    V_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], half)
    S_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

    pid_h = gl.program_id(0)
    tile = gl.num_programs(1) - 1 - gl.program_id(1)  # causal: the longest tiles first
    b = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
    seq_len = gl.minimum(gl.maximum(seq_len, 0), max_blocks * PAGE)
    q_start = gl.minimum(gl.maximum(gl.load(qsl_ptr + b).to(gl.int32), 0), num_tokens)
    q_end = gl.minimum(gl.maximum(gl.load(qsl_ptr + b + 1).to(gl.int32), q_start), num_tokens)
    q_len = q_end - q_start
    t0 = tile * TOKENS
    if t0 >= q_len:
        return
    kvh = (pid_h * PACK) // GROUP
    ctx = seq_len - q_len  # keys before the first query token
    if CAUSAL:
        hi = gl.minimum(seq_len, ctx + t0 + TOKENS)  # the tile's last token sees keys < hi
        full = gl.maximum(gl.minimum(ctx + t0 + 1, hi), 0)  # ... and its first, keys < full
    else:
        hi = seq_len
        full = seq_len
    hi = gl.maximum(hi, 0)
    num_tiles = gl.cdiv(hi, BLOCK_N)
    bt_row_ptr = bt_ptr + b.to(gl.int64) * stride_btb

    k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HEAD_DIM], K_SMEM)
    v_smem = gl.allocate_shared_memory(half, [STAGES, BLOCK_N, HEAD_DIM], V_SMEM)
    ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], S_SMEM)
    for i in gl.static_range(STAGES - 1):  # the first tiles' copies
        _copy_tile(k_smem.index(i), v_smem.index(i), ks_smem.index(i), k_ptr, v_ptr, ks_ptr,
                   bt_row_ptr, i * BLOCK_N, hi, kvh, num_blocks, stride_kb, stride_kt,
                   stride_kh, stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst,
                   stride_ksh, stride_btn, BLOCK_N, HEAD_DIM, PAGE, COPY)
        cp.commit_group()

    # Q (int8) into shared memory, rows token-major over the packed heads
    rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, COPY))
    t = t0 + rows // PACK
    row_ok = (t < q_len) & (rows < TOKENS * PACK)
    tok = (q_start + t).to(gl.int64)
    head = pid_h * PACK + rows % PACK
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, COPY))
    q = gl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=row_ok[:, None], other=0)
    q_smem = gl.allocate_shared_memory(gl.int8, [BLOCK_M, HEAD_DIM], Q_SMEM, q)

    # per-row constants in the score tile's layout
    rows_s = gl.arange(0, BLOCK_M, gl.SliceLayout(1, QK))
    t_s = t0 + rows_s // PACK
    ok_s = (t_s < q_len) & (rows_s < TOKENS * PACK)
    row_scale = gl.load(qs_ptr + (q_start + t_s).to(gl.int64) * stride_qst
                        + (pid_h * PACK + rows_s % PACK) * stride_qsh,
                        mask=ok_s, other=0.0) * sm_scale_log2
    if CAUSAL:
        row_end = gl.minimum(ctx + t_s + 1, seq_len)  # row i reads keys < row_end[i]
    else:
        row_end = gl.full([BLOCK_M], 0, gl.int32, gl.SliceLayout(1, QK)) + seq_len
    cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, QK))

    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, QK)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, QK))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, QK))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, PV)

    cp.wait_group(STAGES - 2)  # tile 0 landed
    gl.thread_barrier()
    fence_async_shared()
    s_cur = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
    s_cur = warpgroup_mma_wait(0, deps=(s_cur,))
    for j in range(num_tiles):
        cp.wait_group(STAGES - 3)  # tile j + 1 landed
        # every warp is past step j - 1: its P·V and this Q·K^T's buffers are free to refill
        gl.thread_barrier()
        nxt = j + STAGES - 1
        buf = nxt % STAGES
        _copy_tile(k_smem.index(buf), v_smem.index(buf), ks_smem.index(buf), k_ptr, v_ptr,
                   ks_ptr, bt_row_ptr, nxt * BLOCK_N, hi, kvh, num_blocks, stride_kb,
                   stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ksb,
                   stride_kst, stride_ksh, stride_btn, BLOCK_N, HEAD_DIM, PAGE, COPY)
        cp.commit_group()
        fence_async_shared()
        # the next tile's Q·K^T runs on the tensor cores during this tile's softmax
        s_next = warpgroup_mma(q_smem, k_smem.index((j + 1) % STAGES).permute((1, 0)), zero_s,
                               use_acc=False, is_async=True)
        cur = j % STAGES
        k_scale = ks_smem.index(cur).load(gl.SliceLayout(0, QK))
        # int32 -> fp32 by its bits, then one FFMA with the key's scale (an Inf scale gives
        # Inf - Inf = NaN, as the dequantized key's 0 * Inf does)
        s = (s_cur + MAGIC).to(gl.float32, bitcast=True)
        s = gl.fma(s, k_scale[None, :], (k_scale * -MAGIC_F)[None, :])
        start = j * BLOCK_N
        if start + BLOCK_N <= full:  # every key visible to every row
            p, m_new, m_use = _probs(s, m_i, row_scale, start + cols, row_end, False)
        else:
            p, m_new, m_use = _probs(s, m_i, row_scale, start + cols, row_end, True)
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, PV))[:, None]
        p16 = gl.convert_layout(p.to(half), P_OP)
        acc = warpgroup_mma(p16, v_smem.index(cur), acc, is_async=True)
        s_cur, acc, p16 = warpgroup_mma_wait(0, deps=(s_next, acc, p16))
    cp.wait_group(0)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, PV))
    o = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]  # a row that saw no key writes zeros
    o = gl.convert_layout(o.to(half), COPY)
    out_row = tok * num_q_heads + head
    gl.store(out_ptr + out_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None])


class Launch(NamedTuple):
    """One launch of gluon_prefill_kernel (separate from the launch itself so that a tool
    can compile it offline)."""

    grid: tuple[int, int, int]
    args: tuple
    options: dict


def launch_args(call: PagedCall, out: torch.Tensor, plan: GluonPlan, q: torch.Tensor,
                q_scale: torch.Tensor) -> Launch:
    """The launch of ``call`` under ``plan``; ``q``: the int8 query with its per-(token,
    head) scales ``q_scale``."""
    g = call.geometry
    kc, vc, ks = call.key_cache, call.value_cache, call.key_scale
    tiles = triton.cdiv(call.query_bound, plan.tokens)
    grid = (g.num_q_heads // plan.pack, tiles, g.batch)
    args = (
        q, q_scale, kc, vc, ks, call.block_table, call.seq_lens, call.query_start_loc, out,
        call.scale * LOG2E, g.num_tokens, g.num_q_heads, g.num_blocks, g.max_blocks,
        q.stride(0), q.stride(1), *q_scale.stride(), *kc.stride()[:3], *vc.stride()[:3],
        *ks.stride(), *call.block_table.stride(),
    )
    options = dict(
        GROUP=g.group, PACK=plan.pack, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        HEAD_DIM=g.head_dim, PAGE=g.block_size, STAGES=plan.stages, CAUSAL=call.causal,
        COPY_TPW_D=min(g.head_dim // 16, 32), num_warps=plan.num_warps,
    )
    return Launch(grid, args, options)


def prefill_into(call: PagedCall, out: torch.Tensor, plan: GluonPlan | None = None) -> None:
    """Fill contiguous ``out`` [T, Hq, D] with the attention of ``call`` (a call the
    backend's ``supports`` takes); ``plan`` overrides the default launch."""
    plan = plan or default_plan(call)
    check_plan(call, plan)
    if not out.is_contiguous() or tuple(out.shape) != tuple(call.query.shape):
        raise ValueError(f"out: must be contiguous {tuple(call.query.shape)}, got shape "
                         f"{tuple(out.shape)} strides {tuple(out.stride())}")
    g = call.geometry
    if g.num_tokens == 0 or g.batch == 0:
        return
    q, q_scale = quantize_int8(call.query)
    launch = launch_args(call, out, plan, q, q_scale)
    gluon_prefill_kernel[launch.grid](*launch.args, **launch.options)

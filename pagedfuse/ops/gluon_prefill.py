"""Gluon paged prefill for INT8 K on Hopper: the int8 Q·K^T of one key tile runs on the
tensor cores while the softmax of another runs on the CUDA cores.

Triton's ``tl.dot`` waits for each Q·K^T wgmma where it is issued (its pipeliner keeps only
a loop-carried accumulator in flight), so the int8 tensor-core time is never hidden behind
the softmax (benchmarks/results/prefill_summary.md). Gluon places the waits by hand. Two
pipelines, chosen by ``GluonPlan.pipeline``:

- ``"ws"`` (ws_prefill_kernel, FlashAttention-3's structure). Warp-specialized: one producer
  warp with few registers and one or two consumer warpgroups of 64 query rows each. The
  producer loads each key tile with TMA: a page of one KV head is a [min(page, block_n), D]
  box of a 2D view of the cache whose rows are tokens (row stride: the cache's token
  stride; page (block, head) starts at row block * stride_b / stride_t + head * stride_h //
  stride_t, column head * stride_h % stride_t, which covers NHD and HND), so a tile is one
  box per page (per 128 bytes of a row), all signalling the tile's ``ready`` mbarrier with
  its byte count. The tile's key scales are loaded into registers before the producer waits
  for the buffer and stored to shared memory after. The one tile that reaches past the
  sequence's last key is copied with cp.async instead, zero-filled past it: a slot past the
  sequence may hold any bits (NaN too), and P·V would carry them into the rows with weight
  0. Each consumer issues tile j+1's Q·K^T and tile j's P·V together and then runs tile
  j+1's softmax while P·V is still on the tensor cores (FA3's intra-warpgroup overlap); two
  consumers take turns issuing (two ``turn`` mbarriers: FA3's ping-pong), so one's softmax
  runs while the other's wgmma do. A consumer releases a buffer (``empty``) once its P·V
  on it is done.
- ``"cp"`` (gluon_prefill_kernel): one partition of ``block_m // 16`` warps; K, V and the
  key scales gathered through the block table with cp.async (any page size and stride),
  ``stages`` buffers deep (tile i in buffer i % stages; the copy of tile j + stages - 1 is
  issued at step j); per key tile j it issues tile j+1's Q·K^T, runs tile j's softmax and
  P·V, and only then waits. Two CTA-wide barriers per tile keep its warpgroups in step.

Both: grid (head pack, query tile, sequence) as in triton_prefill.py (the longest causal
tiles first); a tile holds ``block_m`` rows, token-major over ``pack`` query heads of one
GQA group. Q is quantized once per (token, head) before the kernel and kept in shared
memory. Scores: int32 -> fp32 by their bits (0x4B400000 + x is the float 1.5 * 2**23 + x for
|x| < 2**22) and one FFMA with the key's scale; the row's q_scale * softmax scale * log2(e)
joins the exp2's FMA. Softmax online in fp32, log2 domain; P·V is a bf16/fp16 wgmma with P
from registers and V from shared memory.

Causal masking is bottom-right aligned; tiles wholly above the diagonal are never visited,
and only tiles that reach past a row group's first row's last key or the sequence take the
masked softmax. Lengths and block ids are clamped as in triton_prefill.py, so no value moves a
read outside the cache or the table. No host synchronisation: a launch captures in a CUDA
graph (the TMA descriptors are kernel parameters built on the host from the cache's address
and strides). NaN and Inf follow triton_prefill.py's documented semantics and deviations
(the tensor-core P·V on the diagonal multiplies a NaN or Inf in V into rows that do not read
that key; an INT8 K scale above about 2.7e31 makes the score NaN).

Requires Triton with Gluon (3.6: ``warp_specialize`` with register counts, TMA descriptors)
and compute capability 9.0 exactly (wgmma). Imported only by the gluon_prefill backend's
``run`` and by benchmarks/prefill_asm.py, never at package import.
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
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from pagedfuse.ops.backends.gluon_prefill import (
    CONSUMER_REGS,
    PRODUCER_REGS,
    SWIZZLE,
    GluonPlan,
    check_plan,
    default_plan,
    tma_rows,
)
from pagedfuse.ops.call import PagedCall
from pagedfuse.ops.triton_paged import LOG2E
from pagedfuse.ops.triton_quantize import quantize_int8

MAGIC = gl.constexpr(0x4B400000)  # the bits of the float 1.5 * 2**23
MAGIC_F = gl.constexpr(12582912.0)
WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup of the "ws" kernel


# ---- shared by both pipelines -----------------------------------------------------------

@gluon.jit
def _cache_blocks(blk, num_blocks):
    """Block ids as ``cache[block_table]`` reads them ([-num_blocks, 0) wraps), clamped into
    the cache."""
    blk = blk.to(gl.int64)
    blk = gl.where(blk < 0, blk + num_blocks, blk)
    return gl.minimum(gl.maximum(blk, 0), num_blocks - 1)


@gluon.jit
def _sequence(seq_lens_ptr, qsl_ptr, b, num_tokens, max_blocks, PAGE: gl.constexpr):
    """Sequence ``b``'s key count, first query token and query count, clamped into the
    table and the query."""
    seq_len = gl.load(seq_lens_ptr + b).to(gl.int32)
    seq_len = gl.minimum(gl.maximum(seq_len, 0), max_blocks * PAGE)
    q_start = gl.minimum(gl.maximum(gl.load(qsl_ptr + b).to(gl.int32), 0), num_tokens)
    q_end = gl.minimum(gl.maximum(gl.load(qsl_ptr + b + 1).to(gl.int32), q_start), num_tokens)
    return seq_len, q_start, q_end - q_start


@gluon.jit
def _key_bounds(seq_len, ctx, t_first, tokens, CAUSAL: gl.constexpr):
    """Keys < hi are read by the last of ``tokens`` query tokens from ``t_first``, keys <
    full by the first (``ctx``: keys before the sequence's first query token)."""
    if CAUSAL:
        hi = gl.maximum(gl.minimum(seq_len, ctx + t_first + tokens), 0)
        full = gl.maximum(gl.minimum(ctx + t_first + 1, hi), 0)
    else:
        hi = seq_len
        full = seq_len
    return hi, full


@gluon.jit
def _row_constants(qs_ptr, rows, t0, q_start, q_len, seq_len, ctx, pid_h, stride_qst,
                   stride_qsh, sm_scale_log2, PACK: gl.constexpr, TOKENS: gl.constexpr,
                   CAUSAL: gl.constexpr):
    """Per score row: q_scale * softmax scale * log2(e), and the keys it reads (< row_end)."""
    t = t0 + rows // PACK
    ok = (t < q_len) & (rows < TOKENS * PACK)
    row_scale = gl.load(qs_ptr + (q_start + t).to(gl.int64) * stride_qst
                        + (pid_h * PACK + rows % PACK) * stride_qsh,
                        mask=ok, other=0.0) * sm_scale_log2
    if CAUSAL:
        row_end = gl.minimum(ctx + t + 1, seq_len)
    else:
        row_end = gl.zeros_like(t) + seq_len
    return row_scale, row_end


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
def _online(s_int, k_scale, m_i, l_i, row_scale, row_end, start, full, cols,
            BLOCK_N: gl.constexpr):
    """One key tile of the online softmax from its int32 scores: the weights, the new row
    maxima and sums, and the factor the accumulator takes (the masked path only for a tile
    that reaches past ``full``)."""
    # int32 -> fp32 by its bits, then one FFMA with the key's scale (an Inf scale gives
    # Inf - Inf = NaN, as the dequantized key's 0 * Inf does)
    s = (s_int + MAGIC).to(gl.float32, bitcast=True)
    s = gl.fma(s, k_scale[None, :], (k_scale * -MAGIC_F)[None, :])
    if start + BLOCK_N <= full:  # every key visible to every row
        p, m_new, m_use = _probs(s, m_i, row_scale, start + cols, row_end, False)
    else:
        p, m_new, m_use = _probs(s, m_i, row_scale, start + cols, row_end, True)
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _store_rows(out_ptr, acc, l_i, rows, t0, q_start, q_len, num_q_heads, pid_h,
                PACK: gl.constexpr, TOKENS: gl.constexpr, HEAD_DIM: gl.constexpr,
                PV: gl.constexpr, COPY: gl.constexpr):
    """out rows of this tile: acc / l (a row that saw no key writes zeros)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, PV))
    o = acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]
    o = gl.convert_layout(o.to(out_ptr.dtype.element_ty), COPY)
    t = t0 + rows // PACK
    ok = (t < q_len) & (rows < TOKENS * PACK)
    out_row = (q_start + t).to(gl.int64) * num_q_heads + pid_h * PACK + rows % PACK
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, COPY))
    gl.store(out_ptr + out_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=ok[:, None])


@gluon.jit
def _load_q(q_ptr, rows, t0, q_start, q_len, pid_h, stride_qt, stride_qh,
            PACK: gl.constexpr, TOKENS: gl.constexpr, HEAD_DIM: gl.constexpr,
            COPY: gl.constexpr):
    """The int8 query rows of this tile, token-major over the packed heads (0 past the
    sequence's queries)."""
    t = t0 + rows // PACK
    ok = (t < q_len) & (rows < TOKENS * PACK)
    off = (q_start + t).to(gl.int64) * stride_qt + (pid_h * PACK + rows % PACK) * stride_qh
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, COPY))
    return gl.load(q_ptr + off[:, None] + offs_d[None, :], mask=ok[:, None], other=0)


@gluon.jit
def _copy_keys(k_buf, v_buf, ks_buf, k_ptr, v_ptr, ks_ptr, bt_row_ptr, start, end, kvh,
               num_blocks, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
               stride_ksb, stride_kst, stride_ksh, stride_btn, ROWS: gl.constexpr,
               HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, COPY: gl.constexpr):
    """cp.async of keys [start, start + ROWS) into ``k_buf``, ``v_buf`` and ``ks_buf``: K
    and V rows and the key scales, gathered through the block table; keys >= ``end`` are
    zero-filled, not read."""
    offs_n = start + gl.arange(0, ROWS, gl.SliceLayout(1, COPY))
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, COPY))
    ok = offs_n < end
    blk = _cache_blocks(gl.load(bt_row_ptr + (offs_n // PAGE) * stride_btn, mask=ok, other=0),
                        num_blocks)
    slot = offs_n % PAGE
    k_row = blk * stride_kb + slot * stride_kt + kvh * stride_kh
    v_row = blk * stride_vb + slot * stride_vt + kvh * stride_vh
    cp.async_copy_global_to_shared(k_buf, k_ptr + k_row[:, None] + offs_d[None, :],
                                   mask=ok[:, None])
    cp.async_copy_global_to_shared(v_buf, v_ptr + v_row[:, None] + offs_d[None, :],
                                   mask=ok[:, None])
    cp.async_copy_global_to_shared(
        ks_buf, ks_ptr + blk * stride_ksb + slot * stride_kst + kvh * stride_ksh, mask=ok)


# ---- "ws": warp-specialized, TMA -----------------------------------------------------------

@gluon.jit
def _box(buf, chunk, row, rows: gl.constexpr, desc):
    """Rows [row, row + rows) of 128-byte column chunk ``chunk`` of a [keys, D] buffer, as
    the destination of one TMA box: an NVMMA tile with 128-byte swizzle stores its columns
    in 128-byte chunks of all rows, one after another."""
    width: gl.constexpr = desc.block_type.shape[1]
    chunks: gl.constexpr = buf.type.shape[1] // width
    keys: gl.constexpr = buf.type.shape[0]
    view = buf._reinterpret(buf.dtype, [chunks * keys, width], desc.layout)
    return view.slice(chunk * keys + row, rows)


@gluon.jit
def _producer(args, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
              STAGES: gl.constexpr, COPY_TPW_D: gl.constexpr):
    """One warp: fills buffer j % STAGES with key tile j once the consumers released it."""
    (k_desc, v_desc, k_ptr, v_ptr, ks_ptr, bt_row_ptr, k_smem, v_smem, ks_smem, ready, empty,
     seq_len, num_tiles, kvh, num_blocks, stride_kb, stride_kt, stride_kh, stride_vb,
     stride_vt, stride_vh, stride_ksb, stride_kst, stride_ksh, stride_btn) = args
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    KW: gl.constexpr = k_desc.block_type.shape[1]
    VW: gl.constexpr = v_desc.block_type.shape[1]
    TILE_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * (1 + v_desc.dtype.primitive_bitwidth // 8)
    KEYS: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
    TAIL: gl.constexpr = gl.BlockedLayout([1, 16], [32 // COPY_TPW_D, COPY_TPW_D], [1, 1],
                                          [1, 0])
    TAIL_ROWS: gl.constexpr = 8  # rows per cp.async step of the tail tile (few registers)
    # where the page (block, kvh) starts in the TMA views: row block * per_block + row0,
    # column col (int32: the backend checks that the views have fewer than 2**31 rows)
    k_per_block = (stride_kb // stride_kt).to(gl.int32)
    k_row0 = ((kvh * stride_kh) // stride_kt).to(gl.int32)
    k_col = ((kvh * stride_kh) % stride_kt).to(gl.int32)
    v_per_block = (stride_vb // stride_vt).to(gl.int32)
    v_row0 = ((kvh * stride_vh) // stride_vt).to(gl.int32)
    v_col = ((kvh * stride_vh) % stride_vt).to(gl.int32)
    for j in range(num_tiles):
        i = j % STAGES
        start = j * BLOCK_N
        # the key scales (for a tile in the sequence), loaded before waiting for the buffer
        # so that their latency overlaps the wait
        offs = start + gl.arange(0, BLOCK_N, KEYS)
        ok = offs < seq_len
        blk = _cache_blocks(gl.load(bt_row_ptr + (offs // PAGE) * stride_btn, mask=ok,
                                    other=0), num_blocks)
        k_scale = gl.load(ks_ptr + blk * stride_ksb + (offs % PAGE) * stride_kst
                          + kvh * stride_ksh, mask=ok, other=0.0)
        mbarrier.wait(empty.index(i), ((j // STAGES) & 1) ^ 1)
        k_buf = k_smem.index(i)
        v_buf = v_smem.index(i)
        bar = ready.index(i)
        if start + BLOCK_N <= seq_len:
            mbarrier.expect(bar, TILE_BYTES)
            for p in gl.static_range(BLOCK_N // BOX):
                key = start + p * BOX
                page_blk = _cache_blocks(gl.load(bt_row_ptr + (key // PAGE) * stride_btn),
                                         num_blocks).to(gl.int32)
                slot = key % PAGE
                k_row = page_blk * k_per_block + k_row0 + slot
                v_row = page_blk * v_per_block + v_row0 + slot
                for c in gl.static_range(HEAD_DIM // KW):
                    tma.async_copy_global_to_shared(k_desc, [k_row, k_col + c * KW], bar,
                                                    _box(k_buf, c, p * BOX, BOX, k_desc))
                for c in gl.static_range(HEAD_DIM // VW):
                    tma.async_copy_global_to_shared(v_desc, [v_row, v_col + c * VW], bar,
                                                    _box(v_buf, c, p * BOX, BOX, v_desc))
            ks_smem.index(i).store(k_scale)
            mbarrier.arrive(bar, count=1)
        else:  # the tile past the sequence's last key, zero-filled there, with its scales
            for r in gl.static_range(0, BLOCK_N, TAIL_ROWS):
                _copy_keys(k_buf.slice(r, TAIL_ROWS), v_buf.slice(r, TAIL_ROWS),
                           ks_smem.index(i).slice(r, TAIL_ROWS), k_ptr, v_ptr, ks_ptr,
                           bt_row_ptr, start + r, seq_len, kvh, num_blocks, stride_kb,
                           stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ksb,
                           stride_kst, stride_ksh, stride_btn, TAIL_ROWS, HEAD_DIM, PAGE, TAIL)
            cp.commit_group()
            cp.wait_group(0)
            fence_async_shared()  # the wgmma read K and V through the async proxy
            mbarrier.arrive(bar, count=2)


@gluon.jit
def _take_turn(turn, WG: gl.constexpr, k, CONSUMERS: gl.constexpr):
    """Wait until the other consumer issued its MMAs of turn k - 1 (consumer 0 goes first)."""
    if CONSUMERS == 2:
        mbarrier.wait(turn.index(WG), (k & 1) ^ (1 - WG))


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, CONSUMERS: gl.constexpr):
    if CONSUMERS == 2:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _consumer(WG: gl.constexpr, args, PACK: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              CONSUMERS: gl.constexpr, COPY_TPW_D: gl.constexpr):
    """One warpgroup: rows [WG * 64, WG * 64 + 64) of the tile over every key tile (``args``:
    one tuple for both consumers, since a partition's arguments cannot be spliced)."""
    (q_ptr, qs_ptr, out_ptr, q_smem, k_smem, v_smem, ks_smem, ready, empty, turn,
     sm_scale_log2, num_q_heads, q_start, q_len, seq_len, ctx, hi, num_tiles, t0, pid_h,
     stride_qt, stride_qh, stride_qst, stride_qsh) = args
    TOKENS: gl.constexpr = WG_ROWS * CONSUMERS // PACK
    COPY: gl.constexpr = gl.BlockedLayout([1, 16], [32 // COPY_TPW_D, COPY_TPW_D], [4, 1],
                                          [1, 0])
    QK: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, BLOCK_N, 32])
    PV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, HEAD_DIM, 16])
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=PV, k_width=2)
    half: gl.constexpr = out_ptr.dtype.element_ty

    rows = WG * WG_ROWS + gl.arange(0, WG_ROWS, gl.SliceLayout(1, COPY))
    q_buf = q_smem.index(WG)
    q_buf.store(_load_q(q_ptr, rows, t0, q_start, q_len, pid_h, stride_qt, stride_qh, PACK,
                        TOKENS, HEAD_DIM, COPY))
    fence_async_shared()  # the wgmma read it through the async proxy
    rows_s = WG * WG_ROWS + gl.arange(0, WG_ROWS, gl.SliceLayout(1, QK))
    row_scale, row_end = _row_constants(qs_ptr, rows_s, t0, q_start, q_len, seq_len, ctx,
                                        pid_h, stride_qst, stride_qsh, sm_scale_log2, PACK,
                                        TOKENS, CAUSAL)
    _, full = _key_bounds(seq_len, ctx, t0 + (WG * WG_ROWS) // PACK, 1, CAUSAL)
    full = gl.minimum(full, hi)
    cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, QK))
    zero_s = gl.zeros([WG_ROWS, BLOCK_N], gl.int32, QK)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, QK))
    l_i = gl.zeros([WG_ROWS], gl.float32, gl.SliceLayout(1, QK))
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, PV)
    if num_tiles > 0:
        mbarrier.wait(ready.index(0), 0)
        _take_turn(turn, WG, 0, CONSUMERS)
        s_tok = warpgroup_mma(q_buf, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        _pass_turn(turn, WG, CONSUMERS)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        k_scale = ks_smem.index(0).load(gl.SliceLayout(0, QK))
        p, m_i, l_i, alpha = _online(s, k_scale, m_i, l_i, row_scale, row_end, 0, full, cols,
                                     BLOCK_N)
        p16 = gl.convert_layout(p.to(half), P_OP)
        for j in range(1, num_tiles):
            cur = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(ready.index(cur), (j // STAGES) & 1)
            _take_turn(turn, WG, j, CONSUMERS)
            # tile j's Q·K^T and tile j-1's P·V back to back; the softmax of tile j then
            # runs while P·V is on the tensor cores
            s_tok = warpgroup_mma(q_buf, k_smem.index(cur).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
            acc_tok = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
            _pass_turn(turn, WG, CONSUMERS)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            k_scale = ks_smem.index(cur).load(gl.SliceLayout(0, QK))
            p, m_i, l_i, alpha = _online(s, k_scale, m_i, l_i, row_scale, row_end,
                                         j * BLOCK_N, full, cols, BLOCK_N)
            acc, p16 = warpgroup_mma_wait(0, deps=(acc_tok, p16))
            mbarrier.arrive(empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, PV))[:, None]
            p16 = gl.convert_layout(p.to(half), P_OP)
        last = (num_tiles - 1) % STAGES
        _take_turn(turn, WG, num_tiles, CONSUMERS)
        acc_tok = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
        _pass_turn(turn, WG, CONSUMERS)
        acc, p16 = warpgroup_mma_wait(0, deps=(acc_tok, p16))
        mbarrier.arrive(empty.index(last), count=1)
    _store_rows(out_ptr, acc, l_i, rows, t0, q_start, q_len, num_q_heads, pid_h, PACK, TOKENS,
                HEAD_DIM, PV, COPY)


@gluon.jit
def ws_prefill_kernel(
    q_ptr, qs_ptr, k_desc, v_desc, k_ptr, v_ptr, ks_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    sm_scale_log2, num_tokens, num_q_heads, num_blocks, max_blocks,
    stride_qt, stride_qh, stride_qst, stride_qsh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst, stride_ksh, stride_btb,
    stride_btn,
    GROUP: gl.constexpr, PACK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    COPY_TPW_D: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """Grid (num_q_heads / PACK, query tiles, batch); num_warps = 4 (consumer 0, the default
    partition), plus consumer 1 (BLOCK_M 128) and the producer warp."""
    CONSUMERS: gl.constexpr = BLOCK_M // WG_ROWS
    TOKENS: gl.constexpr = BLOCK_M // PACK
    half: gl.constexpr = out_ptr.dtype.element_ty
    pid_h = gl.program_id(0)
    tile = gl.num_programs(1) - 1 - gl.program_id(1)  # causal: the longest tiles first
    b = gl.program_id(2)
    seq_len, q_start, q_len = _sequence(seq_lens_ptr, qsl_ptr, b, num_tokens, max_blocks, PAGE)
    t0 = tile * TOKENS
    if t0 >= q_len:
        return
    kvh = (pid_h * PACK) // GROUP
    ctx = seq_len - q_len  # keys before the first query token
    hi, _ = _key_bounds(seq_len, ctx, t0, TOKENS, CAUSAL)
    num_tiles = gl.cdiv(hi, BLOCK_N)
    bt_row_ptr = bt_ptr + b.to(gl.int64) * stride_btb

    q_smem = gl.allocate_shared_memory(
        gl.int8, [CONSUMERS, WG_ROWS, HEAD_DIM],
        gl.NVMMASharedLayout.get_default_for([WG_ROWS, HEAD_DIM], gl.int8))
    k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(half, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N],
                                        gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=2)  # the K/V copies and the key scales
        mbarrier.init(empty.index(i), count=CONSUMERS)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)

    loads = (k_desc, v_desc, k_ptr, v_ptr, ks_ptr, bt_row_ptr, k_smem, v_smem, ks_smem, ready,
             empty, seq_len, num_tiles, kvh, num_blocks, stride_kb, stride_kt, stride_kh,
             stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst, stride_ksh, stride_btn)
    rows = (q_ptr, qs_ptr, out_ptr, q_smem, k_smem, v_smem, ks_smem, ready, empty, turn,
            sm_scale_log2, num_q_heads, q_start, q_len, seq_len, ctx, hi, num_tiles, t0, pid_h,
            stride_qt, stride_qh, stride_qst, stride_qsh)
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, rows, PACK, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, CONSUMERS,
                         COPY_TPW_D)),
            (_consumer, (1, rows, PACK, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, CONSUMERS,
                         COPY_TPW_D)),
            (_producer, (loads, BLOCK_N, HEAD_DIM, PAGE, STAGES, COPY_TPW_D)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, rows, PACK, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, CONSUMERS,
                         COPY_TPW_D)),
            (_producer, (loads, BLOCK_N, HEAD_DIM, PAGE, STAGES, COPY_TPW_D)),
        ], [1], [PRODUCER_REGS])


# ---- "cp": one partition, cp.async -------------------------------------------------------

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
    seq_len, q_start, q_len = _sequence(seq_lens_ptr, qsl_ptr, b, num_tokens, max_blocks, PAGE)
    t0 = tile * TOKENS
    if t0 >= q_len:
        return
    kvh = (pid_h * PACK) // GROUP
    ctx = seq_len - q_len  # keys before the first query token
    hi, full = _key_bounds(seq_len, ctx, t0, TOKENS, CAUSAL)
    num_tiles = gl.cdiv(hi, BLOCK_N)
    bt_row_ptr = bt_ptr + b.to(gl.int64) * stride_btb

    k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HEAD_DIM], K_SMEM)
    v_smem = gl.allocate_shared_memory(half, [STAGES, BLOCK_N, HEAD_DIM], V_SMEM)
    ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], S_SMEM)
    for i in gl.static_range(STAGES - 1):  # the first tiles' copies
        _copy_keys(k_smem.index(i), v_smem.index(i), ks_smem.index(i), k_ptr, v_ptr, ks_ptr,
                   bt_row_ptr, i * BLOCK_N, hi, kvh, num_blocks, stride_kb, stride_kt,
                   stride_kh, stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst,
                   stride_ksh, stride_btn, BLOCK_N, HEAD_DIM, PAGE, COPY)
        cp.commit_group()

    rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, COPY))
    q_smem = gl.allocate_shared_memory(
        gl.int8, [BLOCK_M, HEAD_DIM], Q_SMEM,
        _load_q(q_ptr, rows, t0, q_start, q_len, pid_h, stride_qt, stride_qh, PACK, TOKENS,
                HEAD_DIM, COPY))
    row_scale, row_end = _row_constants(qs_ptr, gl.arange(0, BLOCK_M, gl.SliceLayout(1, QK)),
                                        t0, q_start, q_len, seq_len, ctx, pid_h, stride_qst,
                                        stride_qsh, sm_scale_log2, PACK, TOKENS, CAUSAL)
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
        _copy_keys(k_smem.index(buf), v_smem.index(buf), ks_smem.index(buf), k_ptr, v_ptr,
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
        p, m_i, l_i, alpha = _online(s_cur, k_scale, m_i, l_i, row_scale, row_end,
                                     j * BLOCK_N, full, cols, BLOCK_N)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, PV))[:, None]
        p16 = gl.convert_layout(p.to(half), P_OP)
        acc = warpgroup_mma(p16, v_smem.index(cur), acc, is_async=True)
        s_cur, acc, p16 = warpgroup_mma_wait(0, deps=(s_next, acc, p16))
    cp.wait_group(0)
    _store_rows(out_ptr, acc, l_i, rows, t0, q_start, q_len, num_q_heads, pid_h, PACK, TOKENS,
                HEAD_DIM, PV, COPY)


class Launch(NamedTuple):
    """One launch of a Gluon prefill kernel (separate from the launch itself so that a tool
    can compile it offline)."""

    kernel: object
    grid: tuple[int, int, int]
    args: tuple
    options: dict


def _descriptor(cache: torch.Tensor, box_rows: int) -> TensorDescriptor:
    """The cache as a 2D TMA view [rows, token stride] with boxes of ``box_rows`` keys by
    128 bytes (one swizzle span; a wider head is several boxes)."""
    width = SWIZZLE // cache.element_size()
    layout = gl.NVMMASharedLayout(swizzle_byte_width=SWIZZLE,
                                  element_bitwidth=8 * cache.element_size(), rank=2)
    return TensorDescriptor(cache, [tma_rows(cache), cache.stride(1)], [cache.stride(1), 1],
                            [box_rows, min(width, cache.shape[-1])], layout)


def launch_args(call: PagedCall, out: torch.Tensor, plan: GluonPlan, q: torch.Tensor,
                q_scale: torch.Tensor) -> Launch:
    """The launch of ``call`` under ``plan``; ``q``: the int8 query with its per-(token,
    head) scales ``q_scale``."""
    g = call.geometry
    kc, vc, ks = call.key_cache, call.value_cache, call.key_scale
    tiles = triton.cdiv(call.query_bound, plan.tokens)
    grid = (g.num_q_heads // plan.pack, tiles, g.batch)
    kernel, descriptors = gluon_prefill_kernel, ()
    options = dict(
        GROUP=g.group, PACK=plan.pack, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        HEAD_DIM=g.head_dim, PAGE=g.block_size, STAGES=plan.stages, CAUSAL=call.causal,
        COPY_TPW_D=min(g.head_dim // 16, 32), num_warps=plan.num_warps,
    )
    if plan.pipeline == "ws":
        box = min(g.block_size, plan.block_n)
        kernel, descriptors = ws_prefill_kernel, (_descriptor(kc, box), _descriptor(vc, box))
        options.update(CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
                       maxnreg=plan.maxnreg)
    args = (
        q, q_scale, *descriptors, kc, vc, ks, call.block_table, call.seq_lens,
        call.query_start_loc, out, call.scale * LOG2E, g.num_tokens, g.num_q_heads,
        g.num_blocks, g.max_blocks, q.stride(0), q.stride(1), *q_scale.stride(),
        *kc.stride()[:3], *vc.stride()[:3], *ks.stride(), *call.block_table.stride(),
    )
    return Launch(kernel, grid, args, options)


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
    launch.kernel[launch.grid](*launch.args, **launch.options)

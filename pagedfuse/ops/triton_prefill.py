"""Triton prefill kernels: paged attention for calls with more than one query token.

The decode kernel (triton_paged.py) gives one program a whole sequence and walks its query
tiles in turn, so an 8K prompt runs on a handful of programs. Here the grid is
(head pack, query tile x key split, sequence): every tile of every sequence is its own
program, so a single long prompt fills the GPU. A tile holds ``block_m`` rows, token-major:
``pack`` query heads of one GQA group (any divisor of the group; rows past a multiple of it
idle) times ``block_m // pack`` consecutive query tokens, so one K/V tile read through the
block table serves every packed head. Short queries pack more heads to fill the rows; long
ones take one head and 128 tokens. A launch serves the sequences whose query length lies in
its plan's range, so a batch that may mix short and long ones (no length hint, or decode
rows beside prompt chunks) runs as two launches, each with its own tiles; a launch of short
queries on a small grid splits the keys and merges the splits with the split-KV kernels'
combine.

Per tile, keys run in two stages: the keys every row of the tile sees (no masks, no bounds
checks) and then the diagonal and ragged tail, masked. Causal masking is bottom-right
aligned (query token t of a sequence with ``n`` queries and ``L`` keys sees keys
``<= L - n + t``), so tiles above the diagonal are never visited. Softmax is online in
fp32, in the log2 domain; on tiles with no mask the softmax scale (positive: other calls
are declined) folds into one FMA per score. Grid sizes come from shapes and the optional
hints only, and a tile past its sequence's queries exits at once: no host
synchronisation, so a launch captures in a CUDA graph. Block ids in [-num_blocks, 0) wrap
as in ``cache[block_table]``; lengths and block ids are clamped so that bad values can never
move a read outside the cache or the table.

Windows and soft caps (the ops' ``window_left`` and ``softcap``): a query at position p
reads keys j > p - window_left, and a tile walks keys from its first row's window start;
keys some row's window leaves out are masked, keys every row's window holds run unmasked,
and keys before the first row's window are never loaded (their pages, block ids and scales
included). A capped score becomes c * tanh(s / c) in the log2 domain (c = softcap * log2 e)
before the bias and the masks, so a capped tile cannot fold the scale into the exponent.

NaN and Inf: a NaN or +inf score reaches its row through the row sum (exp2 makes its
weight NaN), and a non-finite INT8 K scale counts as NaN, as the reference has it. Two
cases differ from the reference, which follows eager SDPA over the keys each row reads: a
bool mask drops a masked key's score instead of adding -inf to it (a NaN score it masks
does not reach the row), and the tensor-core P·V on the causal diagonal multiplies a NaN
or Inf in V into rows that do not read that key (with weight 0), as it does at a window's
start inside a tile. A version that followed
the reference there cost accuracy at head_dim 256 on the H200 (bf16 error 1.2e-2 against
SDPA's 2.1e-3, 2026-12-01) and was not kept. A third: an INT8 K scale above about 2.7e31
(keys above 3.4e33) overflows the per-key constant of the score conversion below and makes
the score NaN where the reference's may still be finite.

Biases (``attn_bias``): bias_spans_kernel first reads the bias once and gives each of its
rows the span of keys it leaves visible (from the first to the last key whose bias is above
HIDDEN, or true for a bool mask) and whether every key in that span has a bias of exactly
0. A tile then skips the key tiles no row of it can see and runs the ones every row sees
with a zero bias unmasked (no bias loads), as it does for causal masks: a causal or packed
block-diagonal mask given as a bias (transformers' continuous batching) costs what causal
masking costs. Skipping is exact: a hidden key's weight exp2(s + bias - max) is 0 in fp32
beside a visible key while |scores| stay below 1e22, and a row with no visible key keeps
every key (eager SDPA averages them), so its tile skips nothing. What it changes: a NaN or
Inf in K or V inside a skipped tile reaches no row, where eager SDPA's NaN + -inf or
0 * NaN makes the row NaN (as a bool mask's dropped scores below).

INT8 K: Q is quantized once per (token, head) (quantize_int8); Q·K^T is an int8 ``tl.dot``
with int32 accumulation, and q_scale * k_scale * softmax scale is applied per score before
the softmax: the int32 score becomes a float by its bits and one FFMA with the key's scale,
then the row's scale joins the softmax's FMA. P·V (``PrefillPlan.pv``): "half" converts
int8 V to the activation dtype in registers (exact: |v| <= 127) and folds the per-token V
scales into P, so P·V is a 16-bit dot; "int8" quantizes P per row and runs an int8 dot, as
the decode kernel does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedfuse.ops import cuda
from pagedfuse.ops.call import PagedCall
from pagedfuse.ops.prefill_plan import PrefillPlan, check_plan, default_plans, prefill_unsupported
from pagedfuse.ops.triton_paged import LOG2E, cache_blocks, sequence_bounds, tanh
from pagedfuse.ops.triton_quantize import quantize_int8

HIDDEN: tl.constexpr = tl.constexpr(-1e30)  # a float bias at or below it hides its key
NO_END: tl.constexpr = tl.constexpr(2**30)  # a span open to the right (keys past the bias's
# columns reuse its last one)
SPAN_CHUNK = 1024  # bias columns a span program reads per step
MAGIC: tl.constexpr = tl.constexpr(0x4B400000)  # the bits of the float 1.5 * 2**23
MAGIC_F: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def _blocks(bt_row_ptr, offs_n, n_ok, stride_btn, num_blocks, PAGE: tl.constexpr,
            MASKED: tl.constexpr):
    """The cache blocks of keys ``offs_n`` (n_ok: in the sequence; read only if MASKED)."""
    if MASKED:
        blk = tl.load(bt_row_ptr + (offs_n // PAGE) * stride_btn, mask=n_ok, other=0)
    else:
        blk = tl.load(bt_row_ptr + (offs_n // PAGE) * stride_btn)
    return cache_blocks(blk, num_blocks)


@triton.jit
def _key_scales(s_ptr, bt_row_ptr, offs_n, n_ok, kvh, stride_btn, num_blocks, stride_sb,
                stride_st, stride_sh, PAGE: tl.constexpr, MASKED: tl.constexpr):
    """Per-key scales of keys ``offs_n`` (0 past the sequence if MASKED). Loaded as a
    [keys, 2] tile and summed: the compiler cannot move a reduction into the score tile's
    layout, so the loads stay few per thread instead of one per column a thread holds (32
    loads, each with its 64-bit address arithmetic, at 128 keys)."""
    blk = _blocks(bt_row_ptr, offs_n, n_ok, stride_btn, num_blocks, PAGE, MASKED)
    ptrs = s_ptr + blk * stride_sb + (offs_n % PAGE) * stride_st + kvh * stride_sh
    first = (tl.arange(0, 2) == 0)[None, :]  # the second column is a 0 the sum adds
    if MASKED:  # a slot past the sequence may hold any bits, NaN too: P is 0 there
        first = first & n_ok[:, None]
    return tl.sum(tl.load(ptrs[:, None] + tl.zeros([1, 2], tl.int32), mask=first, other=0.0),
                  axis=1)


@triton.jit
def bias_spans_kernel(bias_ptr, spans_ptr, cols, stride_b, stride_h, stride_m, stride_n,
                      BOOL: tl.constexpr, CHUNK: tl.constexpr):
    """Grid (bias rows, bias heads, bias batches): one bias row each. Writes (first visible
    key, last visible key + 1 or NO_END where the last column is visible, 1 where every key
    between them is visible with a zero bias); a row with no visible key gets (0, NO_END, 0):
    every key is read. NaN counts as visible and non-zero."""
    r, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = bias_ptr + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h \
        + r.to(tl.int64) * stride_m
    lo = tl.full([], NO_END, tl.int32)
    hi = tl.zeros([], tl.int32)
    count = tl.zeros([], tl.int32)
    nonzero = tl.zeros([], tl.int32)
    for c0 in range(0, cols, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        ok = c < cols
        x = tl.load(row + c.to(tl.int64) * stride_n, mask=ok, other=0)
        if BOOL:
            seen = ok & (x != 0)
        else:
            x = x.to(tl.float32)
            seen = ok & ~(x <= HIDDEN)
            nonzero = tl.maximum(nonzero, tl.max((seen & (x != 0.0)).to(tl.int32)))
        lo = tl.minimum(lo, tl.min(tl.where(seen, c, NO_END)))
        hi = tl.maximum(hi, tl.max(tl.where(seen, c + 1, 0)))
        count += tl.sum(seen.to(tl.int32))
    zero = (count == hi - lo) & (nonzero == 0) & (count > 0)
    hi = tl.where((hi == cols) | (count == 0), NO_END, hi)
    lo = tl.where(count == 0, 0, lo)
    out = spans_ptr + ((b * tl.num_programs(1) + h) * tl.num_programs(0) + r).to(tl.int64) * 3
    tl.store(out, lo)
    tl.store(out + 1, hi)
    tl.store(out + 2, zero.to(tl.int32))


def bias_spans(bias: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """bias_spans_kernel over a kernel's 4-D view of ``attn_bias`` (cuda.bias_args): the spans
    [B', H', rows, 3] int32 and their (batch, head) strides, 0 where the bias broadcasts."""
    nb, nh, rows, cols = bias.shape
    spans = torch.empty(nb, nh, rows, 3, dtype=torch.int32, device=bias.device)
    bias_spans_kernel[(rows, nh, nb)](bias, spans, cols, *bias.stride(),
                                      BOOL=bias.dtype == torch.uint8, CHUNK=SPAN_CHUNK)
    return spans, (spans.stride(0) if nb > 1 else 0, spans.stride(1) if nh > 1 else 0)


@triton.jit
def _bias_bounds(spans_ptr, stride_spb, stride_sph, b, head, t, row_ok, bias_rows):
    """A tile's bias spans: (first key any row sees, last + 1, and the keys every row sees
    with a zero bias: [z_lo, z_hi), empty where some row's span is not all zero)."""
    sp = spans_ptr + b * stride_spb + head * stride_sph + tl.minimum(t, bias_rows - 1) * 3
    lo = tl.load(sp, mask=row_ok, other=NO_END)
    hi = tl.load(sp + 1, mask=row_ok, other=0)
    zero = tl.min(tl.load(sp + 2, mask=row_ok, other=1)) > 0
    z_lo = tl.where(zero, tl.max(tl.where(row_ok, lo, 0)), NO_END)
    z_hi = tl.where(zero, tl.min(tl.where(row_ok, hi, NO_END)), 0)
    return tl.min(lo), tl.max(hi), z_lo, z_hi


@triton.jit
def _step(acc, m_i, l_i, q, row_scale, start, tile, sources, strides, BLOCK_N: tl.constexpr,
          HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
          INT8_K: tl.constexpr, V_INT8: tl.constexpr, PV_INT8: tl.constexpr,
          CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr,
          WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """One key tile [start, start + BLOCK_N) of the online softmax. MASKED: the tile may
    reach past the sequence, the causal diagonal or a row's window start, or carries a
    bias; otherwise every key is in bounds and visible to every row. Keys before ``first``
    (the tile's first row's window start) are read by no row and not loaded. ``tile``,
    ``sources`` and ``strides``: the kernel's tuples of them (prefill_kernel)."""
    first, b, kvh, head, t, ctx, seq_len = tile
    (out_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, bias_ptr, num_blocks, softcap_log2,
     window_left, bias_rows, bias_cols) = sources
    (stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst,
     stride_ksh, stride_vsb, stride_vst, stride_vsh, stride_btn, stride_ab, stride_ah,
     stride_am, stride_an) = strides
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < seq_len
    if WINDOW:
        n_ok = n_ok & (offs_n >= first)
    slot = offs_n % PAGE
    blk = _blocks(bt_row_ptr, offs_n, n_ok, stride_btn, num_blocks, PAGE, MASKED)
    k_off = blk * stride_kb + slot * stride_kt + kvh * stride_kh
    v_off = blk * stride_vb + slot * stride_vt + kvh * stride_vh
    if MASKED:
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0)
    else:
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :])
    if INT8_K:
        k_scale = _key_scales(ks_ptr, bt_row_ptr, offs_n, n_ok, kvh, stride_btn, num_blocks,
                              stride_ksb, stride_kst, stride_ksh, PAGE, MASKED)
        # int32 -> fp32 by its bits: MAGIC + x is the float 1.5 * 2**23 + x exactly for
        # |x| < 2**22 (|q.k| <= 127 * 128 * 256 here), and (that - 1.5 * 2**23) * k_scale is
        # one FFMA with a per-key constant. An Inf scale gives Inf - Inf = NaN, as the
        # dequantized key's 0 * Inf does.
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32) + MAGIC
        s = tl.fma(s.to(tl.float32, bitcast=True), k_scale[None, :],
                   (k_scale * -MAGIC_F)[None, :])
    else:
        s = tl.dot(q, tl.trans(k))
    # log2-domain logits are s * row_scale (row_scale >= 0: the softmax scale is positive)
    if MASKED or SOFTCAP:
        s = s * row_scale[:, None]
        if SOFTCAP:  # c * tanh(s / c) in the log2 domain, c = softcap * log2(e)
            s = softcap_log2 * tanh(s * (1.0 / softcap_log2))
    if MASKED:
        keep = n_ok[None, :]
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= (ctx + t)[:, None])
        if WINDOW:
            keep = keep & (offs_n[None, :] > (ctx + t - window_left)[:, None])
        if HAS_BIAS:
            bias_off = (b * stride_ab + head[:, None] * stride_ah
                        + tl.minimum(t, bias_rows - 1)[:, None] * stride_am
                        + tl.minimum(offs_n, bias_cols - 1)[None, :] * stride_an)
            bias = tl.load(bias_ptr + bias_off, mask=keep, other=0)
            if BIAS_BOOL:
                keep = keep & (bias != 0)
            else:
                s += bias.to(tl.float32) * 1.4426950408889634
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(s - m_use[:, None])
    elif SOFTCAP:  # every key visible, scores capped above
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = m_new
        p = tl.exp2(s - m_use[:, None])
    else:  # every key visible: the scale folds into one FMA per score
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * row_scale)
        m_use = m_new
        p = tl.exp2(s * row_scale[:, None] - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if MASKED:
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0)
    else:
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :])
    if V_INT8:
        v_scale = _key_scales(vs_ptr, bt_row_ptr, offs_n, n_ok, kvh, stride_btn, num_blocks,
                              stride_vsb, stride_vst, stride_vsh, PAGE, MASKED)
        pv = p * v_scale[None, :]
        if PV_INT8:
            p_max = tl.max(tl.abs(pv), axis=1)
            p_step = tl.where(p_max > 0.0, p_max / 127.0, 1.0)
            p_q = pv * (1.0 / p_step)[:, None]
            p_i8 = tl.where(p_q >= 0.0, p_q + 0.5, p_q - 0.5).to(tl.int8)  # round half away
            acc += tl.dot(p_i8, v, out_dtype=tl.int32).to(tl.float32) * p_step[:, None]
        else:
            half = out_ptr.dtype.element_ty  # int8 -> bf16/fp16 is exact
            acc = tl.dot(pv.to(half), v.to(half), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def prefill_kernel(
    q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, bias_ptr,
    spans_ptr, stride_spb, stride_sph, out_ptr, part_o_ptr, part_lse_ptr, sm_scale_log2,
    softcap_log2, window_left, num_tokens, num_q_heads, num_blocks, max_blocks, split_keys,
    stride_qt, stride_qh, stride_qst, stride_qsh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    stride_btb, stride_btn, stride_ab, stride_ah, stride_am, stride_an, bias_rows, bias_cols,
    GROUP: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, INT8_K: tl.constexpr, V_INT8: tl.constexpr,
    PV_INT8: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_BOOL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    MIN_Q: tl.constexpr, MAX_Q: tl.constexpr, SPLITS: tl.constexpr,
):
    """Grid (num_q_heads / PACK, query tiles * SPLITS, batch). Only sequences with MIN_Q to
    MAX_Q query tokens (0: no upper bound) are served; another launch takes the rest. With
    SPLITS > 1, split s reads keys [s * split_keys, (s + 1) * split_keys) and writes its
    normalized rows and log2-sum-exps to part_o / part_lse, for combine_splits_kernel.
    Read only under their flags: ``softcap_log2`` (SOFTCAP), softcap * log2(e),
    ``window_left`` (WINDOW), >= 1, and the bias and its spans (HAS_BIAS, bias_spans)."""
    TOKENS: tl.constexpr = BLOCK_M // PACK  # PACK need not divide BLOCK_M: spare rows idle
    pid_h = tl.program_id(0)
    # causal: the longest tiles start first
    tile = tl.num_programs(1) // SPLITS - 1 - tl.program_id(1) // SPLITS
    split = tl.program_id(1) % SPLITS
    b = tl.program_id(2)
    seq_len, q_start, q_len = sequence_bounds(seq_lens_ptr, qsl_ptr, b, num_tokens, max_blocks,
                                              PAGE)
    t0 = tile * TOKENS
    if (t0 >= q_len) | (q_len < MIN_Q):
        return
    if MAX_Q > 0:
        if q_len > MAX_Q:
            return

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    t = t0 + rows // PACK  # query token within the sequence
    head = pid_h * PACK + rows % PACK
    kvh = (pid_h * PACK) // GROUP
    row_ok = (t < q_len) & (rows < TOKENS * PACK)
    tok = (q_start + t).to(tl.int64)
    q = tl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + offs_d[None, :],
                mask=row_ok[:, None], other=0)
    if INT8_K:
        row_scale = tl.load(qs_ptr + tok * stride_qst + head * stride_qsh, mask=row_ok,
                            other=0.0) * sm_scale_log2
    else:
        row_scale = tl.full([BLOCK_M], sm_scale_log2, tl.float32)
    ctx = seq_len - q_len  # keys before the first query token
    if CAUSAL:
        hi = tl.minimum(seq_len, ctx + t0 + TOKENS)  # the tile's last token sees keys < hi
        full = ctx + t0 + 1  # ... and its first token keys < full
    else:
        hi = seq_len
        full = seq_len
    if HAS_BIAS:
        b_lo, b_hi, z_lo, z_hi = _bias_bounds(spans_ptr, stride_spb, stride_sph, b, head, t,
                                              row_ok, bias_rows)
        hi = tl.minimum(hi, b_hi)
        full = tl.minimum(full, z_hi)
    full = tl.maximum(tl.minimum(full, hi), 0) // BLOCK_N * BLOCK_N
    lo = 0
    if SPLITS > 1:  # split_keys is a multiple of BLOCK_N, so full stays tile-aligned
        lo = split * split_keys
        hi = tl.minimum(hi, lo + split_keys)
        full = tl.minimum(full, hi)
    # Three key ranges: masked from lo (keys some rows' windows leave out), unmasked from
    # lo_full (every row's window holds them) to full, masked from there to hi.
    first = 0
    lo_full = lo
    if WINDOW:
        first = tl.maximum(ctx + t0 + 1 - window_left, 0)  # the first row's window start
        lo = tl.maximum(lo, first // BLOCK_N * BLOCK_N)
        last = tl.minimum(t0 + TOKENS, q_len) - 1  # the tile's last query token
        lo_full = tl.maximum(lo, tl.cdiv(tl.maximum(ctx + last + 1 - window_left, 0), BLOCK_N)
                             * BLOCK_N)
        lo_full = tl.minimum(lo_full, hi)
    if HAS_BIAS:  # no row sees keys before b_lo; every row sees [z_lo, z_hi) unbiased
        lo = tl.maximum(lo, b_lo // BLOCK_N * BLOCK_N)
        lo_full = tl.minimum(tl.maximum(tl.maximum(lo_full, lo),
                                        tl.cdiv(tl.minimum(z_lo, hi), BLOCK_N) * BLOCK_N), hi)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # what every key tile reads, as tuples (the three loops below pass them on)
    tile = (first, b, kvh, head, t, ctx, seq_len)
    sources = (out_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, bias_ptr, num_blocks,
               softcap_log2, window_left, bias_rows, bias_cols)
    strides = (stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ksb,
               stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh, stride_btn, stride_ab,
               stride_ah, stride_am, stride_an)
    if WINDOW or HAS_BIAS:  # otherwise lo_full is lo
        for start in range(lo, lo_full, BLOCK_N):
            acc, m_i, l_i = _step(acc, m_i, l_i, q, row_scale, start, tile, sources, strides,
                                  BLOCK_N, HEAD_DIM, PAGE, INT8_K, V_INT8, PV_INT8, CAUSAL,
                                  HAS_BIAS, BIAS_BOOL, WINDOW, SOFTCAP, MASKED=True)
    for start in range(lo_full, full, BLOCK_N):
        acc, m_i, l_i = _step(acc, m_i, l_i, q, row_scale, start, tile, sources, strides,
                              BLOCK_N, HEAD_DIM, PAGE, INT8_K, V_INT8, PV_INT8, CAUSAL,
                              HAS_BIAS, BIAS_BOOL, WINDOW, SOFTCAP, MASKED=False)
    for start in range(tl.maximum(full, lo_full), hi, BLOCK_N):
        acc, m_i, l_i = _step(acc, m_i, l_i, q, row_scale, start, tile, sources, strides,
                              BLOCK_N, HEAD_DIM, PAGE, INT8_K, V_INT8, PV_INT8, CAUSAL,
                              HAS_BIAS, BIAS_BOOL, WINDOW, SOFTCAP, MASKED=True)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row that saw no key writes zeros
    out_row = tok * num_q_heads + head
    if SPLITS > 1:
        part = split.to(tl.int64) * num_tokens * num_q_heads + out_row
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, tl.where(l_i != l_i, l_i, lse), mask=row_ok)
    else:
        tl.store(out_ptr + out_row[:, None] * HEAD_DIM + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


class Launch(NamedTuple):
    """One launch of prefill_kernel: grid, positional arguments and constexpr/launch
    options (separate from the launch itself so that a tool can compile it offline)."""

    grid: tuple[int, int, int]
    args: tuple
    options: dict


def launch_args(call: PagedCall, out: torch.Tensor, plan: PrefillPlan, q: torch.Tensor,
                q_scale: torch.Tensor | None, min_query_len: int = 0,
                partials: tuple[torch.Tensor, torch.Tensor] | None = None,
                spans: tuple[torch.Tensor, tuple[int, int]] | None = None) -> Launch:
    """The launch of ``call`` under ``plan``; ``q``: the query, int8 for INT8 K, with its
    per-(token, head) scales ``q_scale`` (None otherwise); ``partials``: (rows, log-sum-exps)
    buffers of plan.splits > 1; ``spans``: bias_spans of the call's bias (computed here
    where a bias comes without them)."""
    g = call.geometry
    q_scale = q if q_scale is None else q_scale  # never read without INT8_K
    ks = call.key_scale if call.int8_k else q_scale  # never read without INT8_K
    vs = call.value_scale if call.value_scale is not None else ks
    bias, bias_strides, bias_rows, bias_cols, bias_bool = cuda.bias_args(call.attn_bias, out)
    if spans is None:
        spans = bias_spans(bias) if call.attn_bias is not None else (out, (0, 0))
    kc, vc = call.key_cache, call.value_cache
    part_o, part_lse = partials or (out, out)  # never written with one split
    # A window as long as the table holds keys hides none: clamped there it stays an int32.
    window = 0 if call.window_left is None else min(call.window_left,
                                                    g.max_blocks * g.block_size)
    queries = min(call.query_bound, plan.max_q) if plan.max_q else call.query_bound
    tiles = triton.cdiv(queries, plan.tokens)
    split_keys = triton.cdiv(triton.cdiv(call.context_bound, plan.splits), plan.block_n) * \
        plan.block_n
    grid = (g.num_q_heads // plan.pack, tiles * plan.splits, g.batch)
    args = (
        q, q_scale, kc, vc, ks, vs, call.block_table, call.seq_lens, call.query_start_loc,
        bias, spans[0], *spans[1], out, part_o, part_lse, call.scale * LOG2E,
        (call.softcap or 0.0) * LOG2E, window, g.num_tokens, g.num_q_heads,
        g.num_blocks, g.max_blocks, split_keys, q.stride(0), q.stride(1),
        *(q_scale.stride() if call.int8_k else (0, 0)),
        *kc.stride()[:3], *vc.stride()[:3],
        *(ks.stride() if call.int8_k else (0, 0, 0)),
        *(vs.stride() if call.int8_v else (0, 0, 0)),
        *call.block_table.stride(), *bias_strides, bias_rows, bias_cols,
    )
    options = dict(
        GROUP=g.group, PACK=plan.pack, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        HEAD_DIM=g.head_dim, PAGE=g.block_size, INT8_K=call.int8_k, V_INT8=call.int8_v,
        PV_INT8=plan.pv == "int8", CAUSAL=call.causal, HAS_BIAS=call.attn_bias is not None,
        BIAS_BOOL=bias_bool, WINDOW=call.window_left is not None,
        SOFTCAP=call.softcap is not None, MIN_Q=max(min_query_len, plan.min_q), MAX_Q=plan.max_q,
        SPLITS=plan.splits, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    return Launch(grid, args, options)


def prefill_into(call: PagedCall, out: torch.Tensor, plan: PrefillPlan | None = None,
                 min_query_len: int = 0) -> None:
    """Fill contiguous ``out`` [T, Hq, D] with the attention of ``call``; ``plan`` (one
    launch) overrides the heuristic (default_plans). ``min_query_len``: sequences with fewer
    query tokens are skipped (their rows of ``out`` left as they are), for a batch whose
    decode rows another kernel serves."""
    reason = prefill_unsupported(call)
    if reason:
        raise ValueError(f"the prefill kernel cannot run this call: {reason}")
    plans = (plan,) if plan else default_plans(call, min_query_len)
    for p in plans:
        check_plan(call, p, min_query_len)
    g = call.geometry
    if not out.is_contiguous() or tuple(out.shape) != tuple(call.query.shape):
        raise ValueError(f"out: must be contiguous {tuple(call.query.shape)}, got shape "
                         f"{tuple(out.shape)} strides {tuple(out.stride())}")
    if g.num_tokens == 0 or g.batch == 0:
        return
    q, q_scale = quantize_int8(call.query) if call.int8_k else (call.query, None)
    spans = None  # one pass over a bias serves every launch
    if call.attn_bias is not None:
        spans = bias_spans(cuda.bias_args(call.attn_bias, out)[0])
    for p in plans:  # in order: a split launch's merge writes every row, later launches theirs
        partials = None
        if p.splits > 1:
            partials = cuda.partials(call, p.splits * g.num_tokens * g.num_q_heads)
        launch = launch_args(call, out, p, q, q_scale, min_query_len, partials, spans)
        prefill_kernel[launch.grid](*launch.args, **launch.options)
        if partials:
            cuda.combine(call, out, *partials, p.splits, pdl=False)

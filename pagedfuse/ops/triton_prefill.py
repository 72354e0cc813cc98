"""Triton prefill kernels: paged attention for calls with more than one query token.

The decode kernel (triton_paged.py) gives one program a whole sequence and walks its query
tiles in turn, so an 8K prompt runs on a handful of programs. Here the grid is
(head pack, query tile, sequence): every tile of every sequence is its own program, so a
single long prompt fills the GPU. A tile holds ``block_m`` rows, token-major: ``pack``
query heads of one GQA group (a power of two dividing the group) times ``block_m / pack``
consecutive query tokens, so one K/V tile read through the block table serves every packed
head. Short queries pack more heads to fill the rows; long ones take one head and 128
tokens.

Per tile, keys run in two stages: the keys every row of the tile reads (no bounds or
causal masks; a bias still applies) and then the diagonal and ragged tail, masked. Causal
masking is bottom-right aligned (query token t of a sequence with ``n`` queries and ``L``
keys reads keys ``<= L - n + t``; a position below 0 reads none), so tiles above the
diagonal are never visited. Softmax is online in fp32, in the log2 domain; on tiles with
no mask the softmax scale (positive: other calls are declined) folds into one FMA per
score. Grid sizes come from shapes and the optional hints only, and a tile past its
sequence's queries exits at once: no host synchronisation, so a launch captures in a CUDA
graph. Block ids in [-num_blocks, 0) wrap as in ``cache[block_table]``; lengths and block
ids are clamped so that bad values can never move a read outside the cache or the table.

NaN and Inf follow eager SDPA over the keys a row reads (the op contract, reference.py)
at no cost on the tiles every row reads fully: a NaN or +inf score makes its weight, so
the row sum and the row, NaN; a bool mask adds -inf (a masked NaN score stays NaN); an
INT8 K scale that is not finite counts as NaN; V enters as sum_j p_j v_j, which the
tensor-core product is wherever every row reads every key of the tile. Where it is not (a
NaN or Inf in V on the diagonal, which rows that do not read its key would meet with
p = 0; one in the V scales of int8 P), the rows are marked and, after the loop, rewritten
by an exact fp32 pass over their keys (_exact_rows): rare, slow, and built so that the
fast loop keeps its registers.

INT8 K: Q is quantized once per (token, head) (quantize_int8); Q·K^T is an int8 ``tl.dot``
with int32 accumulation, and q_scale * k_scale * softmax scale is applied per score before
the softmax. P·V (``PrefillPlan.pv``): "half" converts int8 V to the activation dtype in
registers (exact: |v| <= 127) and folds the per-token V scales into P, so P·V is a 16-bit
dot; "int8" quantizes P per row and runs an int8 dot, as the decode kernel does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedfuse.ops import cuda
from pagedfuse.ops.call import PagedCall
from pagedfuse.ops.prefill_plan import PrefillPlan, check_plan, default_plan, prefill_unsupported
from pagedfuse.ops.triton_quantize import quantize_int8

LOG2E = 1.4426950408889634


@triton.jit
def _not_finite(x):
    """NaN or +-Inf, elementwise (fp32 ``x``)."""
    return ~(tl.abs(x) < float("inf"))


@triton.jit
def _cache_block(blk, num_blocks):
    """Block ids as ``cache[block_table]`` reads them: [-num_blocks, 0) wraps; then clamped
    into the cache, so that no value can move a read outside it."""
    blk = blk.to(tl.int32).to(tl.uint32, bitcast=True)
    nb = num_blocks.to(tl.uint32, bitcast=True)
    return tl.minimum(tl.minimum(blk, nb - 1), blk + nb).to(tl.int64)


@triton.jit
def _max_nan(a, b):
    """max that keeps NaN (tl.max drops it), for tl.reduce."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _finite_or_nan(x):
    """x, with an Inf turned NaN (x * 0 + x, one FMA)."""
    return tl.fma(x, 0.0, x)


@triton.jit
def _bias_term(bias_ptr, b, head, t, cols, mask, stride_ab, stride_ah, stride_am, stride_an,
               bias_rows, bias_cols, BIAS_BOOL: tl.constexpr):
    """The attention bias of rows (head, t) at key columns ``cols`` (broadcast together) as
    the log2-domain term added to their scores; a bool False adds -inf, as SDPA adds a
    bool mask (a masked NaN score stays NaN). ``mask``: where to read (None: everywhere; the
    caller discards the rest)."""
    off = (b * stride_ab + head * stride_ah + tl.minimum(t, bias_rows - 1) * stride_am
           + tl.minimum(cols, bias_cols - 1) * stride_an)
    bias = tl.load(bias_ptr + off, mask=mask)
    if BIAS_BOOL:
        term = tl.where(bias != 0, 0.0, float("-inf"))
    else:
        term = bias.to(tl.float32) * 1.4426950408889634
    return term


@triton.jit
def _tile_rows(rows, t0, pid_h, q_start, q_len, qs_ptr, sm_scale_log2, stride_qt, stride_qh,
               stride_qst, stride_qsh, PACK: tl.constexpr, INT8_K: tl.constexpr):
    """Rows ``rows`` of the tile at token t0 (token-major, PACK heads per token): token
    within the sequence, query head, validity, token index, query offset and the
    log2-domain scale of their scores (q_scale times the softmax scale for INT8 K)."""
    t = t0 + rows // PACK
    head = pid_h * PACK + rows % PACK
    row_ok = t < q_len
    tok = (q_start + t).to(tl.int64)
    q_off = tok * stride_qt + head * stride_qh
    if INT8_K:
        row_scale = tl.load(qs_ptr + tok * stride_qst + head * stride_qsh, mask=row_ok,
                            other=0.0) * sm_scale_log2
    else:
        row_scale = tl.zeros(rows.shape, tl.float32) + sm_scale_log2
    return t, head, row_ok, tok, q_off, row_scale


@triton.jit
def _key_score(j, q_ptr, q_off, row_ok, row_scale, head, t, b, kvh, k_ptr, ks_ptr, bias_ptr,
               blk, slot, stride_kb, stride_kt, stride_kh, stride_ksb, stride_kst,
               stride_ksh, stride_ab, stride_ah, stride_am, stride_an, bias_rows, bias_cols,
               HEAD_DIM: tl.constexpr, INT8_K: tl.constexpr, HAS_BIAS: tl.constexpr,
               BIAS_BOOL: tl.constexpr):
    """The log2-domain scores of a few rows against key j (in block ``blk``, ``slot``), as
    _step gives them, in fp32 16 dims at a time (exact for int8: |sum| < 2^24)."""
    k_row = k_ptr + blk * stride_kb + slot * stride_kt + kvh * stride_kh
    c = tl.zeros_like(row_scale)
    for d0 in range(0, HEAD_DIM, 16):
        dims = d0 + tl.arange(0, 16)
        qv = tl.load(q_ptr + q_off[:, None] + dims[None, :], mask=row_ok[:, None], other=0)
        c += tl.sum(qv.to(tl.float32) * tl.load(k_row + dims).to(tl.float32)[None, :], axis=1)
    if INT8_K:
        c *= _finite_or_nan(tl.load(ks_ptr + blk * stride_ksb + slot * stride_kst
                                    + kvh * stride_ksh))
    c *= row_scale
    if HAS_BIAS:
        c += _bias_term(bias_ptr, b, head, t, j, None, stride_ab, stride_ah, stride_am,
                        stride_an, bias_rows, bias_cols, BIAS_BOOL)
    return c


@triton.jit
def _exact_rows(out_ptr, rows, t0, pid_h, q_start, q_len, seq_len, ctx, hi, b, kvh,
                sm_scale_log2, num_q_heads, num_blocks, q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr,
                vs_ptr, bt_row_ptr, bias_ptr, stride_qt, stride_qh, stride_qst, stride_qsh,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
                stride_btn, stride_ab, stride_ah, stride_am, stride_an, bias_rows, bias_cols,
                PACK: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                INT8_K: tl.constexpr, V_INT8: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr):
    """Attention of tile rows ``rows`` over keys [0, hi) in fp32, key by key in two passes
    (the largest score, then the weights and sum_j p_j v_j), stored: the IEEE sum over the
    keys each row reads, for the rare tile whose tensor-core P·V cannot give it (see
    _step). A few rows at a time, so that it needs few registers; not fast."""
    offs_d = tl.arange(0, HEAD_DIM)
    t, head, row_ok, tok, q_off, row_scale = _tile_rows(
        rows, t0, pid_h, q_start, q_len, qs_ptr, sm_scale_log2, stride_qt, stride_qh,
        stride_qst, stride_qsh, PACK, INT8_K)
    last = ctx + t if CAUSAL else tl.zeros_like(t) + seq_len - 1  # the last key each reads
    m = tl.full(row_scale.shape, float("-inf"), tl.float32)
    for j in range(0, hi):
        blk = _cache_block(tl.load(bt_row_ptr + (j // PAGE) * stride_btn), num_blocks)
        c = _key_score(j, q_ptr, q_off, row_ok, row_scale, head, t, b, kvh, k_ptr, ks_ptr,
                       bias_ptr, blk, j % PAGE, stride_kb, stride_kt, stride_kh, stride_ksb,
                       stride_kst, stride_ksh, stride_ab, stride_ah, stride_am, stride_an,
                       bias_rows, bias_cols, HEAD_DIM, INT8_K, HAS_BIAS, BIAS_BOOL)
        m = tl.maximum(m, tl.where(j <= last, c, float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    l_i = tl.zeros_like(m)
    o = tl.zeros([rows.shape[0], HEAD_DIM], tl.float32)
    for j in range(0, hi):
        blk = _cache_block(tl.load(bt_row_ptr + (j // PAGE) * stride_btn), num_blocks)
        c = _key_score(j, q_ptr, q_off, row_ok, row_scale, head, t, b, kvh, k_ptr, ks_ptr,
                       bias_ptr, blk, j % PAGE, stride_kb, stride_kt, stride_kh, stride_ksb,
                       stride_kst, stride_ksh, stride_ab, stride_ah, stride_am, stride_an,
                       bias_rows, bias_cols, HEAD_DIM, INT8_K, HAS_BIAS, BIAS_BOOL)
        v = tl.load(v_ptr + blk * stride_vb + (j % PAGE) * stride_vt + kvh * stride_vh + offs_d)
        v = v.to(tl.float32)
        if V_INT8:
            v *= tl.load(vs_ptr + blk * stride_vsb + (j % PAGE) * stride_vst + kvh * stride_vsh)
        p = tl.exp2(c - m)  # NaN for a NaN or +inf score: the row sum, then the row, NaN
        reads = j <= last
        l_i += tl.where(reads, p, 0.0)
        o = tl.where(reads[:, None], o + p[:, None] * v[None, :], o)
    o = o / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_off = (tok * num_q_heads + head) * HEAD_DIM
    tl.store(out_ptr + out_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _step(acc, m_i, l_i, redo, q, row_scale, start, b, kvh, head, t, ctx, seq_len, out_ptr,
          k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, bias_ptr, num_blocks,
          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
          stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh, stride_btn,
          stride_ab, stride_ah, stride_am, stride_an, bias_rows, bias_cols,
          BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
          INT8_K: tl.constexpr, V_INT8: tl.constexpr, PV_INT8: tl.constexpr,
          CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr,
          MASKED: tl.constexpr):
    """One key tile [start, start + BLOCK_N) of the online softmax. MASKED: the tile may
    reach past the sequence or, under causal, past some row's position (the diagonal);
    otherwise every row reads every key of the tile, all in bounds (a bias may still add
    -inf to some). ``redo``: per row, 1 once its P·V here cannot be right (see below)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if MASKED:
        n_ok = offs_n < seq_len
        blk = tl.load(bt_row_ptr + (offs_n // PAGE) * stride_btn, mask=n_ok, other=0)
    else:
        blk = tl.load(bt_row_ptr + (offs_n // PAGE) * stride_btn)
    blk = _cache_block(blk, num_blocks)
    slot = offs_n % PAGE
    k_off = blk * stride_kb + slot * stride_kt + kvh * stride_kh
    v_off = blk * stride_vb + slot * stride_vt + kvh * stride_vh
    if MASKED:
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0)
    else:
        k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :])
    if INT8_K:
        k_scale = tl.load(ks_ptr + blk * stride_ksb + slot * stride_kst + kvh * stride_ksh)
        # not finite -> NaN: the dequantized key holds a NaN (0 * Inf), so do its scores
        k_scale = _finite_or_nan(k_scale)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * k_scale[None, :]
    else:
        s = tl.dot(q, tl.trans(k))
    # log2-domain logits are s * row_scale (row_scale >= 0: the softmax scale is positive).
    # A NaN or +inf score needs no test: exp2 turns it into a NaN weight (NaN - m, or
    # inf - inf with m = +inf), so the row sum l_i is NaN from then on and so is the row.
    if MASKED or HAS_BIAS:
        s = s * row_scale[:, None]
        if MASKED:
            reads = n_ok[None, :]  # the keys each row reads
            if CAUSAL:
                reads = reads & (offs_n[None, :] <= (ctx + t)[:, None])
        if HAS_BIAS:
            s += _bias_term(bias_ptr, b, head[:, None], t[:, None], offs_n[None, :],
                            reads if MASKED else None, stride_ab, stride_ah, stride_am,
                            stride_an, bias_rows, bias_cols, BIAS_BOOL)
        if MASKED:
            s = tl.where(reads, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = tl.exp2(s - m_use[:, None])
    else:  # no mask: the scale folds into one FMA per score
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * row_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # -inf scores (an Inf in q, K)
        p = tl.exp2(s * row_scale[:, None] - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if MASKED:
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0)
    else:
        v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :])
    # V enters as sum_j p_j v_j over the keys each row reads, in IEEE arithmetic. The
    # tensor-core product is that wherever every row reads every key of the tile (0 * NaN is
    # NaN there too). Where it is not, the row is marked (redo) and _exact_rows rewrites it
    # after the loop: a NaN or Inf in V or its scales on the diagonal, where rows meet keys
    # they do not read with p = 0, and one in the scales of int8 P, which cannot carry it
    # (the row's largest |p v_scale| is not finite).
    if V_INT8:
        vs_ptrs = vs_ptr + blk * stride_vsb + slot * stride_vst + kvh * stride_vsh
        if MASKED:  # a slot past the sequence may hold any bits, NaN too: P is 0 there
            v_scale = tl.load(vs_ptrs, mask=n_ok, other=0.0)
        else:
            v_scale = tl.load(vs_ptrs)
        if MASKED and CAUSAL:
            redo = tl.maximum(redo, tl.max(_not_finite(v_scale).to(tl.int32), axis=0))
        pv = p * v_scale[None, :]
        if PV_INT8:
            p_max = tl.reduce(tl.abs(pv), 1, _max_nan)
            redo = tl.maximum(redo, (~(p_max < float("inf"))).to(tl.int32))
            p_step = tl.where(p_max > 0.0, p_max / 127.0, 1.0)
            p_q = pv * (1.0 / p_step)[:, None]
            p_i8 = tl.where(p_q >= 0.0, p_q + 0.5, p_q - 0.5).to(tl.int8)  # round half away
            acc += tl.dot(p_i8, v, out_dtype=tl.int32).to(tl.float32) * p_step[:, None]
        else:
            half = out_ptr.dtype.element_ty  # int8 -> bf16/fp16 is exact
            acc = tl.dot(pv.to(half), v.to(half), acc)
    else:
        if MASKED and CAUSAL:
            redo = tl.maximum(redo, tl.max(tl.max(_not_finite(v.to(tl.float32)).to(tl.int32),
                                                  axis=1), axis=0))
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i, redo


@triton.jit
def prefill_kernel(
    q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, bias_ptr,
    out_ptr, sm_scale_log2, num_tokens, num_q_heads, num_blocks, max_blocks,
    stride_qt, stride_qh, stride_qst, stride_qsh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    stride_btb, stride_btn, stride_ab, stride_ah, stride_am, stride_an, bias_rows, bias_cols,
    GROUP: tl.constexpr, PACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, INT8_K: tl.constexpr, V_INT8: tl.constexpr,
    PV_INT8: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_BOOL: tl.constexpr, MIN_Q: tl.constexpr, EXACT_ROWS: tl.constexpr = 8,
):
    """Grid (num_q_heads / PACK, query tiles, batch). Sequences with fewer than MIN_Q query
    tokens are left to another kernel (a decode launched beside this one)."""
    TOKENS: tl.constexpr = BLOCK_M // PACK
    pid_h = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # causal: the longest tiles start first
    b = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    seq_len = tl.minimum(tl.maximum(seq_len, 0), max_blocks * PAGE)
    q_start = tl.minimum(tl.maximum(tl.load(qsl_ptr + b).to(tl.int32), 0), num_tokens)
    q_end = tl.minimum(tl.maximum(tl.load(qsl_ptr + b + 1).to(tl.int32), q_start), num_tokens)
    q_len = q_end - q_start
    t0 = tile * TOKENS
    if (t0 >= q_len) | (q_len < MIN_Q):
        return

    offs_d = tl.arange(0, HEAD_DIM)
    kvh = (pid_h * PACK) // GROUP
    t, head, row_ok, tok, q_off, row_scale = _tile_rows(
        tl.arange(0, BLOCK_M), t0, pid_h, q_start, q_len, qs_ptr, sm_scale_log2, stride_qt,
        stride_qh, stride_qst, stride_qsh, PACK, INT8_K)
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0)
    ctx = seq_len - q_len  # keys before the first query token
    if CAUSAL:
        hi = tl.minimum(seq_len, ctx + t0 + TOKENS)  # the tile's last token sees keys < hi
        full = ctx + t0 + 1  # ... and its first token keys < full
    else:
        hi = seq_len
        full = seq_len
    full = tl.maximum(tl.minimum(full, hi), 0) // BLOCK_N * BLOCK_N
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    redo = tl.zeros([BLOCK_M], tl.int32)
    for start in range(0, full, BLOCK_N):
        acc, m_i, l_i, redo = _step(
            acc, m_i, l_i, redo, q, row_scale, start, b, kvh, head, t, ctx, seq_len, out_ptr,
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, bias_ptr, num_blocks,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh, stride_btn,
            stride_ab, stride_ah, stride_am, stride_an, bias_rows, bias_cols,
            BLOCK_N, HEAD_DIM, PAGE, INT8_K, V_INT8, PV_INT8, CAUSAL, HAS_BIAS, BIAS_BOOL,
            MASKED=False)
    for start in range(full, hi, BLOCK_N):
        acc, m_i, l_i, redo = _step(
            acc, m_i, l_i, redo, q, row_scale, start, b, kvh, head, t, ctx, seq_len, out_ptr,
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, bias_ptr, num_blocks,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh, stride_btn,
            stride_ab, stride_ah, stride_am, stride_an, bias_rows, bias_cols,
            BLOCK_N, HEAD_DIM, PAGE, INT8_K, V_INT8, PV_INT8, CAUSAL, HAS_BIAS, BIAS_BOOL,
            MASKED=True)
    if tl.max(redo, axis=0) > 0:  # rare: rewrite the tile's rows exactly (see _step)
        for r0 in range(0, tl.minimum((q_len - t0) * PACK, BLOCK_M), EXACT_ROWS):
            _exact_rows(out_ptr, r0 + tl.arange(0, EXACT_ROWS), t0, pid_h, q_start, q_len,
                        seq_len, ctx, hi, b, kvh, sm_scale_log2, num_q_heads, num_blocks,
                        q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, bias_ptr,
                        stride_qt, stride_qh, stride_qst, stride_qsh,
                        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                        stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst,
                        stride_vsh, stride_btn, stride_ab, stride_ah, stride_am, stride_an,
                        bias_rows, bias_cols, PACK, HEAD_DIM, PAGE, INT8_K, V_INT8, CAUSAL,
                        HAS_BIAS, BIAS_BOOL)
    else:
        # a row that saw no key (l_i 0) writes zeros, or the NaN a key's V gave it through
        # p = 0; a NaN l_i (a NaN or +inf score) makes the row NaN
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out_off = (tok * num_q_heads + head) * HEAD_DIM
        tl.store(out_ptr + out_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


class Launch(NamedTuple):
    """One launch of prefill_kernel: grid, positional arguments and constexpr/launch
    options (separate from the launch itself so that a tool can compile it offline)."""

    grid: tuple[int, int, int]
    args: tuple
    options: dict


def launch_args(call: PagedCall, out: torch.Tensor, plan: PrefillPlan, q: torch.Tensor,
                q_scale: torch.Tensor | None, min_query_len: int = 0) -> Launch:
    """The launch of ``call`` under ``plan``; ``q``: the query, int8 for INT8 K, with its
    per-(token, head) scales ``q_scale`` (None otherwise)."""
    g = call.geometry
    q_scale = q if q_scale is None else q_scale  # never read without INT8_K
    ks = call.key_scale if call.int8_k else q_scale  # never read without INT8_K
    vs = call.value_scale if call.value_scale is not None else ks
    bias, bias_strides, bias_rows, bias_cols, bias_bool = cuda.bias_args(call.attn_bias, out)
    kc, vc = call.key_cache, call.value_cache
    grid = (g.num_q_heads // plan.pack, triton.cdiv(call.query_bound, plan.tokens), g.batch)
    args = (
        q, q_scale, kc, vc, ks, vs, call.block_table, call.seq_lens, call.query_start_loc,
        bias, out, call.scale * LOG2E, g.num_tokens, g.num_q_heads, g.num_blocks,
        g.max_blocks, q.stride(0), q.stride(1),
        *(q_scale.stride() if call.int8_k else (0, 0)),
        *kc.stride()[:3], *vc.stride()[:3],
        *(ks.stride() if call.int8_k else (0, 0, 0)),
        *(vs.stride() if call.int8_v else (0, 0, 0)),
        *call.block_table.stride(), *bias_strides, bias_rows, bias_cols,
    )
    options = dict(
        GROUP=g.group, PACK=plan.pack, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        HEAD_DIM=g.head_dim, PAGE=g.block_size, INT8_K=call.int8_k, V_INT8=call.int8_v,
        PV_INT8=call.int8_v and plan.pv == "int8", CAUSAL=call.causal,
        HAS_BIAS=call.attn_bias is not None, BIAS_BOOL=bias_bool, MIN_Q=min_query_len,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    return Launch(grid, args, options)


def prefill_into(call: PagedCall, out: torch.Tensor, plan: PrefillPlan | None = None,
                 min_query_len: int = 0) -> None:
    """Fill contiguous ``out`` [T, Hq, D] with the attention of ``call``; ``plan`` overrides
    the heuristic (default_plan). ``min_query_len``: sequences with fewer query tokens are
    skipped (their rows of ``out`` left as they are), for a batch whose decode rows another
    kernel serves."""
    reason = prefill_unsupported(call)
    if reason:
        raise ValueError(f"the prefill kernel cannot run this call: {reason}")
    plan = plan or default_plan(call)
    check_plan(call, plan)
    g = call.geometry
    if not out.is_contiguous() or tuple(out.shape) != tuple(call.query.shape):
        raise ValueError(f"out: must be contiguous {tuple(call.query.shape)}, got shape "
                         f"{tuple(out.shape)} strides {tuple(out.stride())}")
    if g.num_tokens == 0 or g.batch == 0:
        return
    q, q_scale = quantize_int8(call.query) if call.int8_k else (call.query, None)
    launch = launch_args(call, out, plan, q, q_scale, min_query_len)
    prefill_kernel[launch.grid](*launch.args, **launch.options)

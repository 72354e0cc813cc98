"""Triton kernels for paged attention: grouped-KV split-KV attention and its combine step.

One program per (sequence, KV head, split). The query heads that share a KV head are the M
rows of the tile (times QT query tokens for q_len > 1), so each K/V tile read through the
block table serves the whole group. Softmax runs online in fp32 in the log2 domain. With one
split the program writes the output; with several, each writes a normalised partial row and
its log-sum-exp, and the combine kernel merges them. Every size is a shape or a hint: no
host synchronisation, so the launch captures in a CUDA graph.

INT8 (INT8_K): the query arrives pre-quantized (one small kernel shared by all splits);
Q·K^T is an int8 tl.dot with int32 accumulation, scaled by q_scale * k_scale * scale before
the softmax. INT8 V (V_INT8): the per-token V scales are folded into P, which is scaled by
its row's largest value and rounded to fp16; P·V is an fp16 tl.dot over V's int8 values
converted to fp16 (exactly), the row's largest value restored after it.

WINDOW: a query at position p reads keys j > p - window_left only, and the programs walk
only those: the splits divide the keys from the first query's window on, and each block of
query rows starts its loop at its first row's window. SOFTCAP: a score s (scale applied)
becomes softcap * tanh(s / softcap) before the bias, computed in the log2 domain as
c * tanh(s / c) with c = softcap * log2(e). Both are constexpr flags, so a call without them
compiles to the code it had before they existed.

Non-finite values follow eager SDPA over the keys a row reads (as the reference does): a NaN
or +inf score makes the row NaN (``bad``; its log-sum-exp is NaN for the combine), a bool
mask adds -inf rather than replacing the score, and V enters as sum_j p_j v_j in IEEE
arithmetic over the keys the row reads. The tensor-core P·V multiplies every key of the
tile into every row, so a tile whose V (or V scale) is not finite where that would be wrong
(a key some row does not read under causal prefill or before a window's start, or an
INT8 V scale, which the normalized P cannot carry) takes _pv_non_finite instead, at run time.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def cache_blocks(blk, num_blocks):
    """Block ids as ``cache[block_table]`` reads them ([-num_blocks, 0) wraps), then clamped
    into the cache, so that no table value can move a read outside it."""
    blk = blk.to(tl.int64)
    blk = tl.where(blk < 0, blk + num_blocks, blk)
    return tl.minimum(tl.maximum(blk, 0), num_blocks - 1)


@triton.jit
def sequence_bounds(seq_lens_ptr, qsl_ptr, b, num_tokens, max_blocks, PAGE: tl.constexpr):
    """Sequence b's (keys, first query token, query tokens), clamped to the table's capacity
    and the packed query, so that unchecked values on the GPU never move a read out of
    bounds."""
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    seq_len = tl.minimum(tl.maximum(seq_len, 0), max_blocks * PAGE)
    q_start = tl.minimum(tl.maximum(tl.load(qsl_ptr + b).to(tl.int32), 0), num_tokens)
    q_end = tl.minimum(tl.maximum(tl.load(qsl_ptr + b + 1).to(tl.int32), q_start), num_tokens)
    return seq_len, q_start, q_end - q_start


@triton.jit
def _load_rows(base_ptr, row_off, offs_d, valid):
    """[len(row_off), HEAD_DIM] rows at base + row_off (innermost dim contiguous)."""
    return tl.load(base_ptr + row_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0)


@triton.jit
def _pv_non_finite(p, v, reads, PRECISION: tl.constexpr):
    """sum_j p[i, j] v[j, :] over the keys row i reads, in IEEE arithmetic, for fp32 p
    [M, N] (0 where a read key is masked) and fp32 v [N, D] holding NaN or Inf: the finite
    part by one product at the kernel's precision, the non-finite elements by counting, per
    row and dim, the read keys that bring a NaN (a NaN, or an Inf times weight 0) or an Inf
    of either sign. The counts multiply 0/1 matrices, exact in fp16 with fp32 sums, so they
    run on the tensor cores: as fp32 FMA products they made a 64-row tile spill 180 KB and
    its compile take minutes, though this branch runs only on a non-finite V."""
    bad = (v != v) | (tl.abs(v) == float("inf"))
    part = tl.dot(p, tl.where(bad, 0.0, v), input_precision=PRECISION)
    read = reads.to(tl.float16)
    weighted = (reads & (p > 0.0)).to(tl.float16)
    unweighted = (reads & ~(p > 0.0)).to(tl.float16)
    is_nan = (v != v).to(tl.float16)
    pos_inf = (v == float("inf")).to(tl.float16)
    neg_inf = (v == -float("inf")).to(tl.float16)
    nans = tl.dot(read, is_nan, out_dtype=tl.float32) + tl.dot(
        unweighted, pos_inf + neg_inf, out_dtype=tl.float32)
    pos = tl.dot(weighted, pos_inf, out_dtype=tl.float32) > 0.0
    neg = tl.dot(weighted, neg_inf, out_dtype=tl.float32) > 0.0
    part = tl.where(pos, float("inf"), tl.where(neg, -float("inf"), part))
    return tl.where((nans > 0.0) | (pos & neg), float("nan"), part)


@triton.jit
def tanh(x):
    """tanh in fp32: below |x| = 0.25 its odd Taylor polynomial to x^9 (relative error
    < 1e-8), from there (1 - e) / (1 + e) with e = 2^(-2|x| log2 e), which loses at most two
    bits to the subtraction. +-inf give +-1; a NaN stays NaN (it reaches the far branch)."""
    ax = tl.abs(x)
    e = tl.exp2(ax * (-2.0 * 1.4426950408889634))
    far = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    near = ax * (1.0 + x2 * (-1.0 / 3 + x2 * (2.0 / 15 + x2 * (-17.0 / 315
                                                                + x2 * (62.0 / 2835)))))
    r = tl.where(ax < 0.25, near, far)
    return tl.where(x < 0.0, -r, r)


@triton.jit
def _pv_non_finite_scales(p, v, v_scale):
    """sum_j p[i, j] v[j, :] v_scale[j] in IEEE arithmetic for an int8 ``v`` [N, D] whose
    scales [N] hold a NaN or an Inf, where every row reads every key of the tile (one query
    token per tile; keys past its end load as 0 with scale 0). Then every element of a row is
    NaN or +-Inf, and which one follows from reductions alone: NaN where a scale is NaN, where
    an Inf-scaled key has weight 0 in the row or 0 in the column, or where +Inf and -Inf
    meet; else the sign of the Inf terms. No product is needed (_pv_non_finite takes five)."""
    vf = v.to(tl.float32)
    inf_key = tl.abs(v_scale) == float("inf")
    any_nan_key = tl.max((v_scale != v_scale).to(tl.int32), axis=0) > 0
    zero_weight = tl.max((inf_key[None, :] & (p == 0.0)).to(tl.int32), axis=1) > 0  # [M]
    signed = vf * v_scale[:, None]  # +-Inf on Inf-scaled keys, NaN where v is 0
    zero_value = tl.max((inf_key[:, None] & (vf == 0.0)).to(tl.int32), axis=0) > 0  # [D]
    pos = tl.max((inf_key[:, None] & (signed > 0.0)).to(tl.int32), axis=0) > 0
    neg = tl.max((inf_key[:, None] & (signed < 0.0)).to(tl.int32), axis=0) > 0
    nan = (zero_weight | any_nan_key)[:, None] | (zero_value | (pos & neg))[None, :]
    return tl.where(nan, float("nan"), tl.where(pos[None, :], float("inf"), -float("inf")))


@triton.jit
def _attend_rows(
    q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, bias_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    b, kvh, split, qb, seq_len, q_start, q_len, kv_lo, kv_hi,
    sm_scale_log2, softcap_log2, window_left, num_tokens, num_blocks,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh, stride_btn,
    stride_ab, stride_ah, stride_am, stride_an, bias_rows, bias_cols,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    INT8_K: tl.constexpr, V_INT8: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_BOOL: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Attention of QT query tokens x the group's heads over keys [kv_lo, kv_hi), with
    WINDOW from the first row's window on."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    g = offs_m % GROUP_PAD
    t = qb * QT + offs_m // GROUP_PAD  # token index within the sequence
    row_ok = (g < GROUP) & (t < q_len)
    head = kvh * GROUP + g
    tok = q_start + t
    q_off = tok.to(tl.int64) * stride_qt + head * stride_qh
    q = _load_rows(q_ptr, q_off, offs_d, row_ok)
    if INT8_K:
        q_scale = tl.load(qs_ptr + tok.to(tl.int64) * (GROUP * tl.num_programs(1)) + head,
                          mask=row_ok, other=0.0)
    last_key = seq_len - q_len + t  # causal limit of each row (bottom-right aligned)
    hi = kv_hi
    if CAUSAL:
        hi = tl.minimum(hi, seq_len - q_len + qb * QT + QT)
    lo = kv_lo
    if WINDOW:  # the first row's window starts first (each later row's one key later)
        lo = tl.maximum(lo, seq_len - q_len + qb * QT + 1 - window_left)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bad = tl.zeros([BLOCK_M], tl.int32)  # rows with a NaN or +inf score
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        blk = cache_blocks(tl.load(bt_row_ptr + (offs_n // PAGE) * stride_btn, mask=n_ok,
                                   other=0), num_blocks)
        slot = offs_n % PAGE
        k = _load_rows(k_ptr, blk * stride_kb + slot * stride_kt + kvh * stride_kh, offs_d, n_ok)
        if INT8_K:
            k_scale = tl.load(ks_ptr + blk * stride_ksb + slot * stride_kst + kvh * stride_ksh,
                              mask=n_ok, other=0.0)
            # not finite -> NaN: the dequantized row holds a NaN (0 * Inf), so do its scores
            k_scale = tl.where(tl.abs(k_scale) < float("inf"), k_scale, float("nan"))
            qk = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
            s = qk * (q_scale[:, None] * k_scale[None, :]) * sm_scale_log2
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2
        if SOFTCAP:
            s = softcap_log2 * tanh(s * (1.0 / softcap_log2))
        reads = n_ok[None, :] & row_ok[:, None]  # the keys each row reads
        if CAUSAL:
            reads = reads & (offs_n[None, :] <= last_key[:, None])
        if WINDOW and QT > 1:  # one token per tile: its window starts at lo already
            reads = reads & (offs_n[None, :] > (last_key - window_left)[:, None])
        if HAS_BIAS:
            bias_off = (b * stride_ab + head[:, None] * stride_ah
                        + tl.minimum(t, bias_rows - 1)[:, None] * stride_am
                        + tl.minimum(offs_n, bias_cols - 1)[None, :] * stride_an)
            bias = tl.load(bias_ptr + bias_off, mask=reads, other=0)
            if BIAS_BOOL:  # added, as SDPA adds a bool mask: a masked NaN score stays NaN
                s += tl.where(bias != 0, 0.0, float("-inf"))
            else:
                s += bias.to(tl.float32) * 1.4426950408889634
        s = tl.where(reads, s, float("-inf"))
        bad = tl.maximum(bad, tl.max(((s != s) | (s == float("inf"))).to(tl.int32), axis=1))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        v = _load_rows(v_ptr, blk * stride_vb + slot * stride_vt + kvh * stride_vh, offs_d, n_ok)
        if V_INT8:
            v_scale = tl.load(vs_ptr + blk * stride_vsb + slot * stride_vst + kvh * stride_vsh,
                              mask=n_ok, other=0.0)
            if tl.max((~(tl.abs(v_scale) < float("inf"))).to(tl.int32), axis=0) > 0:
                if QT > 1:
                    part = _pv_non_finite(p, v.to(tl.float32) * v_scale[:, None], reads,
                                          PRECISION)
                else:
                    part = _pv_non_finite_scales(p, v, v_scale)
            else:
                # P' = p * v_scale over its row's largest, in fp16 (|P'| <= 1: 11 bits of
                # each weight, none lost above 2^-24 of the largest), times V's int8 values,
                # which fp16 holds exactly. An int8 P dropped every weight below half a step
                # of 1/127 while l counted it: on a trained model's decode calls 0.8% of the
                # attention mass, the output shrunk 0.5% (benchmarks/decode_p_precision.py).
                pv = p * v_scale[None, :]
                p_max = tl.max(tl.abs(pv), axis=1)
                p_norm = tl.where(p_max > 0.0, p_max, 1.0)
                p_h = (pv / p_norm[:, None]).to(tl.float16)
                part = tl.dot(p_h, v.to(tl.float16), out_dtype=tl.float32) * p_norm[:, None]
        elif CAUSAL and QT > 1:  # rows of the tile read different keys
            v_bad = (v != v) | (tl.abs(v.to(tl.float32)) == float("inf"))
            if tl.max(tl.max(v_bad.to(tl.int32), axis=1), axis=0) > 0:
                part = _pv_non_finite(p, v.to(tl.float32), reads, PRECISION)
            else:
                part = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        elif WINDOW and QT > 1:
            # Rows skip keys of a tile only at a window's start: V is checked there. With one
            # token per tile no row skips a key from lo on, and the check's code would only
            # cost registers (compiled for sm_90 it spilled 51 KB).
            skipped = n_ok[None, :] & row_ok[:, None] & ~reads
            if tl.max(tl.max(skipped.to(tl.int32), axis=1), axis=0) > 0:
                v_bad = (v != v) | (tl.abs(v.to(tl.float32)) == float("inf"))
                if tl.max(tl.max(v_bad.to(tl.int32), axis=1), axis=0) > 0:
                    part = _pv_non_finite(p, v.to(tl.float32), reads, PRECISION)
                else:
                    part = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            else:
                part = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        else:
            part = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + part

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o = tl.where(bad[:, None] > 0, float("nan"), o)
    out_off = (tok.to(tl.int64) * (GROUP * tl.num_programs(1)) + head) * HEAD_DIM
    if DIRECT:
        tl.store(out_ptr + out_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        part_base = split.to(tl.int64) * num_tokens * GROUP * tl.num_programs(1)
        tl.store(part_o_ptr + part_base * HEAD_DIM + out_off[:, None] + offs_d[None, :], o,
                 mask=row_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        lse = tl.where(bad > 0, float("nan"), lse)
        tl.store(part_lse_ptr + part_base + out_off // HEAD_DIM, lse, mask=row_ok)


@triton.jit
def paged_attention_kernel(
    q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, bias_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    sm_scale_log2, softcap_log2, window_left, num_tokens, num_blocks, max_blocks,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
    stride_btb, stride_btn, stride_ab, stride_ah, stride_am, stride_an, bias_rows, bias_cols,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    INT8_K: tl.constexpr, V_INT8: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_BOOL: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
    DECODE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Grid (batch, num_kv_heads, num_splits). Lengths and starts are clamped so that bad
    values (unchecked on the GPU) can never move a read outside the cache or the table.
    Read only under their flags: ``softcap_log2`` (SOFTCAP), softcap * log2(e), and
    ``window_left`` (WINDOW), >= 1."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len, q_start, q_len = sequence_bounds(seq_lens_ptr, qsl_ptr, b, num_tokens, max_blocks,
                                              PAGE)
    first = 0  # the first key any query of the sequence reads: the splits start there
    if WINDOW:
        first = tl.maximum(seq_len - q_len + 1 - window_left, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = first + split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, seq_len)
    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_btb
    num_q_blocks = 1 if DECODE else tl.cdiv(q_len, QT)
    for qb in range(0, num_q_blocks):
        _attend_rows(
            q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, bias_ptr,
            out_ptr, part_o_ptr, part_lse_ptr,
            b, kvh, split, qb, seq_len, q_start, q_len, kv_lo, kv_hi,
            sm_scale_log2, softcap_log2, window_left, num_tokens, num_blocks,
            stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
            stride_vh, stride_ksb, stride_kst, stride_ksh, stride_vsb, stride_vst, stride_vsh,
            stride_btn, stride_ab, stride_ah, stride_am, stride_an, bias_rows, bias_cols,
            GROUP, GROUP_PAD, QT, BLOCK_M, BLOCK_N, HEAD_DIM, PAGE,
            INT8_K, V_INT8, CAUSAL, HAS_BIAS, BIAS_BOOL, DIRECT, PRECISION, WINDOW, SOFTCAP,
        )


@triton.jit
def combine_splits_kernel(part_o_ptr, part_lse_ptr, out_ptr, rows, num_splits,
                          SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                          WAIT: tl.constexpr = False):
    """Merge the splits' partial rows of one (token, head); a row no key reached gets 0 (or
    the NaN a masked key's V put in its partial row: a split enters with weight 0, not
    skipped), and a split whose log-sum-exp is NaN makes the row NaN.
    WAIT: launched as a programmatic dependent launch, so wait for the attention grid."""
    if WAIT:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    lse = tl.load(part_lse_ptr + offs_s * rows + row, mask=s_ok, other=float("-inf"))
    bad = tl.max((lse != lse).to(tl.int32), axis=0)
    m = tl.max(tl.where(lse != lse, float("-inf"), lse), axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    o = tl.load(part_o_ptr + (offs_s[:, None] * rows + row) * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    res = tl.where(bad > 0, float("nan"), res)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, res.to(out_ptr.dtype.element_ty))

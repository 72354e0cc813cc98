"""Gluon paged prefill on Hopper: the Q·K^T of one key tile runs on the tensor cores while
the softmax of another runs on the CUDA cores. The "ws" kernel serves every cache kind,
taken from its arguments (one kernel, not a copy per kind): 16-bit K and V, INT8 K with a
16-bit V, and INT8 K+V; "cp" serves INT8 K with a 16-bit V.

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
  box per page (per swizzle span of a row: 128 bytes, or the row where it is narrower),
  all signalling the tile's ``ready`` mbarrier with its byte count. An int8 cache's
  per-token scales are loaded into registers before the producer waits for the buffer and
  stored to shared memory after. The one tile that reaches past the sequence's last key is
  copied with cp.async instead, 8 rows by one swizzle span at a time, zero-filled past the
  key: a slot past the sequence may hold any bits (NaN too), and P·V would carry them into
  the rows with weight 0. Each consumer issues tile j+1's Q·K^T and tile j's P·V together
  and then runs tile j+1's softmax while P·V is still on the tensor cores (FA3's
  intra-warpgroup overlap); two consumers take turns issuing (two ``turn`` mbarriers: FA3's
  ping-pong), so one's softmax runs while the other's wgmma do. A consumer releases a
  buffer (``empty``) once its P·V on it is done. With ``OWN_TILES`` (``GluonPlan.own_tiles``)
  a consumer stops at the last key tile its own rows read (below the diagonal consumer 0's
  end a 64-key tile earlier; rows past the query read none) and releases the later buffers
  unread, passing its turns on. With INT8 V a widener partition (two warps
  beside the producer, in the warpgroup the producer's registers take anyway) widens each
  tile's V into one of two fp16 copies the consumers share (below), which their P·V reads;
  an int8 buffer goes back once the consumers read its scales and the widener its V, a copy
  once both consumers' P·V on it is done. With ``WG1_WIDENS`` (``GluonPlan.wg1_widens``,
  a short query whose packed rows fit one consumer at head_dim 256) the tile holds 64 rows
  and the second warpgroup, with a consumer's registers, widens in place of those two
  warps. With ``KV_RINGS``
  (``GluonPlan.kv_rings``) K and V buffers have barriers of their own: a K buffer goes
  back once its Q·K^T and softmax are done, a tile before its V buffer, so that two
  buffers of longer tiles keep the producer ahead where shared memory holds no third
  (the extra barrier work per tile costs where it does not). With rings, ``V_LOADER``
  (``GluonPlan.v_loader``) gives V tiles a one-warp loader of their own, so that the
  producer's K boxes never wait behind V's (a 16-token page of a 16-bit row of 256 values
  is four boxes per cache).
- ``"cp"`` (gluon_prefill_kernel): one partition of ``block_m // 16`` warps; K, V and the
  key scales gathered through the block table with cp.async (any page size and stride),
  ``stages`` buffers deep (tile i in buffer i % stages; the copy of tile j + stages - 1 is
  issued at step j); per key tile j it issues tile j+1's Q·K^T, runs tile j's softmax and
  P·V, and only then waits. Two CTA-wide barriers per tile keep its warpgroups in step.

Both: grid (head pack, query tile, sequence) as in triton_prefill.py (the longest causal
tiles first), or where the sequences' lengths differ (head pack, list entry) over a list of
the tiles that have rows that every CTA builds from query_start_loc (``_work``,
``tile_grid``); a tile holds ``block_m`` rows, token-major over ``pack`` query heads of one
GQA group, kept in shared memory ("ws" with ``GluonPlan.q_tma``: loaded by the producer's
TMA boxes, ahead of the first key tile's, where the tile is one head's consecutive tokens;
otherwise by the consumers, a chain of loads and stores before their first MMA). INT8 K: Q
is quantized once per (token, head) before the kernel, Q·K^T is an int8 wgmma with int32
scores, turned to fp32 by their bits (0x4B400000 + x is the float 1.5 * 2**23 + x for
|x| < 2**22) and one FFMA with the key's scale; the row's q_scale * softmax scale * log2(e)
joins the exp2's FMA. 16-bit K: Q·K^T is a bf16/fp16 wgmma with fp32 scores and softmax
scale * log2(e) in the exp2's FMA. Softmax online in fp32, log2 domain; P·V is a 16-bit
wgmma with P from registers and V from shared memory: V's type for a 16-bit V cache; for
INT8 V, fp16 P' = p * v_scale (the CUDA decode's choice: fp16 keeps 3 more bits of P' than
bf16) over V's int8 values widened exactly to fp16 (p * v_scale above 65504 overflows P'
to Inf, as the Triton prefill's fp16 path does). Two ways the "ws" consumers take work off
their softmax, the critical path of the ping-pong, both with a 16-bit V: the rows' sums
come from the tensor cores (``GluonPlan.sum_mma``: a wgmma of P times a [keys, 8] tile of
ones beside P·V, so the sums are of P as P·V takes it), and with ``GluonPlan.lazy_max`` a
warp's rows keep their maxima until one would grow by more than LAZY_LOG2 (weights then
reach 2**LAZY_LOG2, which a 16-bit P holds; INT8 V's fp16 P' would overflow from a V scale
of 256), so that most tiles skip the accumulator's rescale by a uniform branch. The output
is stored from the accumulator's own layout, or with ``GluonPlan.o_tma`` (queries loaded by
TMA) a warpgroup whose rows are all in the query writes them into a buffer no one reads
any more, its 16-bit query's or (an int8 query) a V buffer of the output's type
(``_out_buffer``), and stores them by TMA boxes, so that its CTA ends sooner.

Two KV heads as one (``GluonPlan.kv_pairs``, 16-bit caches whose heads' rows lie side by side
in a token's row, as NHD pages hold them): a short query's tile of one KV head's group
leaves rows of its 64 empty (q_len 4 at a GQA group of 8: 32), each still costing the
softmax. Viewed as one head of twice the head_dim, a pair's K and V tiles are the same
boxes; each query row holds its head's query in its own KV head's half of the columns and
zeros in the other, so that its scores take its own keys only, and stores its own half of
P·V (the other half is its weights times the other head's values). The tile then packs both
groups' rows, for twice the matrix work per score on a path its softmax bounds.

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

import dataclasses
from typing import NamedTuple

import torch
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
    GluonPlan,
    check_plan,
    checked_default_plans,
    kernel_heads,
    pair_view,
    swizzle_bytes,
    tile_grid,
    tma_rows,
    view_unsupported,
)
from pagedfuse.ops.call import PagedCall
from pagedfuse.ops.triton_paged import LOG2E
from pagedfuse.ops.triton_quantize import quantize_int8

MAGIC = gl.constexpr(0x4B400000)  # the bits of the float 1.5 * 2**23
MAGIC_F = gl.constexpr(12582912.0)
WG_ROWS = gl.constexpr(64)  # query rows per consumer warpgroup of the "ws" kernel
# "ws" with an INT8 V cache: the widener's warps (they share the producer warp's warpgroup
# and its registers, warps that Triton otherwise pads that warpgroup with) and its fp16
# copies of V tiles, shared by the consumers (one being read while the next is written)
WIDEN_WARPS = gl.constexpr(2)
WIDEN_VALUES = gl.constexpr(16)  # values a widener thread widens per step, at PRODUCER_REGS
WG1_WIDEN_VALUES = gl.constexpr(64)  # ... and a thread of consumer 1 (WG1_WIDENS)
V16_BUFS = gl.constexpr(2)
# _rescale's branch and multiplies: RESCALE_PACK accumulator values ($0..: outputs tied to
# their inputs), their rows' factors, and whether the warp skips them
RESCALE_PACK = gl.constexpr(16)
RESCALE_ASM = gl.constexpr(
    f"{{ .reg .pred p; setp.eq.s32 p, ${3 * 16}, 0; @p bra.uni SKIP; "
    + " ".join(f"mul.f32 ${i}, ${i}, ${2 * 16 + i};" for i in range(16)) + " SKIP: }")
RESCALE_CONSTRAINTS = gl.constexpr(
    ",".join(["=f"] * 16 + [str(i) for i in range(16)] + ["f"] * 16 + ["r"] * 16))
LAZY_LOG2 = gl.constexpr(8.0)  # how far a row's maximum may lag (log2 units), see _probs
SUM_COLS = gl.constexpr(8)  # columns of ones in the row sums' wgmma (its narrowest N)
LIST_CHUNK = gl.constexpr(128)  # sequences per step of _listed_tile's search


# ---- shared by both pipelines -----------------------------------------------------------

@gluon.jit
def _cache_blocks(blk, num_blocks):
    """Block ids as ``cache[block_table]`` reads them ([-num_blocks, 0) wraps), clamped into
    the cache."""
    blk = blk.to(gl.int64)
    blk = gl.where(blk < 0, blk + num_blocks, blk)
    return gl.minimum(gl.maximum(blk, 0), num_blocks - 1)


@gluon.jit
def _sequence(seq_lens_ptr, qsl_ptr, b, num_tokens, max_blocks, live, PAGE: gl.constexpr):
    """Sequence ``b``'s key count, first query token and query count, clamped into the
    table and the query; zeros where not ``live`` (no load waited for)."""
    seq_len = gl.load(seq_lens_ptr + b, mask=live, other=0).to(gl.int32)
    seq_len = gl.minimum(gl.maximum(seq_len, 0), max_blocks * PAGE)
    q_start = gl.load(qsl_ptr + b, mask=live, other=0).to(gl.int32)
    q_start = gl.minimum(gl.maximum(q_start, 0), num_tokens)
    q_end = gl.load(qsl_ptr + b + 1, mask=live, other=0).to(gl.int32)
    q_end = gl.minimum(gl.maximum(q_end, q_start), num_tokens)
    return seq_len, q_start, q_end - q_start


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _listed_tile(qsl_ptr, j, batch, num_tokens, min_q, max_q, max_tiles,
                 TOKENS: gl.constexpr):
    """Entry ``j`` of the list of the query tiles the launch serves (sequences of min_q to
    max_q tokens, at most ``max_tiles`` each), in sequence order and each sequence's last
    tile first: its sequence, or ``batch`` past the list's end, and its tile. Every CTA
    builds the list from query_start_loc, LIST_CHUNK sequences at a time, so the grid
    needs only a bound on its length (no host sync)."""
    SEQS: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs = gl.arange(0, LIST_CHUNK, layout=SEQS)
    before = j * 0  # tiles of the sequences before the chunk
    b = j * 0 + batch  # a tensor, as the loop makes it (an argument of 1 is a constant)
    tile = j * 0
    b0 = j * 0
    while (b0 < batch) & (b == batch):
        idx = b0 + offs
        ok = idx < batch
        start = gl.load(qsl_ptr + idx, mask=ok, other=0).to(gl.int32)
        end = gl.load(qsl_ptr + idx + 1, mask=ok, other=0).to(gl.int32)
        start = gl.minimum(gl.maximum(start, 0), num_tokens)  # clamped as _sequence does
        q_len = gl.minimum(gl.maximum(end, start), num_tokens) - start
        served = ok & (q_len >= min_q) & ((max_q == 0) | (q_len <= max_q))
        n = gl.where(served, gl.minimum(gl.cdiv(q_len, TOKENS), max_tiles), 0)
        upto = gl.associative_scan(n, 0, _add) + before  # tiles up to each one's own
        first = gl.min(gl.where(upto > j, idx, batch), axis=0)
        at = idx == first
        k = j - gl.sum(gl.where(at, upto - n, 0), axis=0)  # j's place in its sequence
        tile = gl.sum(gl.where(at, n, 0), axis=0) - 1 - k
        b = first
        before += gl.sum(n, axis=0)
        b0 += LIST_CHUNK
    return b, tile


@gluon.jit
def _work(seq_lens_ptr, qsl_ptr, batch, num_tokens, max_blocks, min_q, max_q, max_tiles,
          TOKENS: gl.constexpr, PAGE: gl.constexpr, LISTED: gl.constexpr):
    """This CTA's sequence, the first of its query tokens in it (t0), the sequence's key
    count, first query token and query count, and whether it has no rows to serve. Grid
    (heads, query tiles, batch), the longest causal tiles first, or with ``LISTED``
    (heads, a bound on the tiles of the sequences it serves, 1) over _listed_tile's list,
    where the sequences' lengths differ: a grid sized by the longest query would launch a
    CTA per tile of every sequence, one per SM at a time, most of them to exit."""
    if LISTED:
        b, tile = _listed_tile(qsl_ptr, gl.program_id(1), batch, num_tokens, min_q, max_q,
                               max_tiles, TOKENS)
    else:
        tile = gl.num_programs(1) - 1 - gl.program_id(1)
        b = gl.program_id(2)
    live = b < batch  # past the list's end: exits without reading a sequence
    b = gl.minimum(b, batch - 1)
    seq_len, q_start, q_len = _sequence(seq_lens_ptr, qsl_ptr, b, num_tokens, max_blocks,
                                        live, PAGE)
    t0 = tile * TOKENS
    # sequences of fewer than min_q or (max_q > 0) more than max_q tokens: another launch's
    idle = ~live | (t0 >= q_len) | (q_len < min_q) | ((max_q > 0) & (q_len > max_q))
    return b, t0, seq_len, q_start, q_len, idle


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
                   stride_qsh, sm_scale_log2, PACK: gl.constexpr, CAUSAL: gl.constexpr):
    """Per score row: the factor to log2-domain logits (softmax scale * log2(e), times the
    row's q_scale for an int8 query: ``qs_ptr`` not None), and the keys it reads (<
    row_end)."""
    t = t0 + rows // PACK
    if qs_ptr is None:
        row_scale = gl.full(rows.shape, sm_scale_log2, gl.float32, rows.type.layout)
    else:  # (a row past the sequence's queries reads its last one, as _load_q does)
        row_scale = gl.load(qs_ptr + (q_start + gl.minimum(t, q_len - 1)).to(gl.int64)
                            * stride_qst + (pid_h * PACK + rows % PACK) * stride_qsh)
        row_scale = row_scale * sm_scale_log2
    if CAUSAL:
        row_end = gl.minimum(ctx + t + 1, seq_len)
    else:
        row_end = gl.zeros_like(t) + seq_len
    return row_scale, row_end


@gluon.jit
def _key_scaled(s_int, k_scale):
    """fp32 scores from int8 Q·K^T's int32 ones and the keys' scales (the query's joins the
    softmax's FMA): int32 -> fp32 by its bits, then one FFMA with the key's scale (an Inf
    scale gives Inf - Inf = NaN, as the dequantized key's 0 * Inf does)."""
    s = (s_int + MAGIC).to(gl.float32, bitcast=True)
    return gl.fma(s, k_scale[None, :], (k_scale * -MAGIC_F)[None, :])


@gluon.jit
def _probs(s, m_i, row_scale, offs_n, row_end, MASKED: gl.constexpr, LAZY: gl.constexpr):
    """Tile weights exp2(s * row_scale - m) and the new row maxima, from scores ``s``.
    MASKED: key n counts for row i only below row_end[i]; otherwise every key counts and the
    scale folds into the exp2's FMA (row_scale >= 0). LAZY: a warp's rows keep their maxima
    unless one of them would grow by more than LAZY_LOG2 (the weights then reach
    2**LAZY_LOG2), so that most tiles leave the accumulator as it is (``_rescale``)."""
    if MASKED:
        x = gl.where(offs_n[None, :] < row_end[:, None], s * row_scale[:, None], float("-inf"))
        m_tile = gl.max(x, axis=1)
    else:
        m_tile = gl.max(s, axis=1) * row_scale
    m_new = gl.maximum(m_i, m_tile)
    if LAZY:
        m_new = gl.where(_warp_any(m_tile > m_i + LAZY_LOG2) != 0, m_new, m_i)
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        p = gl.exp2(x - m_use[:, None])
    else:
        m_use = m_new
        p = gl.exp2(s * row_scale[:, None] - m_use[:, None])
    return p, m_new, m_use


@gluon.jit
def _warp_any(x):
    """Per row (two a thread, as an MMA layout's rows are): 1 where any row of the warp has
    ``x`` true, else 0; the same in every lane, so that a branch on it is uniform."""
    return gl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .b32 t;
        or.b32 t, $2, $3;
        setp.ne.b32 p, t, 0;
        vote.sync.any.pred p, p, 0xffffffff;
        selp.b32 $0, 1, 0, p;
        mov.b32 $1, $0;
        }""",
        "=r,=r,r,r", [x.to(gl.int32)], dtype=gl.int32, is_pure=True, pack=2)


@gluon.jit
def _rescale(acc, alpha):
    """acc * alpha per row, skipped (a uniform branch per 16 values) in a warp whose rows'
    factors are all 1 (LAZY: no row's maximum moved)."""
    a = gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))
    moved = _warp_any(a != 1.0)
    a, acc = gl.broadcast(a[:, None], acc)
    moved, _ = gl.broadcast(moved[:, None], acc)
    return gl.inline_asm_elementwise(RESCALE_ASM, RESCALE_CONSTRAINTS, [acc, a, moved],
                                     dtype=gl.float32, is_pure=True, pack=RESCALE_PACK)


@gluon.jit
def _online(s, m_i, l_i, row_scale, row_end, start, every_key_read, cols,
            CUDA_SUMS: gl.constexpr = True, LAZY: gl.constexpr = False):
    """One key tile of the online softmax from its fp32 scores: the weights, the new row
    maxima and sums (not CUDA_SUMS: ``l_i`` as it is, the tensor cores sum the rows), and the
    factor the accumulator takes (the masked path only for a tile some row does not read
    whole: ``every_key_read`` false)."""
    if every_key_read:
        p, m_new, m_use = _probs(s, m_i, row_scale, start + cols, row_end, False, LAZY)
    else:
        p, m_new, m_use = _probs(s, m_i, row_scale, start + cols, row_end, True, LAZY)
    alpha = gl.exp2(m_i - m_use)
    if CUDA_SUMS:
        l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _own_columns(head, offs_d, HEAD_DIM: gl.constexpr, PAIRED_GROUP: gl.constexpr):
    """With two KV heads as one (kv_pairs; PAIRED_GROUP: the GQA group of each), per query
    head and tile column: the column of the head's own row it is, and whether it is one (a
    head's row is the half of the tile's columns that its KV head fills)."""
    D: gl.constexpr = HEAD_DIM // 2
    col = offs_d[None, :] - ((head // PAIRED_GROUP) % 2 * D)[:, None]
    return col, (col >= 0) & (col < D)


@gluon.jit
def _normalized(acc, l_i, PV: gl.constexpr, dtype: gl.constexpr):
    """The output rows acc / l in ``dtype`` (a row that saw no key: zeros)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, PV))
    return (acc / gl.where(l_o > 0.0, l_o, 1.0)[:, None]).to(dtype)


@gluon.jit
def _store_rows(out_ptr, acc, l_i, row0, t0, q_start, q_len, num_q_heads, pid_h,
                PACK: gl.constexpr, TOKENS: gl.constexpr, HEAD_DIM: gl.constexpr,
                PV: gl.constexpr, PAIRED_GROUP: gl.constexpr = 0):
    """out rows [row0, row0 + acc rows) of this tile (``_normalized``), stored from the
    accumulator's own layout: a conversion to a row-wise one would take a scratch buffer of
    shared memory as large as the rows, for the kernel's whole life. With two KV heads as
    one, each row stores its own half (``_own_columns``)."""
    o = _normalized(acc, l_i, PV, out_ptr.dtype.element_ty)
    rows = row0 + gl.arange(0, acc.shape[0], gl.SliceLayout(1, PV))
    t = t0 + rows // PACK
    ok = (t < q_len) & (rows < TOKENS * PACK)
    head = pid_h * PACK + rows % PACK
    out_row = (q_start + t).to(gl.int64) * num_q_heads + head
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, PV))
    if PAIRED_GROUP:
        col, own = _own_columns(head, offs_d, HEAD_DIM, PAIRED_GROUP)
        gl.store(out_ptr + out_row[:, None] * (HEAD_DIM // 2) + col, o,
                 mask=ok[:, None] & own)
    else:
        gl.store(out_ptr + out_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=ok[:, None])


@gluon.jit
def _store_rows_by_tma(o_desc, buf, acc, l_i, row, col, PV: gl.constexpr):
    """A warpgroup's 64 rows, every one of them in the query, by TMA boxes: acc / l in the
    output's type into ``buf`` (``_out_buffer``: a [64, head_dim] tile of the output view's
    layout that no one reads any more), then a box per swizzle span at the output view's
    ``row``, ``col``; the CTA exits only once the boxes have read the buffer."""
    buf.store(_normalized(acc, l_i, PV, buf.dtype))
    fence_async_shared()  # the TMA reads it through the async proxy
    W: gl.constexpr = o_desc.block_type.shape[1]
    for c in gl.static_range(buf.type.shape[1] // W):
        tma.async_copy_shared_to_global(o_desc, [row, col + c * W],
                                        _box(buf, c, 0, buf.type.shape[0], o_desc))
    tma.store_wait(0)


@gluon.jit
def _out_buffer(q_buf, v_smem, qs_ptr, num_tiles, WG: gl.constexpr, STAGES: gl.constexpr):
    """Where a consumer puts its output rows for their TMA boxes: its query buffer where
    that is of the output's type (a 16-bit query), else (an int8 query, whose buffer is half
    the size; the launch passes ``o_desc`` only with a V cache of the output's type) the
    first 64 rows of V buffer (num_tiles + WG) % STAGES. Every reader has released that one:
    consumer 0 takes its last turn once consumer 1 issued its MMAs of turn num_tiles - 1,
    and so released key tile num_tiles - 3; consumer 1 takes its own once consumer 0 issued
    turn num_tiles, having released tile num_tiles - 2 (so STAGES >= 3 with two consumers;
    one consumer has released all but its last tile). Nothing loads into it again: the
    CTA has no key tile num_tiles."""
    if qs_ptr is None:
        buf = q_buf
    else:
        buf = v_smem.index((num_tiles + WG) % STAGES)._reinterpret(
            v_smem.dtype, [WG_ROWS, v_smem.type.shape[2]], v_smem.layout)
    return buf


@gluon.jit
def _load_q(q_ptr, rows, t0, q_start, q_len, pid_h, stride_qt, stride_qh,
            PACK: gl.constexpr, HEAD_DIM: gl.constexpr, COPY: gl.constexpr,
            PAIRED_GROUP: gl.constexpr = 0):
    """The query rows of this tile (int8 or 16-bit), token-major over the packed heads. A
    row past the sequence's queries (never stored) reads its last one: no mask, so that no
    predicate of it stays live to the store (the consumers spilled them). With two KV heads
    as one, a row holds its head's query in its own half of the columns and zeros in the
    other (``_own_columns``), so that its scores take its own KV head's keys only."""
    t = gl.minimum(t0 + rows // PACK, q_len - 1)
    head = pid_h * PACK + rows % PACK
    off = (q_start + t).to(gl.int64) * stride_qt + head * stride_qh
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, COPY))
    if PAIRED_GROUP:
        col, own = _own_columns(head, offs_d, HEAD_DIM, PAIRED_GROUP)
        return gl.load(q_ptr + off[:, None] + col, mask=own, other=0)
    return gl.load(q_ptr + off[:, None] + offs_d[None, :])


# ---- "ws": warp-specialized, TMA -----------------------------------------------------------

@gluon.jit
def _box(buf, chunk, row, rows: gl.constexpr, desc):
    """Rows [row, row + rows) of column chunk ``chunk`` (one swizzle span) of a [keys, D]
    buffer, as the destination of one TMA box: an NVMMA tile stores its columns in
    swizzle-wide chunks of all rows, one after another."""
    width: gl.constexpr = desc.block_type.shape[1]
    chunks: gl.constexpr = buf.type.shape[1] // width
    keys: gl.constexpr = buf.type.shape[0]
    view = buf._reinterpret(buf.dtype, [chunks * keys, width], desc.layout)
    return view.slice(chunk * keys + row, rows)


@gluon.jit
def _scales(s_ptr, st, blk, slot, kvh, ok):
    """Per-token scales of an int8 cache (``st``: its (block, token, head) strides)."""
    return gl.load(s_ptr + blk * st[0] + slot * st[1] + kvh * st[2], mask=ok, other=0.0)


@gluon.jit
def _copy_tail(buf, r, desc, ptr, st, bt_row_ptr, start, end, kvh, num_blocks, stride_btn,
               PAGE: gl.constexpr):
    """cp.async of keys [start + r, start + r + 8) of one cache into rows [r, r + 8) of its
    tile ``buf``, gathered through the block table (``st``: the cache's (block, token, head)
    strides), one swizzle span (``desc``'s box width) at a time: 16 bytes per lane and
    copy, so that the producer warp's few registers hold the addresses. Keys >= ``end``
    are zero-filled, not read."""
    W: gl.constexpr = desc.block_type.shape[1]
    VEC: gl.constexpr = 128 // desc.dtype.primitive_bitwidth
    ROWS: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // W, W // VEC], [1, 1], [1, 0])
    offs_n = start + r + gl.arange(0, 8, gl.SliceLayout(1, ROWS))
    ok = offs_n < end
    blk = _cache_blocks(gl.load(bt_row_ptr + (offs_n // PAGE) * stride_btn, mask=ok, other=0),
                        num_blocks)
    row = blk * st[0] + (offs_n % PAGE) * st[1] + kvh * st[2]
    offs_d = gl.arange(0, W, gl.SliceLayout(0, ROWS))
    for c in gl.static_range(buf.type.shape[1] // W):
        cp.async_copy_global_to_shared(_box(buf, c, r, 8, desc),
                                       ptr + row[:, None] + (c * W + offs_d)[None, :],
                                       mask=ok[:, None])


@gluon.jit
def _store_scales(ks_smem, vs_smem, i, k_scale, v_scale):
    """A tile's key and value scales (None: that cache is 16-bit, or not this tile's) into
    buffer ``i``."""
    if k_scale is not None:
        ks_smem.index(i).store(k_scale)
    if v_scale is not None:
        vs_smem.index(i).store(v_scale)


@gluon.jit
def _page_boxes(cache, bar, page_blk, slot, p, BOX: gl.constexpr):
    """The TMA boxes of one page of a tile: ``cache`` is (buffer, TMA view, pointer, strides,
    view rows per block, the head's first row, its column)."""
    buf = cache[0]
    desc = cache[1]
    W: gl.constexpr = desc.block_type.shape[1]
    row = page_blk * cache[4] + cache[5] + slot
    for c in gl.static_range(buf.type.shape[1] // W):
        tma.async_copy_global_to_shared(desc, [row, cache[6] + c * W], bar,
                                        _box(buf, c, p * BOX, BOX, desc))


@gluon.jit
def _load_q_boxes(q_desc, q_smem, bar, q_row, q_col):
    """The tile's query rows into ``q_smem`` (one [64, D] buffer per consumer), a TMA box per
    consumer and swizzle span of the [rows, token stride] view: rows from ``q_row``, the
    head's columns from ``q_col`` (as a cache's page: the head's offset over the token
    stride is rows, the rest columns). Rows past the view are zero-filled; rows of the next
    sequence are read, never stored."""
    W: gl.constexpr = q_desc.block_type.shape[1]
    ROWS: gl.constexpr = q_desc.block_type.shape[0]
    bufs: gl.constexpr = q_smem.type.shape[0]
    width: gl.constexpr = q_smem.type.shape[2]
    mbarrier.expect(bar, bufs * ROWS * width * q_desc.dtype.primitive_bitwidth // 8)
    for w in gl.static_range(bufs):
        for c in gl.static_range(width // W):
            tma.async_copy_global_to_shared(q_desc, [q_row + w * ROWS, q_col + c * W], bar,
                                            _box(q_smem.index(w), c, 0, ROWS, q_desc))


@gluon.jit
def _fill(k, v, bar, TILE_BYTES: gl.constexpr, ks_smem, vs_smem, i, k_scale, v_scale,
          bt_row_ptr, start, seq_len, kvh, num_blocks, stride_btn, BLOCK_N: gl.constexpr,
          PAGE: gl.constexpr, SCALED: gl.constexpr):
    """Key tile ``start`` of the K cache ``k`` and the V cache ``v`` (``_page_boxes``'
    tuples; None: not this call's) into their buffers ``i``, signalling ``bar``: a TMA box
    per page and swizzle span, or for the tile that reaches past the sequence's last key
    cp.async, zero-filled past it (a slot there may hold any bits); then the scales."""
    BOX: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N
    if start + BLOCK_N <= seq_len:
        mbarrier.expect(bar, TILE_BYTES)
        for p in gl.static_range(BLOCK_N // BOX):
            key = start + p * BOX
            page_blk = _cache_blocks(gl.load(bt_row_ptr + (key // PAGE) * stride_btn),
                                     num_blocks).to(gl.int32)
            if k is not None:
                _page_boxes(k, bar, page_blk, key % PAGE, p, BOX)
            if v is not None:
                _page_boxes(v, bar, page_blk, key % PAGE, p, BOX)
        _store_scales(ks_smem, vs_smem, i, k_scale, v_scale)
    else:  # the tile past the sequence's last key, zero-filled there
        _store_scales(ks_smem, vs_smem, i, k_scale, v_scale)  # (0 there; first: registers)
        for r in gl.static_range(0, BLOCK_N, 8):
            if k is not None:
                _copy_tail(k[0], r, k[1], k[2], k[3], bt_row_ptr, start, seq_len, kvh,
                           num_blocks, stride_btn, PAGE)
            if v is not None:
                _copy_tail(v[0], r, v[1], v[2], v[3], bt_row_ptr, start, seq_len, kvh,
                           num_blocks, stride_btn, PAGE)
        cp.commit_group()
        cp.wait_group(0)
        fence_async_shared()  # the wgmma read K and V through the async proxy
        mbarrier.arrive(bar, count=1)
    if SCALED:
        mbarrier.arrive(bar, count=1)  # the scales are in


@gluon.jit
def _producer(args, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
              STAGES: gl.constexpr, KV_RINGS: gl.constexpr, LOAD_K: gl.constexpr,
              LOAD_V: gl.constexpr):
    """One warp: fills buffer j % STAGES with key tile j once the consumers released it, of
    the K cache (LOAD_K) and the V cache (LOAD_V; neither: nothing to do). KV_RINGS: K and V
    buffers come back separately (K after Q·K^T and the softmax, V after P·V), each
    signalled by its own barrier, so that two warps may load them (one each); otherwise one
    barrier pair serves both and one warp loads both."""
    (k_desc, v_desc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, k_smem, v_smem, ks_smem,
     vs_smem, k_ready, v_ready, k_empty, v_empty, seq_len, num_tiles, kvh, num_blocks, k_st,
     v_st, ks_st, vs_st, stride_btn, q_desc, q_smem, q_ready, q_at) = args
    if LOAD_K and q_desc is not None:  # the tile's query rows first: the first MMA's operand
        _load_q_boxes(q_desc, q_smem, q_ready.index(0), q_at[0], q_at[1])
    K_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * k_desc.dtype.primitive_bitwidth // 8
    V_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM * v_desc.dtype.primitive_bitwidth // 8
    K_SCALED: gl.constexpr = LOAD_K and ks_ptr is not None
    V_SCALED: gl.constexpr = LOAD_V and vs_ptr is not None
    KEYS: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
    # where the page (block, kvh) starts in the TMA views: row block * per_block + row0,
    # column col (int32: the backend checks that the views have fewer than 2**31 rows)
    k_per_block = (k_st[0] // k_st[1]).to(gl.int32)
    k_row0 = ((kvh * k_st[2]) // k_st[1]).to(gl.int32)
    k_col = ((kvh * k_st[2]) % k_st[1]).to(gl.int32)
    v_per_block = (v_st[0] // v_st[1]).to(gl.int32)
    v_row0 = ((kvh * v_st[2]) // v_st[1]).to(gl.int32)
    v_col = ((kvh * v_st[2]) % v_st[1]).to(gl.int32)
    if LOAD_K or LOAD_V:
        for j in range(num_tiles):
            i = j % STAGES
            phase = ((j // STAGES) & 1) ^ 1
            start = j * BLOCK_N
            # the scales (of a tile in the sequence), loaded before waiting for the buffer so
            # that their latency overlaps the wait
            if K_SCALED or V_SCALED:
                offs = start + gl.arange(0, BLOCK_N, KEYS)
                ok = offs < seq_len
                blk = _cache_blocks(gl.load(bt_row_ptr + (offs // PAGE) * stride_btn, mask=ok,
                                            other=0), num_blocks)
            if K_SCALED:
                k_scale = _scales(ks_ptr, ks_st, blk, offs % PAGE, kvh, ok)
            else:
                k_scale: gl.constexpr = None
            if V_SCALED:
                v_scale = _scales(vs_ptr, vs_st, blk, offs % PAGE, kvh, ok)
            else:
                v_scale: gl.constexpr = None
            if LOAD_K:  # (one ring: K's barrier pair is V's too)
                mbarrier.wait(k_empty.index(i), phase)
            k = (k_smem.index(i), k_desc, k_ptr, k_st, k_per_block, k_row0, k_col)
            v = (v_smem.index(i), v_desc, v_ptr, v_st, v_per_block, v_row0, v_col)
            if KV_RINGS:
                if LOAD_K:
                    _fill(k, None, k_ready.index(i), K_BYTES, ks_smem, None, i, k_scale, None,
                          bt_row_ptr, start, seq_len, kvh, num_blocks, stride_btn, BLOCK_N,
                          PAGE, K_SCALED)
                if LOAD_V:
                    mbarrier.wait(v_empty.index(i), phase)
                    _fill(None, v, v_ready.index(i), V_BYTES, None, vs_smem, i, None, v_scale,
                          bt_row_ptr, start, seq_len, kvh, num_blocks, stride_btn, BLOCK_N,
                          PAGE, V_SCALED)
            else:
                _fill(k, v, k_ready.index(i), K_BYTES + V_BYTES, ks_smem, vs_smem, i, k_scale,
                      v_scale, bt_row_ptr, start, seq_len, kvh, num_blocks, stride_btn,
                      BLOCK_N, PAGE, K_SCALED or V_SCALED)


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
def _scores(s, ks_smem, i, QK: gl.constexpr):
    """fp32 scores of key tile ``i`` from the Q·K^T accumulator (int32 with an int8 K cache:
    ``ks_smem`` holds its key scales)."""
    if ks_smem is not None:
        s = _key_scaled(s, ks_smem.index(i).load(gl.SliceLayout(0, QK)))
    return s


@gluon.jit
def _p_operand(p, vs_smem, i, every_key_read, QK: gl.constexpr, P_OP: gl.constexpr,
               PV_T: gl.constexpr):
    """P as the P·V wgmma's register operand in its type; with an INT8 V cache (``vs_smem``
    holds its scales) P' = p * v_scale, in fp16 as the CUDA decode has it. In a tile some
    row does not read all of (``every_key_read`` false) a weight of 0 stays 0 whatever the
    key's scale; where every row reads every key, a non-finite scale reaches the row as it
    does in dequantize-then-attend, so the guard's compare and select are left out."""
    if vs_smem is not None:
        v_scale = vs_smem.index(i).load(gl.SliceLayout(0, QK))
        if every_key_read:
            p = p * v_scale[None, :]
        else:
            p = gl.where(p > 0.0, p * v_scale[None, :], 0.0)
    return gl.convert_layout(p.to(PV_T), P_OP)


@gluon.jit
def _int8_to_fp16(x):
    """int8 values to fp16, exactly (|x| <= 128), four per 32-bit register: XOR 0x80 makes
    each byte x + 128, a byte permute puts it under the exponent byte 0x64 (the bits of the
    fp16 1024 + byte), and a packed fp16 subtract of 1152 leaves x. 1.25 instructions a
    value on the ALU, where widening through int16 took 2.75 (a byte permute to sign-extend
    each pair, a packed add, a packed subtract) and a conversion instruction runs at 16 a
    clock per SM on sm_90, the rate the softmax's exp2 needs."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 u, bias;
        xor.b32 u, $2, 0x80808080;
        prmt.b32 $0, u, 0x64646464, 0x4140;
        prmt.b32 $1, u, 0x64646464, 0x4342;
        mov.b32 bias, 0x64806480;
        sub.f16x2 $0, $0, bias;
        sub.f16x2 $1, $1, bias;
        }""",
        "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)


@gluon.jit
def _widener(args, STAGES: gl.constexpr, TPW_D: gl.constexpr, WARPS: gl.constexpr,
             VALUES: gl.constexpr):
    """WARPS warps for an INT8 V cache (none: nothing to do), WIDEN_WARPS beside the
    producer or (WG1_WIDENS) consumer 1's four: key tile j's int8 V from the cache's buffer
    j % STAGES to fp16 in the shared copy j % V16_BUFS, exactly, once the consumers' P·V on
    that copy is done; then the copy is ``v16_ready`` and the int8 buffer goes back to the
    producer. The consumers' softmax never waits for it: widening in each consumer put 1.25
    instructions a value on their critical path (benchmarks/results/prefill_summary.md).
    VALUES: the values a thread widens per step, as its registers allow."""
    (v_smem, v16_smem, v_ready, v_empty, v16_ready, v16_empty, num_tiles) = args
    if v16_smem is not None:
        WIDEN: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_D, TPW_D], [WARPS, 1],
                                               [1, 0])
        ROWS: gl.constexpr = v_smem.type.shape[1]
        # rows per step: VALUES a thread, but at least the fp16 copy's 8-row swizzle span
        CHUNK: gl.constexpr = min(max(VALUES * 32 * WARPS // v_smem.type.shape[2], 8), ROWS)
        for j in range(num_tiles):
            i = j % STAGES
            w = j % V16_BUFS
            mbarrier.wait(v_ready.index(i), (j // STAGES) & 1)
            v8 = v_smem.index(i)
            x = v8.slice(0, CHUNK).load(WIDEN)  # (its latency overlaps the copy's wait)
            mbarrier.wait(v16_empty.index(w), ((j // V16_BUFS) & 1) ^ 1)
            v16 = v16_smem.index(w)
            # each chunk's loads are issued before the chunk before it is widened and
            # stored: a warp's shared-memory loads one at a time left it waiting on each
            for r in gl.static_range(0, ROWS, CHUNK):
                if r + CHUNK < ROWS:
                    nxt = v8.slice(r + CHUNK, CHUNK).load(WIDEN)
                v16.slice(r, CHUNK).store(_int8_to_fp16(x))
                if r + CHUNK < ROWS:
                    x = nxt
            fence_async_shared()  # the P·V wgmma reads it through the async proxy
            gl.thread_barrier()  # ... once every widening warp wrote its rows
            mbarrier.arrive(v16_ready.index(w), count=1)
            mbarrier.arrive(v_empty.index(i), count=1)


@gluon.jit
def _v_operand(v_smem, v16_smem, v16_ready, i, j):
    """The P·V wgmma's V for key tile ``j``: the cache's buffer ``i``, or with an INT8 V
    cache (``v16_smem`` not None) the widener's fp16 copy once it is written."""
    if v16_smem is None:
        tile = v_smem.index(i)
    else:
        w = j % V16_BUFS
        mbarrier.wait(v16_ready.index(w), (j // V16_BUFS) & 1)
        tile = v16_smem.index(w)
    return tile


@gluon.jit
def _release_after_p(v_empty, i, v16_smem):
    """With an INT8 V cache: P' read tile ``i``'s V scales and the widener reads its V, so
    the consumer's share of the buffer goes back now."""
    if v16_smem is not None:
        mbarrier.arrive(v_empty.index(i), count=1)


@gluon.jit
def _release_after_pv(v_empty, v16_empty, i, j, v16_smem):
    """After key tile ``j``'s P·V: its V buffer ``i``, or with an INT8 V cache its fp16 copy."""
    if v16_smem is None:
        mbarrier.arrive(v_empty.index(i), count=1)
    else:
        mbarrier.arrive(v16_empty.index(j % V16_BUFS), count=1)


@gluon.jit
def _sum_mma(p16, ones_smem, acc_l, SUM: gl.constexpr):
    """With ``ones_smem``: a wgmma adding the rows' sums of P (as P·V takes it) to
    ``acc_l``, P times columns of ones, issued after P·V; else ``acc_l``."""
    if ones_smem is not None:
        p_op = gl.convert_layout(p16, gl.DotOperandLayout(operand_index=0, parent=SUM,
                                                          k_width=2))
        acc_l = warpgroup_mma(p_op, ones_smem, acc_l, is_async=True)
    return acc_l


@gluon.jit
def _wait_pv(acc_tok, l_tok, p16, TENSOR_SUMS: gl.constexpr):
    """The accumulator, the row sums' accumulator (without TENSOR_SUMS: ``l_tok`` as it is)
    and P, once P·V and the sums' wgmma are done."""
    if TENSOR_SUMS:
        acc, l_tok, p16 = warpgroup_mma_wait(0, deps=(acc_tok, l_tok, p16))
    else:
        acc, p16 = warpgroup_mma_wait(0, deps=(acc_tok, p16))
    return acc, l_tok, p16


@gluon.jit
def _consumer(WG: gl.constexpr, args, PACK: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              CONSUMERS: gl.constexpr, COPY_TPW_D: gl.constexpr, KV_RINGS: gl.constexpr,
              LAZY_MAX: gl.constexpr, OWN_TILES: gl.constexpr, PAIRED_GROUP: gl.constexpr):
    """One warpgroup: rows [WG * 64, WG * 64 + 64) of the tile over the CTA's key tiles, or
    with OWN_TILES those its own rows read (``args``: one tuple for both consumers, since a
    partition's arguments cannot be spliced); PAIRED_GROUP: ``_own_columns``."""
    (q_ptr, qs_ptr, out_ptr, q_smem, k_smem, v_smem, ks_smem, vs_smem, v16_smem, k_ready,
     v_ready, k_empty, v_empty, v16_ready, v16_empty, turn, sm_scale_log2, num_q_heads,
     q_start, q_len, seq_len, ctx, hi, num_tiles, t0, pid_h, stride_qt, stride_qh, stride_qst,
     stride_qsh, q_desc, q_ready, ones_smem, o_desc) = args
    TOKENS: gl.constexpr = WG_ROWS * CONSUMERS // PACK
    COPY: gl.constexpr = gl.BlockedLayout([1, 16], [32 // COPY_TPW_D, COPY_TPW_D], [4, 1],
                                          [1, 0])
    # Q·K^T: int8 (k32) with an int8 query, else 16-bit (k16); P·V: V's type, fp16 for INT8 V
    QK: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1],
        instr_shape=[16, BLOCK_N, 32 if qs_ptr is not None else 16])
    PV: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, HEAD_DIM, 16])
    P_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=PV, k_width=2)
    SUM: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, SUM_COLS, 16])
    PV_T: gl.constexpr = v_smem.dtype if v16_smem is None else gl.float16
    S_T: gl.constexpr = gl.int32 if qs_ptr is not None else gl.float32

    rows = WG * WG_ROWS + gl.arange(0, WG_ROWS, gl.SliceLayout(1, COPY))
    q_buf = q_smem.index(WG)
    if q_desc is None:
        q_buf.store(_load_q(q_ptr, rows, t0, q_start, q_len, pid_h, stride_qt, stride_qh,
                            PACK, HEAD_DIM, COPY, PAIRED_GROUP))
        fence_async_shared()  # the wgmma read it through the async proxy
    else:  # the producer's TMA boxes
        mbarrier.wait(q_ready.index(0), 0)
    rows_s = WG * WG_ROWS + gl.arange(0, WG_ROWS, gl.SliceLayout(1, QK))
    row_scale, row_end = _row_constants(qs_ptr, rows_s, t0, q_start, q_len, seq_len, ctx,
                                        pid_h, stride_qst, stride_qsh, sm_scale_log2, PACK,
                                        CAUSAL)
    t_first = t0 + (WG * WG_ROWS) // PACK
    own_hi, full = _key_bounds(seq_len, ctx, t_first, WG_ROWS // PACK, CAUSAL)
    full = gl.minimum(full, hi)
    own = num_tiles
    if OWN_TILES:  # the key tiles this warpgroup's rows read (rows past the query: none);
        # it computes at least the first (its turns start there), the rest go back unread
        own = gl.where(t_first < q_len, gl.cdiv(gl.minimum(own_hi, hi), BLOCK_N), 1)
        own = gl.minimum(gl.maximum(own, 1), num_tiles)
    cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, QK))
    zero_s = gl.zeros([WG_ROWS, BLOCK_N], S_T, QK)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, QK))
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, PV)
    # the row sums: on the CUDA cores, or (ones_smem) P times columns of ones on the tensor
    # cores beside P·V; both accumulators exist either way (a Gluon function cannot return
    # None), and the unused one is never read
    CUDA_SUMS: gl.constexpr = ones_smem is None
    l_i = gl.zeros([WG_ROWS], gl.float32, gl.SliceLayout(1, QK))
    acc_l = gl.zeros([WG_ROWS, SUM_COLS], gl.float32, SUM)
    if num_tiles > 0:
        mbarrier.wait(k_ready.index(0), 0)
        _take_turn(turn, WG, 0, CONSUMERS)
        s_tok = warpgroup_mma(q_buf, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False,
                              is_async=True)
        _pass_turn(turn, WG, CONSUMERS)
        s = warpgroup_mma_wait(0, deps=(s_tok,))
        every_key_read = BLOCK_N <= full
        p, m_i, l_i, alpha = _online(_scores(s, ks_smem, 0, QK), m_i, l_i, row_scale,
                                     row_end, 0, every_key_read, cols, CUDA_SUMS, LAZY_MAX)
        if KV_RINGS:  # K and its scales are read; V has its own barrier
            mbarrier.arrive(k_empty.index(0), count=1)
            mbarrier.wait(v_ready.index(0), 0)
        p16 = _p_operand(p, vs_smem, 0, every_key_read, QK, P_OP, PV_T)
        _release_after_p(v_empty, 0, v16_smem)
        for j in range(1, own):
            cur = j % STAGES
            prev = (j - 1) % STAGES
            phase = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(cur), phase)
            v_prev = _v_operand(v_smem, v16_smem, v16_ready, prev, j - 1)
            _take_turn(turn, WG, j, CONSUMERS)
            # tile j's Q·K^T and tile j-1's P·V back to back; the softmax of tile j then
            # runs while P·V is on the tensor cores
            s_tok = warpgroup_mma(q_buf, k_smem.index(cur).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
            acc_tok = warpgroup_mma(p16, v_prev, acc, is_async=True)
            l_tok = _sum_mma(p16, ones_smem, acc_l, SUM)
            _pass_turn(turn, WG, CONSUMERS)
            s = warpgroup_mma_wait(1 if CUDA_SUMS else 2, deps=(s_tok,))
            every_key_read = (j + 1) * BLOCK_N <= full
            p, m_i, l_i, alpha = _online(_scores(s, ks_smem, cur, QK), m_i, l_i, row_scale,
                                         row_end, j * BLOCK_N, every_key_read, cols,
                                         CUDA_SUMS, LAZY_MAX)
            if KV_RINGS:
                mbarrier.arrive(k_empty.index(cur), count=1)
            acc, acc_l, p16 = _wait_pv(acc_tok, l_tok, p16, not CUDA_SUMS)
            _release_after_pv(v_empty, v16_empty, prev, j - 1, v16_smem)
            if LAZY_MAX:
                acc = _rescale(acc, alpha)
            else:
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, PV))[:, None]
            if not CUDA_SUMS:
                acc_l = acc_l * gl.convert_layout(alpha, gl.SliceLayout(1, SUM))[:, None]
            if KV_RINGS:
                mbarrier.wait(v_ready.index(cur), phase)
            p16 = _p_operand(p, vs_smem, cur, every_key_read, QK, P_OP, PV_T)
            _release_after_p(v_empty, cur, v16_smem)
        last = (own - 1) % STAGES
        v_last = _v_operand(v_smem, v16_smem, v16_ready, last, own - 1)
        _take_turn(turn, WG, own, CONSUMERS)
        acc_tok = warpgroup_mma(p16, v_last, acc, is_async=True)
        l_tok = _sum_mma(p16, ones_smem, acc_l, SUM)
        _pass_turn(turn, WG, CONSUMERS)
        acc, acc_l, p16 = _wait_pv(acc_tok, l_tok, p16, not CUDA_SUMS)
        _release_after_pv(v_empty, v16_empty, last, own - 1, v16_smem)
        if OWN_TILES:
            for j in range(own, num_tiles):  # unread: the buffers' shares and turns go on
                cur = j % STAGES
                phase = (j // STAGES) & 1
                # loaded: the buffer's use before went back, so these arrivals count for this
                mbarrier.wait(k_ready.index(cur), phase)
                if KV_RINGS:
                    mbarrier.arrive(k_empty.index(cur), count=1)
                    mbarrier.wait(v_ready.index(cur), phase)
                _release_after_p(v_empty, cur, v16_smem)
                _v_operand(v_smem, v16_smem, v16_ready, cur, j)  # INT8 V: once it is widened
                _release_after_pv(v_empty, v16_empty, cur, j, v16_smem)
                _take_turn(turn, WG, j + 1, CONSUMERS)
                _pass_turn(turn, WG, CONSUMERS)
    if not CUDA_SUMS:  # every column of acc_l holds its row's sum
        l_i = gl.convert_layout(gl.max(acc_l, axis=1), gl.SliceLayout(1, QK))
    if o_desc is not None and t_first + WG_ROWS <= q_len:  # (pack 1: a row is a token)
        _store_rows_by_tma(o_desc, _out_buffer(q_buf, v_smem, qs_ptr, num_tiles, WG, STAGES),
                           acc, l_i, q_start + t_first, pid_h * HEAD_DIM, PV)
    else:
        _store_rows(out_ptr, acc, l_i, WG * WG_ROWS, t0, q_start, q_len, num_q_heads, pid_h,
                    PACK, TOKENS, HEAD_DIM, PV, PAIRED_GROUP)


@gluon.jit
def ws_prefill_kernel(
    q_ptr, qs_ptr, q_desc, o_desc, k_desc, v_desc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr,
    seq_lens_ptr, qsl_ptr, out_ptr, sm_scale_log2, num_tokens, num_q_heads, num_blocks,
    max_blocks,
    stride_qt, stride_qh, stride_qst, stride_qsh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst, stride_ksh, stride_vsb,
    stride_vst, stride_vsh, stride_btb, stride_btn, min_q, max_q, batch, max_tiles,
    GROUP: gl.constexpr, PACK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    COPY_TPW_D: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    KV_RINGS: gl.constexpr, V_LOADER: gl.constexpr, SUM_MMA: gl.constexpr,
    LAZY_MAX: gl.constexpr, OWN_TILES: gl.constexpr, WG1_WIDENS: gl.constexpr,
    LISTED: gl.constexpr, PAIRED_GROUP: gl.constexpr,
):
    """Grid (num_q_heads / PACK, query tiles, batch), or over a list (``_work``);
    num_warps = 4 (consumer 0, the default partition), plus consumer 1 (BLOCK_M 128), the
    producer warp, the V loader's warp (idle without V_LOADER) and the widener's warps (idle
    without an INT8 V cache). The caches' kinds come from the arguments: an int8 query with
    its scales ``qs_ptr`` for an INT8 K cache (with ``ks_ptr``), a 16-bit one and None for a
    16-bit K cache; ``vs_ptr`` for an INT8 V cache, None for a 16-bit one. PAIRED_GROUP (0:
    none): the caches are views of two KV heads as one of twice the head_dim, GROUP and
    HEAD_DIM theirs, and the query and output keep their own (``_own_columns``)."""
    # the warpgroups that read key tiles, one per 64 rows: with WG1_WIDENS only consumer 0,
    # the second warpgroup widening INT8 V in place of WIDEN_WARPS
    CONSUMERS: gl.constexpr = 1 if WG1_WIDENS else BLOCK_M // WG_ROWS
    TOKENS: gl.constexpr = CONSUMERS * WG_ROWS // PACK
    pid_h = gl.program_id(0)
    b, t0, seq_len, q_start, q_len, idle = _work(
        seq_lens_ptr, qsl_ptr, batch, num_tokens, max_blocks, min_q, max_q, max_tiles,
        TOKENS, PAGE, LISTED)
    if idle:
        return
    kvh = (pid_h * PACK) // GROUP
    ctx = seq_len - q_len  # keys before the first query token
    hi, _ = _key_bounds(seq_len, ctx, t0, TOKENS, CAUSAL)
    num_tiles = gl.cdiv(hi, BLOCK_N)
    bt_row_ptr = bt_ptr + b.to(gl.int64) * stride_btb

    q_type: gl.constexpr = q_ptr.dtype.element_ty
    if q_desc is None:  # the consumers load their rows themselves
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_ROWS, HEAD_DIM], q_type)
    else:  # the producer's TMA boxes
        Q_SMEM: gl.constexpr = q_desc.layout
    q_smem = gl.allocate_shared_memory(q_type, [CONSUMERS, WG_ROWS, HEAD_DIM], Q_SMEM)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    SCALES: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if ks_ptr is None:
        ks_smem: gl.constexpr = None
    else:
        ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], SCALES)
    if vs_ptr is None:
        vs_smem: gl.constexpr = None
        v16_smem: gl.constexpr = None
    else:  # INT8 V: its scales, and the widener's fp16 copies of V tiles
        vs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], SCALES)
        v16_smem = gl.allocate_shared_memory(
            gl.float16, [V16_BUFS, BLOCK_N, HEAD_DIM],
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.float16))
    if SUM_MMA:  # the B operand of the row sums' wgmma (16-bit V: P is V's type), stored
        # key-major as a K tile is (a [keys, 8] tile of 16-byte rows faulted on the H200)
        ONES: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        ones_smem = gl.allocate_shared_memory(
            v_desc.dtype, [SUM_COLS, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([SUM_COLS, BLOCK_N], v_desc.dtype),
            gl.full([SUM_COLS, BLOCK_N], 1.0, v_desc.dtype, ONES)).permute((1, 0))
        fence_async_shared()  # the wgmma read it through the async proxy
    else:
        ones_smem: gl.constexpr = None
    BARS: gl.constexpr = mbarrier.MBarrierLayout()
    # an int8 V buffer goes back once the consumers read its scales and the widener its V
    V_USERS: gl.constexpr = CONSUMERS if vs_ptr is None else CONSUMERS + 1
    if vs_ptr is None:
        v16_ready: gl.constexpr = None
        v16_empty: gl.constexpr = None
    else:
        v16_ready = gl.allocate_shared_memory(gl.int64, [V16_BUFS, 1], BARS)
        v16_empty = gl.allocate_shared_memory(gl.int64, [V16_BUFS, 1], BARS)
        for i in gl.static_range(V16_BUFS):
            mbarrier.init(v16_ready.index(i), count=1)
            mbarrier.init(v16_empty.index(i), count=CONSUMERS)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BARS)
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BARS)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], BARS)
    # the TMA copies (or the tail's cp.async), and the scales' stores where there are scales
    if KV_RINGS:
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BARS)
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], BARS)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1 if ks_ptr is None else 2)
            mbarrier.init(v_ready.index(i), count=1 if vs_ptr is None else 2)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)
            mbarrier.init(v_empty.index(i), count=V_USERS)
    else:  # one barrier pair per buffer serves K and V
        v_ready = k_ready
        v_empty = k_empty
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1 if ks_ptr is None and vs_ptr is None else 2)
            mbarrier.init(k_empty.index(i), count=V_USERS)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    if q_desc is None:
        q_ready: gl.constexpr = None
        q_at: gl.constexpr = None
    else:  # the query rows' barrier, and where in the view the tile's rows start
        q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], BARS)
        mbarrier.init(q_ready.index(0), count=1)
        q_at = (q_start + t0 + (pid_h * stride_qh) // stride_qt, (pid_h * stride_qh) % stride_qt)

    loads = (k_desc, v_desc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row_ptr, k_smem, v_smem, ks_smem,
             vs_smem, k_ready, v_ready, k_empty, v_empty, seq_len, num_tiles, kvh, num_blocks,
             (stride_kb, stride_kt, stride_kh), (stride_vb, stride_vt, stride_vh),
             (stride_ksb, stride_kst, stride_ksh), (stride_vsb, stride_vst, stride_vsh),
             stride_btn, q_desc, q_smem, q_ready, q_at)
    rows = (q_ptr, qs_ptr, out_ptr, q_smem, k_smem, v_smem, ks_smem, vs_smem, v16_smem, k_ready,
            v_ready, k_empty, v_empty, v16_ready, v16_empty, turn, sm_scale_log2, num_q_heads,
            q_start, q_len, seq_len, ctx, hi, num_tiles, t0, pid_h, stride_qt, stride_qh,
            stride_qst, stride_qsh, q_desc, q_ready, ones_smem, o_desc)
    widens = (v_smem, v16_smem, v_ready, v_empty, v16_ready, v16_empty, num_tiles)
    # the producer warp loads K, and V unless the V loader (a warp of its own) does
    K_AND_V: gl.constexpr = not V_LOADER
    if WG1_WIDENS:  # consumer 1's warpgroup widens, with a consumer's registers
        gl.warp_specialize([
            (_consumer, (0, rows, PACK, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, CONSUMERS,
                         COPY_TPW_D, KV_RINGS, LAZY_MAX, OWN_TILES, PAIRED_GROUP)),
            (_widener, (widens, STAGES, COPY_TPW_D, 4, WG1_WIDEN_VALUES)),
            (_producer, (loads, BLOCK_N, HEAD_DIM, PAGE, STAGES, KV_RINGS, True, K_AND_V)),
            (_producer, (loads, BLOCK_N, HEAD_DIM, PAGE, STAGES, KV_RINGS, False, V_LOADER)),
        ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    elif CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (0, rows, PACK, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, CONSUMERS,
                         COPY_TPW_D, KV_RINGS, LAZY_MAX, OWN_TILES, PAIRED_GROUP)),
            (_consumer, (1, rows, PACK, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, CONSUMERS,
                         COPY_TPW_D, KV_RINGS, LAZY_MAX, OWN_TILES, PAIRED_GROUP)),
            (_producer, (loads, BLOCK_N, HEAD_DIM, PAGE, STAGES, KV_RINGS, True, K_AND_V)),
            (_producer, (loads, BLOCK_N, HEAD_DIM, PAGE, STAGES, KV_RINGS, False, V_LOADER)),
            (_widener, (widens, STAGES, COPY_TPW_D, WIDEN_WARPS, WIDEN_VALUES)),
        ], [4, 1, 1, WIDEN_WARPS], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS,
                                    PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, rows, PACK, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, CONSUMERS,
                         COPY_TPW_D, KV_RINGS, LAZY_MAX, OWN_TILES, PAIRED_GROUP)),
            (_producer, (loads, BLOCK_N, HEAD_DIM, PAGE, STAGES, KV_RINGS, True, K_AND_V)),
            (_producer, (loads, BLOCK_N, HEAD_DIM, PAGE, STAGES, KV_RINGS, False, V_LOADER)),
            (_widener, (widens, STAGES, COPY_TPW_D, WIDEN_WARPS, WIDEN_VALUES)),
        ], [1, 1, WIDEN_WARPS], [PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS])


# ---- "cp": one partition, cp.async -------------------------------------------------------

@gluon.jit
def _copy_keys(k_buf, v_buf, k_ptr, v_ptr, k_st, v_st, bt_row_ptr, start, end, kvh,
               num_blocks, stride_btn, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
               PAGE: gl.constexpr, COPY: gl.constexpr):
    """cp.async of keys [start, start + ROWS) into ``k_buf`` and ``v_buf``, gathered through
    the block table (``*_st``: the caches' (block, token, head) strides); keys >= ``end`` are
    zero-filled, not read. Returns the keys' blocks, slots and whether each is < ``end``,
    for ``_copy_scales``."""
    offs_n = start + gl.arange(0, ROWS, gl.SliceLayout(1, COPY))
    offs_d = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, COPY))
    ok = offs_n < end
    blk = _cache_blocks(gl.load(bt_row_ptr + (offs_n // PAGE) * stride_btn, mask=ok, other=0),
                        num_blocks)
    slot = offs_n % PAGE
    k_row = blk * k_st[0] + slot * k_st[1] + kvh * k_st[2]
    v_row = blk * v_st[0] + slot * v_st[1] + kvh * v_st[2]
    cp.async_copy_global_to_shared(k_buf, k_ptr + k_row[:, None] + offs_d[None, :],
                                   mask=ok[:, None])
    cp.async_copy_global_to_shared(v_buf, v_ptr + v_row[:, None] + offs_d[None, :],
                                   mask=ok[:, None])
    return blk, slot, ok


@gluon.jit
def _copy_scales(buf, s_ptr, st, blk, slot, kvh, ok):
    """cp.async of an int8 cache's per-token scales (keys from ``_copy_keys``) into ``buf``."""
    cp.async_copy_global_to_shared(buf, s_ptr + blk * st[0] + slot * st[1] + kvh * st[2],
                                   mask=ok)


@gluon.jit
def gluon_prefill_kernel(
    q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, out_ptr,
    sm_scale_log2, num_tokens, num_q_heads, num_blocks, max_blocks,
    stride_qt, stride_qh, stride_qst, stride_qsh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ksb, stride_kst, stride_ksh, stride_btb,
    stride_btn, min_q, max_q, batch, max_tiles,
    GROUP: gl.constexpr, PACK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    COPY_TPW_D: gl.constexpr, LISTED: gl.constexpr,
):
    """INT8 K, 16-bit V. Grid (num_q_heads / PACK, query tiles, batch), or over a list
    (``_work``); num_warps = BLOCK_M // 16."""
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
    b, t0, seq_len, q_start, q_len, idle = _work(
        seq_lens_ptr, qsl_ptr, batch, num_tokens, max_blocks, min_q, max_q, max_tiles,
        TOKENS, PAGE, LISTED)
    if idle:
        return
    kvh = (pid_h * PACK) // GROUP
    ctx = seq_len - q_len  # keys before the first query token
    hi, full = _key_bounds(seq_len, ctx, t0, TOKENS, CAUSAL)
    num_tiles = gl.cdiv(hi, BLOCK_N)
    bt_row_ptr = bt_ptr + b.to(gl.int64) * stride_btb
    k_st = (stride_kb, stride_kt, stride_kh)
    v_st = (stride_vb, stride_vt, stride_vh)
    ks_st = (stride_ksb, stride_kst, stride_ksh)

    k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HEAD_DIM], K_SMEM)
    v_smem = gl.allocate_shared_memory(half, [STAGES, BLOCK_N, HEAD_DIM], V_SMEM)
    ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], S_SMEM)
    for i in gl.static_range(STAGES - 1):  # the first tiles' copies
        blk, slot, ok = _copy_keys(k_smem.index(i), v_smem.index(i), k_ptr, v_ptr, k_st, v_st,
                                   bt_row_ptr, i * BLOCK_N, hi, kvh, num_blocks, stride_btn,
                                   BLOCK_N, HEAD_DIM, PAGE, COPY)
        _copy_scales(ks_smem.index(i), ks_ptr, ks_st, blk, slot, kvh, ok)
        cp.commit_group()

    rows = gl.arange(0, BLOCK_M, gl.SliceLayout(1, COPY))
    q_smem = gl.allocate_shared_memory(
        gl.int8, [BLOCK_M, HEAD_DIM], Q_SMEM,
        _load_q(q_ptr, rows, t0, q_start, q_len, pid_h, stride_qt, stride_qh, PACK, HEAD_DIM,
                COPY))
    row_scale, row_end = _row_constants(qs_ptr, gl.arange(0, BLOCK_M, gl.SliceLayout(1, QK)),
                                        t0, q_start, q_len, seq_len, ctx, pid_h, stride_qst,
                                        stride_qsh, sm_scale_log2, PACK, CAUSAL)
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
        blk, slot, ok = _copy_keys(k_smem.index(buf), v_smem.index(buf), k_ptr, v_ptr, k_st,
                                   v_st, bt_row_ptr, nxt * BLOCK_N, hi, kvh, num_blocks,
                                   stride_btn, BLOCK_N, HEAD_DIM, PAGE, COPY)
        _copy_scales(ks_smem.index(buf), ks_ptr, ks_st, blk, slot, kvh, ok)
        cp.commit_group()
        fence_async_shared()
        # the next tile's Q·K^T runs on the tensor cores during this tile's softmax
        s_next = warpgroup_mma(q_smem, k_smem.index((j + 1) % STAGES).permute((1, 0)), zero_s,
                               use_acc=False, is_async=True)
        cur = j % STAGES
        s = _key_scaled(s_cur, ks_smem.index(cur).load(gl.SliceLayout(0, QK)))
        p, m_i, l_i, alpha = _online(s, m_i, l_i, row_scale, row_end, j * BLOCK_N,
                                     (j + 1) * BLOCK_N <= full, cols)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, PV))[:, None]
        p16 = gl.convert_layout(p.to(half), P_OP)
        acc = warpgroup_mma(p16, v_smem.index(cur), acc, is_async=True)
        s_cur, acc, p16 = warpgroup_mma_wait(0, deps=(s_next, acc, p16))
    cp.wait_group(0)
    _store_rows(out_ptr, acc, l_i, 0, t0, q_start, q_len, num_q_heads, pid_h, PACK, TOKENS,
                HEAD_DIM, PV)


class Launch(NamedTuple):
    """One launch of a Gluon prefill kernel (separate from the launch itself so that a tool
    can compile it offline)."""

    kernel: object
    grid: tuple[int, int, int]
    args: tuple
    options: dict


def _descriptor(cache: torch.Tensor, box_rows: int) -> TensorDescriptor:
    """The cache as a 2D TMA view [rows, token stride] with boxes of ``box_rows`` keys by one
    swizzle span (SWIZZLE bytes, or the whole head where it is narrower; a wider head is
    several boxes)."""
    width = swizzle_bytes(cache) // cache.element_size()
    layout = gl.NVMMASharedLayout(swizzle_byte_width=swizzle_bytes(cache),
                                  element_bitwidth=8 * cache.element_size(), rank=2)
    return TensorDescriptor(cache, [tma_rows(cache), cache.stride(1)], [cache.stride(1), 1],
                            [box_rows, width], layout)


def _q_descriptor(q: torch.Tensor, plan: GluonPlan) -> TensorDescriptor | None:
    """The query as a TMA view [tokens, token stride] with a box per consumer's 64 rows and
    swizzle span, where a tile's rows are consecutive tokens of one head (pack 1) and the
    strides and address allow it; None: the consumers load their rows (a chain of global
    loads and shared stores at every CTA's start, 1.5 µs on the H200's eight 2K prompts)."""
    view = q.unsqueeze(0)  # [1, T, Hq, D]: the token stride is stride(1), as a cache's
    if (not plan.q_tma or plan.pack != 1 or q.data_ptr() % 16
            or view_unsupported("query", view)):
        return None
    return _descriptor(view, WG_ROWS.value)


def _o_descriptor(out: torch.Tensor, plan: GluonPlan, q: torch.Tensor, q_by_tma: bool,
                  call: PagedCall) -> TensorDescriptor | None:
    """The output as a TMA view like the query's, where ``plan.o_tma`` asks for it and the
    kernel has a buffer of the output's type for its rows (``_out_buffer``): the query came
    by TMA (pack 1: a tile's rows are consecutive tokens), and the query is of the output's
    type, or it is int8 and a 16-bit V cache is, with the three V buffers that leave one
    free for each of two consumers; else None (each thread stores its own values)."""
    if not plan.o_tma or not q_by_tma or out.data_ptr() % 16:
        return None
    if q.dtype != out.dtype and (q.dtype != torch.int8 or call.value_scale is not None
                                 or call.value_cache.dtype != out.dtype
                                 or (plan.block_m > WG_ROWS.value and plan.stages < 3)):
        return None
    return _descriptor(out.unsqueeze(0), WG_ROWS.value)


def _strides(t: torch.Tensor | None, n: int) -> tuple[int, ...]:
    """A scale tensor's strides; zeros where the kernel has no such tensor (None)."""
    return t.stride() if t is not None else (0,) * n


def launch_args(call: PagedCall, out: torch.Tensor, plan: GluonPlan, q: torch.Tensor,
                q_scale: torch.Tensor | None, min_query_len: int = 0) -> Launch:
    """The launch of ``call`` under ``plan``; ``q``: the int8 query with its per-(token,
    head) scales ``q_scale`` for an INT8 K cache, else the query itself and None;
    sequences of fewer than ``min_query_len`` query tokens are skipped, and those outside
    the plan's min_q to max_q."""
    g = call.geometry
    kc, vc, ks, vs = call.key_cache, call.value_cache, call.key_scale, call.value_scale
    tiles = tile_grid(call, plan, min_query_len)
    grid = ((g.num_q_heads // plan.pack, tiles.length, 1) if tiles.listed
            else (g.num_q_heads // plan.pack, tiles.per_sequence, g.batch))
    group, head_dim = kernel_heads(call, plan.kv_pairs)
    if plan.kv_pairs:  # (check_plan: 16-bit caches whose heads' rows lie side by side)
        kc, vc = pair_view(kc), pair_view(vc)
    options = dict(
        GROUP=group, PACK=plan.pack, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        HEAD_DIM=head_dim, PAGE=g.block_size, STAGES=plan.stages, CAUSAL=call.causal,
        COPY_TPW_D=min(head_dim // 16, 32), LISTED=tiles.listed, num_warps=plan.num_warps,
    )
    tensors = [q, q_scale, kc, vc, ks]
    strides = [*q.stride()[:2], *_strides(q_scale, 2), *kc.stride()[:3], *vc.stride()[:3],
               *_strides(ks, 3)]
    kernel = gluon_prefill_kernel
    if plan.pipeline == "ws":
        box = min(g.block_size, plan.block_n)
        kernel = ws_prefill_kernel
        q_desc = _q_descriptor(q, plan)
        o_desc = _o_descriptor(out, plan, q, q_desc is not None, call)
        tensors[2:2] = [q_desc, o_desc, _descriptor(kc, box), _descriptor(vc, box)]
        tensors.append(vs)
        strides += _strides(vs, 3)
        consumer_regs, producer_regs = plan.worker_regs
        options.update(CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
                       KV_RINGS=plan.kv_rings, V_LOADER=plan.v_loader,
                       SUM_MMA=plan.sum_mma, LAZY_MAX=plan.lazy_max,
                       OWN_TILES=plan.own_tiles, WG1_WIDENS=plan.wg1_widens,
                       PAIRED_GROUP=g.group if plan.kv_pairs else 0,
                       maxnreg=plan.maxnreg)
    args = (*tensors, call.block_table, call.seq_lens, call.query_start_loc, out,
            call.scale * LOG2E, g.num_tokens, g.num_q_heads, g.num_blocks, g.max_blocks,
            *strides, *call.block_table.stride(), max(min_query_len, plan.min_q), plan.max_q,
            g.batch, tiles.per_sequence)
    return Launch(kernel, grid, args, options)


def prefill_into(call: PagedCall, out: torch.Tensor, plan: GluonPlan | None = None,
                 min_query_len: int = 0, max_query_len: int = 0,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Fill contiguous ``out`` [T, Hq, D] with the attention of ``call`` (a call the
    backend's ``supports`` takes); ``plan`` (one launch) overrides the default launches
    (default_plans). Sequences of fewer than ``min_query_len`` query tokens, or (if not 0)
    more than ``max_query_len``, are skipped (their rows left as they are), for a batch
    whose other rows other launches serve. ``quantized``: the INT8 K query as
    ``quantize_int8`` gives it, where a launch before quantized it."""
    if plan:
        check_plan(call, plan)
        plans = (plan,)
    else:
        plans = checked_default_plans(call)
    if max_query_len:
        plans = tuple(dataclasses.replace(p, max_q=min(p.max_q or max_query_len,
                                                        max_query_len)) for p in plans)
    if not out.is_contiguous() or tuple(out.shape) != tuple(call.query.shape):
        raise ValueError(f"out: must be contiguous {tuple(call.query.shape)}, got shape "
                         f"{tuple(out.shape)} strides {tuple(out.stride())}")
    g = call.geometry
    if g.num_tokens == 0 or g.batch == 0:
        return
    if not call.int8_k:
        q, q_scale = call.query, None
    else:
        q, q_scale = quantized or quantize_int8(call.query)
    for p in plans:
        launch = launch_args(call, out, p, q, q_scale, min_query_len)
        if all(launch.grid):  # a list bound of 0: no sequence has rows for it
            launch.kernel[launch.grid](*launch.args, **launch.options)

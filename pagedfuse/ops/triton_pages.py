"""An INT8 K+V call's pages copied into a compact cache with V dequantized to 16 bits, so
that a long prefill runs on the INT8 K kernel (int8 Q·K^T, 16-bit P·V).

Prefill is bound by the tensor cores and the softmax, not by K/V bytes: with an INT8 V the
"ws" kernel widens every V tile in shared memory and multiplies each weight by its key's V
scale, work its INT8 K kernel does not have. One pass over the call's pages first (K's int8
rows and scales copied, V's rows times their scales in the query's dtype, about 3 bytes
written per byte read) costs a few hundredths of what it saves there
(benchmarks/results/prefill_summary.md, "INT8 K+V through a dequantized copy of V").

The copy holds ``width`` pages per sequence, page j of the sequence in slot s at row
s * width + j of the new caches, and its block table says so; pages past a sequence's keys
are left unwritten (the prefill kernels read no key at or past seq_len). Sequence b has slot
b, or with ``min_query_len`` only sequences of that many query tokens are copied, each into
the slot of its rank among them, a program per slot and page (a mixed batch's long chunks
beside its decode rows, which are not read: their table rows are 0). Block ids are clamped
into the cache as the kernels clamp them, so no table value moves a read outside it. One
launch (and a memset of the table with min_query_len), no host synchronisation: it captures
in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from pagedfuse.ops.call import Geometry, PagedCall, next_power_of_2

ELEMENTS = 8192  # per step of a program: a page (block_size x heads rows of head_dim) in steps


@triton.jit
def _ranked(qsl_ptr, slot, batch, min_q, SCAN: tl.constexpr):
    """The sequence of rank ``slot`` among those of at least min_q query tokens (SCAN: the
    batch or more, one vector), and whether there is one."""
    seq = tl.arange(0, SCAN)
    ok = seq < batch
    q = tl.load(qsl_ptr + seq + 1, mask=ok, other=0) - tl.load(qsl_ptr + seq, mask=ok, other=0)
    copied = ok & (q >= min_q)
    match = copied & (tl.cumsum(copied.to(tl.int32), 0) == slot + 1)
    return tl.sum(tl.where(match, seq, 0)), tl.sum(match.to(tl.int32)) > 0


@triton.jit
def _compact_kernel(table_ptr, seq_lens_ptr, qsl_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, k_out,
                    v_out, ks_out, table_out, width, batch, min_q, num_blocks, stride_tb,
                    stride_tn, k_sb, k_st, k_sh, k_sd, v_sb, v_st, v_sh, v_sd, ks_sb, ks_st,
                    ks_sh, vs_sb, vs_st, vs_sh, PAGE: tl.constexpr, HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                    RANKED: tl.constexpr, SCAN: tl.constexpr):
    """Program (j, slot): page j of the slot's sequence (with RANKED the one of that rank,
    if any; else sequence ``slot``) into row slot * width + j, if the page holds keys."""
    slot = tl.program_id(1)
    j = tl.program_id(0)
    if RANKED:
        b, copied = _ranked(qsl_ptr, slot, batch, min_q, SCAN)
    else:
        b, copied = slot, slot >= 0
    row = slot.to(tl.int64) * width + j
    if copied:
        tl.store(table_out + b.to(tl.int64) * width + j, row.to(tl.int32))
    seq_len = tl.load(seq_lens_ptr + b)
    if copied & (j * PAGE < seq_len):
        blk = tl.load(table_ptr + b.to(tl.int64) * stride_tb + j * stride_tn).to(tl.int64)
        blk = tl.where(blk < 0, blk + num_blocks, blk)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1)
        dims = tl.arange(0, BLOCK_D)
        for r0 in range(0, PAGE * HEADS, ROWS):
            r = r0 + tl.arange(0, ROWS)  # (token, head) rows of the page, token-major
            t, h = r // HEADS, r % HEADS
            live = r < PAGE * HEADS
            mask = live[:, None] & (dims < HEAD_DIM)[None, :]
            k_at = (blk * k_sb + t * k_st + h * k_sh)[:, None] + dims[None, :] * k_sd
            v_at = (blk * v_sb + t * v_st + h * v_sh)[:, None] + dims[None, :] * v_sd
            k = tl.load(k_ptr + k_at, mask=mask)
            v = tl.load(v_ptr + v_at, mask=mask)
            ks = tl.load(ks_ptr + blk * ks_sb + t * ks_st + h * ks_sh, mask=live)
            vs = tl.load(vs_ptr + blk * vs_sb + t * vs_st + h * vs_sh, mask=live)
            at = (row * (PAGE * HEADS) + r)[:, None] * HEAD_DIM + dims[None, :]
            tl.store(k_out + at, k, mask=mask)
            tl.store(v_out + at, (v.to(tl.float32) * vs[:, None]).to(v_out.dtype.element_ty),
                     mask=mask)
            tl.store(ks_out + row * (PAGE * HEADS) + r, ks, mask=live)


@functools.lru_cache(maxsize=256)
def _compact_geometry(geometry: Geometry, width: int, slots: int) -> Geometry:
    """One Geometry per (call signature, width, slots), so that plan caches keyed on it
    hit."""
    return dataclasses.replace(geometry, num_blocks=max(slots * width, 1), max_blocks=width)


def dequantize_v(call: PagedCall, width: int, slots: int, min_query_len: int = 0
                 ) -> PagedCall:
    """``call`` (INT8 K+V) on a compact copy of ``width`` pages per sequence (at least the
    pages its keys fill) in ``slots`` slots, of every sequence or (``min_query_len``) of
    those with that many query tokens (at most ``slots`` of them): an INT8 K call whose V is
    in the query's dtype, with the same queries, lengths and options, for launches that
    read the copied sequences only."""
    if call.kind != "int8_kv":
        raise ValueError(f"call: an INT8 K+V call, got {call.kind}")
    g = call.geometry
    if not min_query_len and slots < g.batch:
        raise ValueError(f"slots: {slots} for {g.batch} sequences, each copied")
    rows = slots * width
    dev = call.query.device
    k = torch.empty((rows, g.block_size, g.num_kv_heads, g.head_dim), dtype=torch.int8,
                    device=dev)
    v = torch.empty(k.shape, dtype=call.query.dtype, device=dev)
    ks = torch.empty(k.shape[:3], dtype=call.key_scale.dtype, device=dev)
    # sequences not copied keep table rows of 0 (a memset; the copy writes the others)
    table = (torch.zeros if min_query_len else torch.empty)((g.batch, width),
                                                             dtype=torch.int32, device=dev)
    if rows:
        block_d = next_power_of_2(g.head_dim)
        per_step = max(1, min(ELEMENTS // block_d,
                              next_power_of_2(g.block_size * g.num_kv_heads)))
        _compact_kernel[(width, slots)](
            call.block_table, call.seq_lens, call.query_start_loc, call.key_cache,
            call.value_cache, call.key_scale, call.value_scale, k, v, ks, table, width, g.batch,
            min_query_len, g.num_blocks, *call.block_table.stride(), *call.key_cache.stride(),
            *call.value_cache.stride(), *call.key_scale.stride(), *call.value_scale.stride(),
            PAGE=g.block_size, HEADS=g.num_kv_heads, HEAD_DIM=g.head_dim, BLOCK_D=block_d,
            ROWS=per_step, RANKED=min_query_len > 0, SCAN=next_power_of_2(g.batch),
            num_warps=4)
    return call._replace(key_cache=k, value_cache=v, key_scale=ks, value_scale=None,
                         block_table=table, geometry=_compact_geometry(g, width, slots))

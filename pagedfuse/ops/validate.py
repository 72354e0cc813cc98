"""Argument checks shared by every implementation of the paged ops.

Two tiers, as docs/design.md has them:
- ``check_metadata`` reads only shapes, dtypes, devices and strides. It is free, always on,
  and also runs inside the fake (meta) implementations, so a bad call fails at trace time.
- ``check_values`` reads tensor *values* (block ids, lengths). It runs eagerly for CPU
  tensors and, for device tensors, only when ``PAGEDFUSE_CHECKS=1`` (it synchronizes).

Every failure is a ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong
content) whose message starts with the argument's name.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pagedfuse import envs
from pagedfuse.ops.backends import registry
from pagedfuse.ops.call import INT8_OP, SOFTCAP_RANGE, Geometry, PagedCall
from pagedfuse.ops.signature_cache import SignatureCache

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
ROW_ALIGN_BYTES = 16
SCALE_ALIGN_BYTES = 4


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, for messages."""
    return str(dtype).removeprefix("torch.")


def value_checks_enabled(device: torch.device) -> bool:
    """Value checks are eager on CPU; elsewhere they sit behind PAGEDFUSE_CHECKS=1."""
    return device.type == "cpu" or envs.PAGEDFUSE_CHECKS


def _static(values: tuple) -> bool:
    """True when every size/stride is a plain int (symbolic ones are left to run time, so a
    trace-time check never adds a guard)."""
    return all(isinstance(v, int) for v in values)


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t


def _rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {tuple(t.shape)}")


def _dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise TypeError(f"{name}: dtype {dtype_name(t.dtype)} not in ({names})")


def _device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but query is on {device}")


def _check_pointer(name: str, t: torch.Tensor, align: int) -> None:
    if t.data_ptr() % align:
        raise ValueError(f"{name}: data pointer is not {align}-byte aligned")


def check_strides(name: str, t: torch.Tensor, fake: bool = False) -> None:
    """Innermost dim contiguous, rows 16-byte aligned, and no two elements sharing memory."""
    if not _static((*t.shape, *t.stride())) or t.numel() == 0:
        return
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: innermost dim must be contiguous (stride 1), "
                         f"got strides {tuple(t.stride())}")
    item = t.element_size()
    for dim in range(t.dim() - 1):
        if t.shape[dim] > 1 and (t.stride(dim) * item) % ROW_ALIGN_BYTES:
            raise ValueError(f"{name}: stride {t.stride(dim)} of dim {dim} is not a multiple "
                             f"of {ROW_ALIGN_BYTES} bytes (rows must be 16-byte aligned)")
    if not fake:
        _check_pointer(name, t, ROW_ALIGN_BYTES)
    extent = 0  # largest offset reachable through the dims already placed
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride <= extent:
            raise ValueError(f"{name}: overlapping strides {tuple(t.stride())} for shape "
                             f"{tuple(t.shape)} (two elements would share memory)")
        extent += stride * (size - 1)


def _check_scale_tensor(name: str, s: torch.Tensor, cache: torch.Tensor, dev: torch.device,
                        fake: bool) -> None:
    _tensor(name, s)
    _rank(name, s, 3, "[num_blocks, block_size, num_kv_heads]")
    _dtype(name, s, (torch.float32,))
    _device(name, s, dev)
    if _static((*s.shape, *cache.shape[:3])) and tuple(s.shape) != tuple(cache.shape[:3]):
        raise ValueError(f"{name}: shape {tuple(s.shape)} must be {tuple(cache.shape[:3])} "
                         "([num_blocks, block_size, num_kv_heads] of the cache)")
    if not fake and s.numel():
        _check_pointer(name, s, SCALE_ALIGN_BYTES)


def check_quantize_input(x: torch.Tensor) -> None:
    """quantize_int8's argument: a float tensor with a last dim to quantize over."""
    _tensor("x", x)
    _dtype("x", x, FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError("x: needs at least one dim (rows are quantized over the last dim)")


class _Verdict(NamedTuple):
    """A cached check_metadata verdict: the geometry, and per pointer-checked argument
    (query, key_cache, value_cache, key_scale, value_scale) the low bits its data pointer
    must not have (0: absent or empty, not checked); whether seq_lens and query_start_loc
    are dense already (else each call takes contiguous copies)."""

    geometry: Geometry
    masks: tuple[int, int, int, int, int]
    dense_index: bool


_POINTERS = (("query", ROW_ALIGN_BYTES), ("key_cache", ROW_ALIGN_BYTES),
             ("value_cache", ROW_ALIGN_BYTES), ("key_scale", SCALE_ALIGN_BYTES),
             ("value_scale", SCALE_ALIGN_BYTES))
# Verdicts of past calls by call signature. Bounded, since every distinct signature (e.g.
# each batch size) adds one.
_VERDICTS: SignatureCache[tuple, _Verdict] = SignatureCache()


def pointer_masks(call: PagedCall) -> tuple[int, int, int, int, int]:
    """Per pointer-checked argument of ``call`` (in _POINTERS' order) the low bits its data
    pointer must not have: 0 where absent or empty (not checked). The verdict cache and the
    C++ host path (library.py) check a repeated signature's pointers with these."""
    return _pointer_masks((call.query, call.key_cache, call.value_cache, call.key_scale,
                           call.value_scale))


def _pointer_masks(tensors: tuple) -> tuple[int, int, int, int, int]:
    return tuple(0 if t is None or not t.numel() else align - 1
                 for t, (_, align) in zip(tensors, _POINTERS, strict=True))


def _check_pointers(masks: tuple[int, ...], tensors: tuple) -> None:
    """Raise for the first of ``tensors`` (in _POINTERS' order) whose data pointer has bits
    of its mask set."""
    for (name, align), mask, t in zip(_POINTERS, masks, tensors, strict=True):
        if mask and t.data_ptr() & mask:
            raise ValueError(f"{name}: data pointer is not {align}-byte aligned")


def check_metadata(
    op: str,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    attn_bias: torch.Tensor | None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    fake: bool = False,
    capability: bool = True,
    window_left: int | None = None,
    softcap: float | None = None,
) -> Geometry:
    """Shape/dtype/device/stride checks for ``op``, and of its scalars; returns the geometry.
    ``capability``: also require a kernel backend for the head_dim on the query's device.
    Cheap on a repeated signature (see build_call)."""
    return build_call(op, query, key_cache, value_cache, key_scale, value_scale, block_table,
                      seq_lens, query_start_loc, scale, False, attn_bias, fake=fake,
                      capability=capability, window_left=window_left,
                      softcap=softcap).geometry


_new_call = tuple.__new__  # PagedCall's fields in order, without its Python-level __new__


def build_call(op: str, query: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, key_scale: torch.Tensor | None,
               value_scale: torch.Tensor | None, block_table: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
               causal: bool, attn_bias: torch.Tensor | None = None,
               max_seq_len: int | None = None, max_query_len: int | None = None,
               fake: bool = False, capability: bool = True, window_left: int | None = None,
               softcap: float | None = None) -> PagedCall:
    """check_metadata's checks, then the PagedCall the kernel backends receive (arguments in
    its field order).

    The op's path, so cheap on a repeated signature: the verdict is cached per call
    signature, and such a call only has its data pointers checked. The signature is what
    the checks depend on, except data pointers: every tensor's shape, strides, dtype and
    device, the scalars, and the registry's generation (it stands for the head dims the
    backends serve); spelled out rather than a loop, as every eager call builds it. The
    scalars are part of it, so the one Geometry per signature also tells apart calls a
    backend may take or decline by them (the caches of the backend choice and of launch
    plans are keyed on the Geometry)."""
    key = verdict = None
    if not fake and capability:
        try:
            key = (op, scale, window_left, softcap, registry.generation,
                   query.shape, query.stride(), query.dtype, query.device,
                   key_cache.shape, key_cache.stride(), key_cache.dtype, key_cache.device,
                   value_cache.shape, value_cache.stride(), value_cache.dtype,
                   value_cache.device,
                   block_table.shape, block_table.stride(), block_table.dtype,
                   block_table.device,
                   seq_lens.shape, seq_lens.stride(), seq_lens.dtype, seq_lens.device,
                   query_start_loc.shape, query_start_loc.stride(), query_start_loc.dtype,
                   query_start_loc.device,
                   None if key_scale is None else
                   (key_scale.shape, key_scale.stride(), key_scale.dtype, key_scale.device),
                   None if value_scale is None else
                   (value_scale.shape, value_scale.stride(), value_scale.dtype,
                    value_scale.device),
                   None if attn_bias is None else
                   (attn_bias.shape, attn_bias.stride(), attn_bias.dtype, attn_bias.device))
            verdict = _VERDICTS.get(key)
        except (AttributeError, TypeError):  # not a tensor (the checks below say which), or
            key = None                       # unhashable sizes (not plain ints)
    if verdict is not None:
        dense = verdict.dense_index
        m = verdict.masks
        if (query.data_ptr() & m[0] or key_cache.data_ptr() & m[1]
                or value_cache.data_ptr() & m[2] or m[3] and key_scale.data_ptr() & m[3]
                or m[4] and value_scale.data_ptr() & m[4]):
            _check_pointers(m, (query, key_cache, value_cache, key_scale, value_scale))
        geometry = verdict.geometry
    else:
        geometry = _check_metadata(op, query, key_cache, value_cache, block_table, seq_lens,
                                   query_start_loc, scale, attn_bias, key_scale, value_scale,
                                   fake, capability)
        check_options(window_left, softcap)
        dense = fake or (_dense(seq_lens) and _dense(query_start_loc))
        if key is not None:
            _VERDICTS.put(key, _Verdict(geometry, _pointer_masks(
                (query, key_cache, value_cache, key_scale, value_scale)), dense))
    if not dense:  # the kernels index them as plain arrays
        seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    return _new_call(PagedCall, (op, query, key_cache, value_cache, key_scale, value_scale,
                                 block_table, seq_lens, query_start_loc, scale, causal,
                                 attn_bias, max_seq_len, max_query_len, geometry, window_left,
                                 softcap))


def _dense(index: torch.Tensor) -> bool:
    """A 1-D index tensor whose entries are adjacent in memory."""
    return index.shape[0] <= 1 or index.stride(0) == 1


def check_options(window_left: object, softcap: object) -> None:
    """The optional semantics: ``window_left`` None or an int >= 1 (the keys a query reaches
    back, itself included), ``softcap`` None or a float in SOFTCAP_RANGE (every kernel
    computes the cap in float32). Traced values (SymInt, SymFloat) are checked when the op
    runs."""
    if window_left is not None and not isinstance(window_left, torch.SymInt) and (
            isinstance(window_left, bool) or not isinstance(window_left, int)
            or window_left < 1):
        raise ValueError(f"window_left: must be None or an int >= 1 (the keys a query sees, "
                         f"itself included), got {window_left!r}")
    if softcap is not None and not isinstance(softcap, torch.SymFloat) and (
            isinstance(softcap, bool) or not isinstance(softcap, (int, float))
            or not SOFTCAP_RANGE[0] <= softcap <= SOFTCAP_RANGE[1]):
        raise ValueError(f"softcap: must be None or a float in [2^-100, 2^100] (scores become "
                         f"softcap * tanh(score / softcap), in float32), got {softcap!r}")


def _check_metadata(op: str, query: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    attn_bias: torch.Tensor | None, key_scale: torch.Tensor | None,
                    value_scale: torch.Tensor | None, fake: bool,
                    capability: bool) -> Geometry:
    int8 = op == INT8_OP
    _tensor("query", query)
    _tensor("key_cache", key_cache)
    _tensor("value_cache", value_cache)
    _tensor("block_table", block_table)
    _tensor("seq_lens", seq_lens)
    _tensor("query_start_loc", query_start_loc)
    _rank("query", query, 3, "[num_tokens, num_q_heads, head_dim]")
    _rank("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    _rank("value_cache", value_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    _rank("block_table", block_table, 2, "[batch, max_blocks]")
    _rank("seq_lens", seq_lens, 1, "[batch]")
    _rank("query_start_loc", query_start_loc, 1, "[batch + 1]")

    _dtype("query", query, FLOAT_DTYPES)
    if int8:
        _dtype("key_cache", key_cache, (torch.int8,))
        if value_cache.dtype == torch.int8:
            if value_scale is None:
                raise ValueError("value_scale: required when value_cache is int8")
        else:
            _dtype("value_cache", value_cache, (query.dtype, torch.int8))
            if value_scale is not None:
                raise ValueError("value_scale: must be None when value_cache is "
                                 f"{dtype_name(value_cache.dtype)}")
    else:
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            if cache.dtype != query.dtype:
                raise TypeError(f"{name}: dtype {dtype_name(cache.dtype)} must match query's "
                                f"{dtype_name(query.dtype)}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        _dtype(name, t, INDEX_DTYPES)

    dev = query.device
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        _device(name, t, dev)

    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, k_dim = key_cache.shape
    if _static((*value_cache.shape, *key_cache.shape)) and \
            tuple(value_cache.shape) != tuple(key_cache.shape):
        raise ValueError(f"value_cache: shape {tuple(value_cache.shape)} must equal key_cache's "
                         f"{tuple(key_cache.shape)}")
    if _static((k_dim, head_dim)) and k_dim != head_dim:
        raise ValueError(f"key_cache: head_dim {k_dim} must equal query's head_dim {head_dim}")
    if _static((block_size,)) and block_size < 1:
        raise ValueError(f"key_cache: block_size must be >= 1, got {block_size}")
    if _static((num_blocks, num_tokens)) and num_blocks < 1 and num_tokens > 0:
        # every query token is one of its sequence's keys, so it needs a block; and the GPU
        # kernels, which clamp block ids into the cache instead of checking them, need one
        raise ValueError("key_cache: no blocks, but there are query tokens")
    if _static((num_q_heads, num_kv_heads)) and (num_kv_heads < 1 or num_q_heads % num_kv_heads):
        raise ValueError(f"query: num_q_heads {num_q_heads} is not a multiple of key_cache's "
                         f"num_kv_heads {num_kv_heads} (GQA needs Hq % Hkv == 0)")
    reason = capability and _static((head_dim,)) and \
        registry.head_dim_reason(op, dev.type, head_dim)
    if reason:
        raise ValueError(f"query: {reason}")
    batch, max_blocks = block_table.shape
    if _static((batch, num_tokens)) and batch == 0 and num_tokens > 0:
        raise ValueError(f"query: {num_tokens} query tokens, but batch is 0 (block_table has "
                         "no rows, so there is no sequence for them)")
    if _static((batch, seq_lens.shape[0])) and seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens: length {seq_lens.shape[0]} must equal block_table's "
                         f"batch {batch}")
    if _static((batch, query_start_loc.shape[0])) and query_start_loc.shape[0] != batch + 1:
        raise ValueError(f"query_start_loc: length {query_start_loc.shape[0]} must be batch + 1 "
                         f"= {batch + 1}")
    if isinstance(scale, torch.SymFloat):
        pass  # a traced value (e.g. from .item()): checked when the op runs
    elif not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: must be a finite float, got {scale!r}")

    check_strides("query", query, fake)
    check_strides("key_cache", key_cache, fake)
    check_strides("value_cache", value_cache, fake)
    if int8:
        if key_scale is None:
            raise ValueError("key_scale: required by paged_attention_int8")
        _check_scale_tensor("key_scale", key_scale, key_cache, dev, fake)
        if value_scale is not None:
            _check_scale_tensor("value_scale", value_scale, value_cache, dev, fake)

    if attn_bias is not None:
        _tensor("attn_bias", attn_bias)
        _dtype("attn_bias", attn_bias, (torch.bool, *FLOAT_DTYPES))
        _device("attn_bias", attn_bias, dev)
        if attn_bias.dim() > 4 or attn_bias.dim() < 2:
            raise ValueError("attn_bias: must have 2 to 4 dims broadcastable to "
                             f"[batch, num_q_heads, max_q_len, max_seq_len], got "
                             f"shape {tuple(attn_bias.shape)}")
        lead = (1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape)
        if _static((*lead[:2], batch, num_q_heads)) and (
                lead[0] not in (1, batch) or lead[1] not in (1, num_q_heads)):
            raise ValueError(f"attn_bias: shape {tuple(attn_bias.shape)} does not broadcast to "
                             f"[batch={batch}, num_q_heads={num_q_heads}, max_q_len, max_seq_len]")
    return Geometry(num_tokens, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size,
                    batch, max_blocks)


# Tables up to this many entries in the columns some sequence uses have their span taken in
# Python (a few µs at B=1, where the torch ops below cost about 10); larger ones by torch.
_LISTED_BLOCKS = 256


def _blocks_in_use_span(geo: Geometry, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        lens: list[int], longest: int) -> tuple[int, int]:
    """The least and greatest block id in use (block j of sequence b when j * block_size <
    lens[b]), for a table with some block in use."""
    widest = -(-longest // geo.block_size)
    if geo.batch * widest <= _LISTED_BLOCKS:
        rows = block_table[:, :widest].tolist()
        spans = [row[:-(-n // geo.block_size)] for row, n in zip(rows, lens, strict=True)
                 if n > 0]
        return min(map(min, spans)), max(map(max, spans))
    table = block_table[:, :widest].cpu()
    in_use = torch.arange(0, widest * geo.block_size, geo.block_size) < seq_lens.cpu()[:, None]
    first = next(b for b, n in enumerate(lens) if n > 0)
    # blocks not in use read as one that is (a where is faster than a boolean index)
    lo, hi = torch.where(in_use, table, table[first, 0]).aminmax()
    return int(lo), int(hi)


def check_values(
    geo: Geometry,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    attn_bias: torch.Tensor | None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
) -> None:
    """Checks of tensor values, vectorised (a min/max, not a Python loop).

    What stays legal, as eager indexing and SDPA have it: a sequence with more query tokens
    than keys (its early rows read fewer keys, or none), and block ids in [-num_blocks, 0),
    which wrap like ``cache[block_table]``.
    """
    # The per-sequence values as Python ints: a handful of them, each torch op on them would
    # cost more than the list (this runs on every eager CPU call).
    starts = query_start_loc.tolist()
    if starts[0] != 0:
        raise ValueError(f"query_start_loc: must start at 0, got {starts[0]}")
    if geo.batch == 0:
        return  # check_metadata has seen that there are no query tokens either
    lens = seq_lens.tolist()
    shortest, longest = min(lens), max(lens)
    if shortest < 0:
        raise ValueError(f"seq_lens: entries must be >= 0, got min {shortest}")
    capacity = geo.max_blocks * geo.block_size
    if longest > capacity:
        raise ValueError(f"seq_lens: max {longest} exceeds the block table's capacity "
                         f"{geo.max_blocks} blocks x {geo.block_size} = {capacity}")
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    if min(q_lens) < 0:
        raise ValueError("query_start_loc: must be non-decreasing")
    if starts[-1] != geo.num_tokens:
        raise ValueError(f"query_start_loc: last entry {starts[-1]} must equal query's "
                         f"num_tokens {geo.num_tokens}")
    if longest > 0:  # some block is in use: block j of sequence b when j * block_size < len
        lo, hi = _blocks_in_use_span(geo, block_table, seq_lens, lens, longest)
        if lo < -geo.num_blocks or hi >= geo.num_blocks:
            raise ValueError(f"block_table: entries in use span [{lo}, {hi}], outside "
                             f"[-{geo.num_blocks}, {geo.num_blocks}) (the cache's "
                             f"{geo.num_blocks} blocks; negative ids wrap)")
    longest_q = max(q_lens)
    if max_seq_len is not None and max_seq_len < longest:
        raise ValueError(f"max_seq_len: hint {max_seq_len} < longest sequence {longest}")
    if max_query_len is not None and max_query_len < longest_q:
        raise ValueError(f"max_query_len: hint {max_query_len} < longest query {longest_q}")
    if attn_bias is not None:
        rows, cols = attn_bias.shape[-2], attn_bias.shape[-1]
        if rows != 1 and rows < longest_q:
            raise ValueError(f"attn_bias: {rows} query rows, but a sequence has {longest_q} "
                             "query tokens")
        if cols != 1 and cols < longest:
            raise ValueError(f"attn_bias: {cols} key columns, but a sequence has {longest} keys")

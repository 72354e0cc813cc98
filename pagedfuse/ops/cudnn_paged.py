"""cuDNN's paged SDPA (``nvidia-cudnn-frontend``, Python module ``cudnn``) for the float op:
the host side of the ``cudnn_prefill`` backend.

cuDNN reads this project's caches in place: a cache ``[num_blocks, page, Hkv, D]`` (NHD, or
HND passed as its transposed view) is cuDNN's page container ``[num_blocks, Hkv, page, D]``
with the cache's own strides, and the block table is its page table. The packed queries and
the output are cuDNN's ragged (THD) tensors: dims ``[B, Hq, S_q, D]`` with token-major
strides and per-sequence element offsets ``query_start_loc * Hq * D``. ``seq_lens`` and the
query lengths are device tensors under cuDNN's padding mask, so one graph serves every batch
of its bucket; causal is cuDNN's bottom-right diagonal band (right bound 0), which with the
padding mask aligns each sequence's diagonal to its own lengths, as the op does.

A cuDNN graph is fixed to its dims, so each call maps to a bucket (``GraphKey``): the batch,
the query bound and the table width rounded up to powers of two, with the cache's shape and
strides, the dtype, ``causal`` and ``scale``. Each bucket's graph is built once (cuDNN
heuristics, then the plan) and cached; a call pads its metadata to the bucket on the device
(padded sequences have no queries and no keys). Nothing reads a tensor value on the host, so
a call captures in a CUDA graph, once its bucket was built outside the capture. The cuDNN
handle is bound to torch's current stream at every call: a capture records only the work
launched on the capturing stream.

Unchecked values stay inside the tensors, as in the other kernels: block ids are taken modulo
``num_blocks`` ([-num_blocks, 0) wraps as ``cache[block_table]`` does), key lengths are
clamped to what the table addresses and query offsets to the packed query.

Rows that read no key (a sequence with no keys, or under causal a query token before the
sequence's first key) are zeros by the op's contract; cuDNN leaves those of a sequence with
no keys unwritten (H200, cuDNN 9.19), so a small Triton kernel writes them after cuDNN,
touching only those rows.

One difference from the op's contract remains (docs/library-kernels.md): cuDNN's key tiles
load V past seq_len (the last page's tail, and pages reached through table entries past the
sequence's last page) and after a row's causal position with weight 0, so a NaN or Inf there
reaches the row.
"""

from __future__ import annotations

import functools
import importlib
from collections import OrderedDict
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from pagedfuse.ops.call import PagedCall, next_power_of_2
from pagedfuse.ops.prefill_plan import NO_CUDA, capability

Tensor = torch.Tensor

MIN_BACKEND = 90700  # paged caches with ragged (THD) queries
INT32_MAX = 2**31 - 1
_GRAPH_LIMIT = 64  # built graphs kept (least recently used first out)
_ZERO_SPLIT = 4  # programs per sequence writing its rows without keys
_DTYPES = {torch.bfloat16: "BFLOAT16", torch.float16: "HALF"}


class Uid:
    """The graph's tensor uids, so the variant pack is built without name lookups."""

    Q, K, V, OUT, Q_OFF, O_OFF, TABLE_K, TABLE_V, SEQ_Q, SEQ_KV = range(1, 11)


@functools.cache
def cudnn_module() -> Any:
    """The ``cudnn`` module, or the ImportError that explains why not (raised)."""
    return importlib.import_module("cudnn")


@functools.cache
def _import_reason() -> str | None:
    try:
        cudnn = cudnn_module()
        version = cudnn.backend_version()
    except Exception as exc:  # ImportError, or a library that does not load
        return f"nvidia-cudnn-frontend unusable: {type(exc).__name__}: {exc}"
    if version < MIN_BACKEND:
        return f"cuDNN {version} < {MIN_BACKEND}: paged caches with ragged queries need 9.7"
    return None


def unsupported(call: PagedCall) -> str | None:
    """Why cuDNN cannot compute ``call`` exactly as the op defines it (None: it can). Reads
    shapes, dtypes, the device and the hints only."""
    if call.attn_bias is not None:
        return "attn_bias: cuDNN's bottom-right causal band takes no bias"
    if call.query.dtype not in _DTYPES:
        return f"query dtype {call.query.dtype}: cuDNN's SDPA takes bf16 or fp16"
    if not call.scale > 0:
        return f"scale {call.scale}: only positive softmax scales are checked against cuDNN"
    g = call.geometry
    sizes = (g.num_tokens, g.batch, g.max_blocks, g.num_blocks, call.query_bound,
             call.context_bound)
    if not all(isinstance(s, int) for s in sizes):
        return "sizes are dynamic (cuDNN graphs are built per size bucket)"
    if call.decode:
        return "at most one query token per sequence: a decode call"
    if (g.num_tokens + 1) * g.num_q_heads * g.head_dim > INT32_MAX:
        return "more query elements than int32 ragged offsets address"
    if call.device.type != "cuda":
        return f"device {call.device.type}: cuDNN runs on CUDA"
    if (cap := capability(call.device)) is None:
        return NO_CUDA
    if cap < (9, 0):
        return "needs compute capability 9.0 (ragged queries with paged caches)"
    return _import_reason()


class GraphKey(NamedTuple):
    """What a cuDNN graph is fixed to. ``batch``, ``query_rows`` (S_q) and ``pages`` (the
    page table's width) are power-of-two buckets of the call's sizes."""

    device: int
    dtype: torch.dtype
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    page: int
    key_strides: tuple[int, int, int]
    value_strides: tuple[int, int, int]
    batch: int
    query_rows: int
    pages: int
    causal: bool
    scale: float


def graph_key(call: PagedCall) -> GraphKey:
    g = call.geometry
    pages = next_power_of_2(-(-call.context_bound // g.block_size))
    return GraphKey(
        call.device.index or 0, call.query.dtype, g.num_q_heads, g.num_kv_heads, g.head_dim,
        g.num_blocks, g.block_size, tuple(call.key_cache.stride()[:3]),
        tuple(call.value_cache.stride()[:3]), next_power_of_2(g.batch),
        next_power_of_2(min(call.query_bound, g.num_tokens)), max(pages, 1), call.causal,
        call.scale)


class BuiltGraph(NamedTuple):
    graph: Any
    workspace: int  # bytes


_GRAPHS: OrderedDict[GraphKey, BuiltGraph] = OrderedDict()
_HANDLES: dict[int, Any] = {}
builds = 0  # graphs built in this process (tests and benchmarks read it)


def _handle(device: int) -> Any:
    handle = _HANDLES.get(device)
    if handle is None:
        with torch.cuda.device(device):
            handle = _HANDLES[device] = cudnn_module().create_handle()
    return handle


def _container(g: Any, key: GraphKey, strides: tuple[int, int, int], uid: int,
               name: str) -> Any:
    """A cache as cuDNN's page container [num_blocks, Hkv, page, D]: the cache's strides
    (block, token, head) reordered to (block, head, token)."""
    block, token, head = strides
    return g.tensor(dim=[key.num_blocks, key.num_kv_heads, key.page, key.head_dim],
                    stride=[block, head, token, 1], uid=uid, name=name)


def build_graph(key: GraphKey) -> BuiltGraph:
    """Build (cuDNN heuristics, then one plan) the graph of ``key``; not during a capture."""
    global builds
    cudnn = cudnn_module()
    handle = _handle(key.device)
    io = getattr(cudnn.data_type, _DTYPES[key.dtype])
    i32 = cudnn.data_type.INT32
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle,
                      name="pagedfuse_paged_sdpa")
    b, hq, rows, d = key.batch, key.num_q_heads, key.query_rows, key.head_dim
    token_major = [rows * hq * d, d, hq * d, 1]

    def index(dim: list[int], uid: int, name: str) -> Any:  # int32, row-major
        return g.tensor(dim=dim, data_type=i32, uid=uid, name=name)

    q_off = index([b + 1, 1, 1, 1], Uid.Q_OFF, "q_off")
    o_off = index([b + 1, 1, 1, 1], Uid.O_OFF, "o_off")
    q = g.tensor(dim=[b, hq, rows, d], stride=token_major, ragged_offset=q_off, uid=Uid.Q,
                 name="q")
    k = _container(g, key, key.key_strides, Uid.K, "k")
    v = _container(g, key, key.value_strides, Uid.V, "v")
    table_k = index([b, 1, key.pages, 1], Uid.TABLE_K, "table_k")
    table_v = index([b, 1, key.pages, 1], Uid.TABLE_V, "table_v")
    seq_q = index([b, 1, 1, 1], Uid.SEQ_Q, "seq_q")
    seq_kv = index([b, 1, 1, 1], Uid.SEQ_KV, "seq_kv")
    masks: dict[str, Any] = {}
    if key.causal:
        masks = dict(diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                     diagonal_band_right_bound=0)
    o, _ = g.sdpa(q=q, k=k, v=v, attn_scale=key.scale, generate_stats=False,
                  use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv,
                  paged_attention_k_table=table_k, paged_attention_v_table=table_v,
                  paged_attention_max_seq_len_kv=key.pages * key.page, name="sdpa", **masks)
    o.set_output(True).set_dim([b, hq, rows, d]).set_stride(token_major).set_data_type(io)
    o.set_ragged_offset(o_off).set_uid(Uid.OUT)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    builds += 1
    return BuiltGraph(g, g.get_workspace_size())


def graph_for(key: GraphKey) -> BuiltGraph:
    """The built graph of ``key`` (built on first use, least recently used dropped)."""
    built = _GRAPHS.get(key)
    if built is None:
        built = build_graph(key)
        if len(_GRAPHS) >= _GRAPH_LIMIT:
            _GRAPHS.popitem(last=False)
        _GRAPHS[key] = built
    else:
        _GRAPHS.move_to_end(key)
    return built


def metadata(call: PagedCall, key: GraphKey) -> dict[int, Tensor]:
    """The call's index tensors padded to its bucket (int32, on the device): ragged element
    offsets, query and key lengths, and the page table with ids reduced into the cache."""
    g, dev = call.geometry, call.device
    b, rows = g.batch, g.num_q_heads * g.head_dim
    starts = call.query_start_loc.clamp(0, g.num_tokens).to(torch.int32)
    offsets = torch.full((key.batch + 1,), g.num_tokens * rows, dtype=torch.int32, device=dev)
    offsets[: b + 1] = starts * rows
    lens = torch.zeros(2, max(key.batch, 4), dtype=torch.int32, device=dev)  # rows 16B-aligned
    lens[0, :b] = (starts[1:] - starts[:-1]).clamp_(min=0)
    readable = min(key.pages, g.max_blocks) * g.block_size  # what the table addresses
    lens[1, :b] = call.seq_lens.clamp(0, readable)
    table = torch.zeros(key.batch, key.pages, dtype=torch.int32, device=dev)
    width = min(key.pages, g.max_blocks)
    table[:b, :width] = call.block_table[:, :width].remainder(g.num_blocks)
    return {Uid.Q_OFF: offsets, Uid.O_OFF: offsets, Uid.SEQ_Q: lens[0, : key.batch],
            Uid.SEQ_KV: lens[1, : key.batch], Uid.TABLE_K: table, Uid.TABLE_V: table}


@triton.jit
def _zero_rows_without_keys(out_ptr, seq_lens_ptr, starts_ptr, num_tokens, row_elems,
                            CAUSAL: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr):
    """Program (b, p): zeros in the rows of sequence b that read no key, every SPLIT-th
    block of them from p on. Under causal those are its first
    max(0, q - L) query tokens (all of them when L == 0); without causal, all when L == 0."""
    b = tl.program_id(0)
    start = tl.minimum(tl.maximum(tl.load(starts_ptr + b).to(tl.int64), 0), num_tokens)
    end = tl.minimum(tl.maximum(tl.load(starts_ptr + b + 1).to(tl.int64), start), num_tokens)
    length = tl.load(seq_lens_ptr + b).to(tl.int64)
    queries = end - start
    if CAUSAL:
        dead = tl.minimum(tl.maximum(queries - tl.maximum(length, 0), 0), queries)
    else:
        dead = tl.where(length <= 0, queries, 0)
    chunks = tl.cdiv(row_elems, BLOCK)
    offs = tl.arange(0, BLOCK)
    zeros = tl.zeros([BLOCK], dtype=out_ptr.dtype.element_ty)
    for i in range(tl.program_id(1), dead * chunks, SPLIT):
        col = (i % chunks) * BLOCK + offs
        tl.store(out_ptr + (start + i // chunks) * row_elems + col, zeros, mask=col < row_elems)


def zero_rows_without_keys(call: PagedCall, out: Tensor) -> None:
    g = call.geometry
    row = g.num_q_heads * g.head_dim
    _zero_rows_without_keys[(g.batch, _ZERO_SPLIT)](
        out, call.seq_lens, call.query_start_loc, g.num_tokens, row, CAUSAL=call.causal,
        BLOCK=min(4096, next_power_of_2(row)), SPLIT=_ZERO_SPLIT)


def paged_sdpa_into(call: PagedCall, out: Tensor, plan: object = None) -> None:
    """Fill the contiguous ``out`` [T, Hq, D] (``plan``: unused, cuDNN's heuristics choose)."""
    key = graph_key(call)
    handle = _handle(key.device)
    # The handle launches on its own stream: bind it to torch's current one (a capture's)
    # before anything, building included, runs on it.
    cudnn_module().set_stream(handle, torch.cuda.current_stream(call.device).cuda_stream)
    with torch.cuda.device(call.device):
        built = graph_for(key)
    query = call.query
    if not query.is_contiguous() or query.data_ptr() % 16:
        query = query.clone(memory_format=torch.contiguous_format)  # fresh, so aligned
    buffers = metadata(call, key)
    buffers.update({Uid.Q: query, Uid.K: call.key_cache, Uid.V: call.value_cache, Uid.OUT: out})
    workspace = torch.empty(max(built.workspace, 1), dtype=torch.uint8, device=call.device)
    # Bare addresses: the graph's declarations say what the bytes are (the caches as page
    # containers, the packed query as ragged [B, Hq, S_q, D]); every buffer lives until
    # this returns, and the caching allocator orders its reuse on this stream.
    built.graph.execute({uid: t.data_ptr() for uid, t in buffers.items()}, workspace.data_ptr(),
                        handle=handle)
    zero_rows_without_keys(call, out)

"""Build the replacement for a PagedSite: pack the query, call the op, unpack its output.

Sizes come from ``size`` nodes where they are dynamic, so the new nodes never specialise a
dim; caches are handed to the op as views (an HND cache transposed, a flat slot cache with a
block_size-1 dim), never copied. Where SDPA's semantics go beyond the op's arguments, the
replacement says the same thing in the op's terms: a K/V batch of 1 broadcast over the
queries is an expanded table, a length mask over fewer keys than its lengths is clamped, a
row an explicit attention's mask hides entirely is NaN in the output (its softmax is NaN).
The op goes in right before the anchor (the SDPA call, or the explicit spelling's last
matmul), where eager reads K/V last.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from pagedfuse.graph.layout import same_size, static_int
from pagedfuse.graph.ops import fake
from pagedfuse.patterns.base import Match
from pagedfuse.patterns.paged_sdpa.kv_trace import SourceView
from pagedfuse.patterns.paged_sdpa.site import MASK_BIAS, TOP_LEFT_CAUSAL, PagedSite


def _size(graph: fx.Graph, node: fx.Node, dim: int) -> int | fx.Node:
    size = fake(node).shape[dim]
    return size if isinstance(size, int) else graph.call_method("size", (node, dim))


def _arith(graph: fx.Graph, op: Callable[[object, object], object], a: int | fx.Node,
           b: int | fx.Node) -> int | fx.Node:
    """``op(a, b)`` now when both are ints, else as a graph node (a dynamic size)."""
    both_int = isinstance(a, int) and isinstance(b, int)
    return op(a, b) if both_int else graph.call_function(op, (a, b))


def _op_view(graph: fx.Graph, source: fx.Node, view: SourceView) -> fx.Node:
    if view.op_view is None:
        return source
    method, args = view.op_view
    return graph.call_method(method, (source, *args))


def _block_table(graph: fx.Graph, site: PagedSite) -> tuple[fx.Node, int | fx.Node,
                                                               int | fx.Node]:
    """(block table [B, M], B, keys per sequence M * block_size), B the query batch."""
    table = site.index
    gather = site.key.trace.gather
    if gather.patched:  # the op reads the patched copy's rows in order
        blocks = _size(graph, gather.source, 0)
        table = graph.call_function(torch.arange, (blocks,),
                                    {"dtype": torch.int32, "device": site.q_fake.device})
        table = graph.call_method("unsqueeze", (table, 0))
    elif fake(table).dim() == 2:
        blocks = _size(graph, table, 1)
    else:  # per-token slots of one packed sequence
        blocks = _size(graph, table, 0)
        table = graph.call_method("unsqueeze", (table, 0))
    batch = _size(graph, site.query, 0)
    if not same_size(site.q_fake.shape[0], site.size("batch")):  # one K/V row broadcast
        table = graph.call_method("expand", (table, batch, blocks))
    return table, batch, _arith(graph, operator.mul, blocks, site.size("slot"))


def _masking(graph: fx.Graph, site: PagedSite, batch: int | fx.Node, keys: int | fx.Node,
             q_len: int | fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """(seq_lens, attn_bias) expressing the site's masking (its causal and window_left go
    to the op as they are)."""
    device = site.q_fake.device
    masking = site.masking
    if masking.seq_lens is not None:  # the mask keeps j < len for the gathered keys j only
        seq_lens = graph.call_method("clamp", (masking.seq_lens, 0, keys))
    else:
        seq_lens = graph.call_function(torch.full, ((batch,), keys),
                                       {"dtype": torch.int32, "device": device})
    if masking.bias == TOP_LEFT_CAUSAL:  # SDPA's top-left causal: query i sees keys j <= i
        ones = graph.call_function(torch.ones, ((q_len, keys),),
                                   {"dtype": torch.bool, "device": device})
        return seq_lens, graph.call_method("tril", (ones,))
    return seq_lens, site.mask if masking.bias == MASK_BIAS else None


def _nan_rows(graph: fx.Graph, site: PagedSite, out: fx.Node) -> fx.Node:
    """``out`` with NaN on the rows whose every key the mask hides (-inf throughout), as the
    explicit softmax gives them; the op gives them zeros."""
    row_max = graph.call_method("amax", (site.mask, -1), {"keepdim": True})
    hidden = graph.call_function(operator.eq, (row_max, -math.inf))
    return graph.call_function(torch.where, (hidden, math.nan, out))


def _caches(graph: fx.Graph, site: PagedSite) -> tuple:
    """(key_cache, value_cache) or, for int8, (key_cache, value_cache, key_scale, value_scale):
    the op's views of the user's buffers."""
    key = _op_view(graph, site.key.trace.gather.source, site.key.view)
    value = _op_view(graph, site.value.trace.gather.source, site.value.view)
    if not site.int8:
        return key, value
    v_scale = site.value.trace.scale
    return (key, value,
            _op_view(graph, site.key.trace.scale.gather.source, site.key.scale_view),
            v_scale and _op_view(graph, v_scale.gather.source, site.value.scale_view))


def replace_paged_sdpa(graph: fx.Graph, match: Match) -> fx.Node:
    """Insert the op call before the SDPA node; return the node standing in for its output."""
    site: PagedSite = match.facts
    q = site.query
    with graph.inserting_before(site.anchor):
        q_bqhd = graph.call_method("transpose", (q, 1, 2))
        packed = graph.call_method("reshape", (q_bqhd, -1, _size(graph, q, 1), _size(graph, q, 3)))
        packed = graph.call_method("contiguous", (packed,))
        table, batch, keys = _block_table(graph, site)
        q_len = _size(graph, q, 2)
        seq_lens, bias = _masking(graph, site, batch, keys, q_len)
        starts = graph.call_function(torch.arange, (_arith(graph, operator.add, batch, 1),),
                                     {"dtype": torch.int32, "device": site.q_fake.device})
        query_start_loc = graph.call_function(operator.mul, (starts, q_len))
        scale = site.attention.scale
        if scale is None:
            scale = 1.0 / math.sqrt(static_int(site.size("dim")))
        options = {name: value for name, value in (
            ("window_left", site.masking.window_left), ("softcap", site.attention.softcap))
            if value is not None}
        op = getattr(torch.ops.pagedfuse, site.op).default
        out = graph.call_function(op, (packed, *_caches(graph, site), table, seq_lens,
                                       query_start_loc, scale, site.masking.causal, bias,
                                       keys, q_len), options)
        unpacked = graph.call_method("view_as", (out, q_bqhd))
        result = graph.call_method("transpose", (unpacked, 1, 2))
        return _nan_rows(graph, site, result) if site.masking.nan_rows else result

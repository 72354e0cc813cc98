"""Walk back from an SDPA key/value operand to the paged cache it was gathered from.

The walk passes layout ops (graph/layout.py), casts and dequant multiplies and stops at a
gather recogniser; a view that reinterprets the dtype ends it. Going forward again, the
named-axes interpreter proves the operand is
``[batch, kv_head (x rep), position = (block, slot), head_dim]``. Each recogniser is one small
function in ``GATHERS``; a new gather spelling is one more entry.

A per-token gather whose copy is then written in place before the attention (transformers'
sliding-window layers read the cache and ``masked_scatter_`` the new K/V into the copy) is
read ``patched``: the op reads that copy, through an identity table, rather than the cache,
so whatever the writes put there is what it sees, as SDPA does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from pagedfuse.graph.effects import effects_of, node_storages
from pagedfuse.graph.layout import Layout, apply_layout_op, is_layout_op, same_size, show
from pagedfuse.graph.ops import arg, describe, fake, op_of
from pagedfuse.ops.validate import INDEX_DTYPES


@dataclass(frozen=True)
class Gather:
    """``source`` rows picked by ``index`` along dim 0 (a block table, or per-token slots)."""

    node: fx.Node
    source: fx.Node
    index: fx.Node  # [batch, blocks] or [blocks]
    spelling: str
    flattened: bool = False  # the gather used ``index`` flattened to 1-D (batch*blocks rows)
    merged_rows: bool = False  # each picked row arrives flattened to one dim (torch.take)
    # Nodes between ``source``/``index`` and the gather that eager evaluates (index
    # arithmetic, flattened views): where eager reads the table, for the write checks.
    index_path: frozenset[fx.Node] = frozenset()
    # In-place writes to the gathered copy before the attention: then ``source`` is that
    # copy (``node`` itself), read through an identity table; ``cache`` is what it came from.
    patched: tuple[fx.Node, ...] = ()
    cache: fx.Node | None = None


@dataclass(frozen=True)
class Step:
    """One op between the gather and SDPA: "layout", "cast", or "scale" (a dequant multiply
    whose other operand is ``scale``, itself a gathered trace)."""

    node: fx.Node
    kind: str
    scale: Trace | None = None


@dataclass(frozen=True)
class Trace:
    gather: Gather
    steps: tuple[Step, ...]  # from the gather towards SDPA

    def nodes(self) -> set[fx.Node]:
        """The nodes the op makes redundant (a patched copy stays: the op reads it)."""
        found = {s.node for s in self.steps}
        if not self.gather.patched:
            found.add(self.gather.node)
        for s in self.steps:
            if s.scale is not None:
                found |= s.scale.nodes()
        return found

    def reads(self) -> set[fx.Node]:
        """Every node eager evaluates from what the op reads (the cache and table, or a
        patched copy) to the end of the trace."""
        if self.gather.patched:
            return self.nodes()
        found = self.nodes() | self.gather.index_path
        for s in self.steps:
            if s.scale is not None:
                found |= s.scale.reads()
        return found

    @property
    def scale(self) -> Trace | None:
        return next((s.scale for s in self.steps if s.scale is not None), None)


@dataclass(frozen=True)
class SourceView:
    """How the gathered source is laid out, and how the op must see it."""

    name: str  # "NHD", "HND" or "flat" (block_size 1: one slot per row)
    layout: Layout  # of the gather's output under this hypothesis
    # The method call (name, args) turning the source into the op's [N, bs, H, ...] view:
    # ("transpose", (1, 2)) or ("unsqueeze", (1,)); None: the source is that view already.
    op_view: tuple[str, tuple[int, ...]] | None

    def op_shape(self, shape: tuple) -> tuple:
        """The source's ``shape`` as the op sees it."""
        if self.op_view is None:
            return shape
        method, args = self.op_view
        if method == "transpose":
            d0, d1 = args
            dims = list(range(len(shape)))
            dims[d0], dims[d1] = d1, d0
            return tuple(shape[d] for d in dims)
        return shape[:args[0]] + (1,) + shape[args[0]:]  # unsqueeze


def _int_index(node: object) -> str | None:
    t = fake(node)
    if not isinstance(t, torch.Tensor):
        return f"index {describe(node)} is not a tensor"
    if t.dtype not in INDEX_DTYPES:
        return f"index {describe(node)} has dtype {t.dtype}, not a block table of int ids"
    if t.dim() not in (1, 2):
        return f"index {describe(node)} has rank {t.dim()}; a block table has rank 1 or 2"
    return None


def _gather_getitem(node: fx.Node) -> Gather | str | None:
    index = node.args[1]
    items = index if isinstance(index, tuple) else (index,)
    tensors = [i for i, item in enumerate(items) if isinstance(item, fx.Node)]
    if not tensors:
        return None  # a pure view: None / full slices
    if tensors != [0] or any(it not in (slice(None), Ellipsis) for it in items[1:]):
        return (f"{describe(node)} indexes the cache with a tensor outside dim 0; a block "
                "table picks whole blocks along dim 0")
    return _flat_index(node, items[0], node.args[0], "cache[index]")


def _flat_index(node: fx.Node, index: object, source: fx.Node, spelling: str,
                path: frozenset[fx.Node] = frozenset()) -> Gather | str:
    """An index of rank 1 or 2; a [batch, blocks] table flattened to 1-D reads per batch.
    ``path``: the nodes between ``index``/``source`` and the gather."""
    reason = _int_index(index)
    if reason:
        return reason
    table = index.args[0] if op_of(index) in ("reshape", "flatten") else None
    if fake(index).dim() == 1 and table is not None and _int_index(table) is None and \
            fake(table).dim() == 2:
        return Gather(node, source, table, spelling, flattened=True, index_path=path | {index})
    return Gather(node, source, index, spelling, index_path=path)


def _gather_index_select(node: fx.Node) -> Gather | str:
    source, dim, index = arg(node, "input"), arg(node, "dim"), arg(node, "index")
    if dim != 0:
        return f"{describe(node)} selects along dim {dim}, not the block/slot dim 0"
    return _flat_index(node, index, source, "index_select(cache, 0, index)")


def _gather_gather(node: fx.Node) -> Gather | str:
    """``torch.gather(cache, 0, idx[:, None, None].expand(...))`` is index_select by idx when
    the index is ``idx`` broadcast over whole rows of the cache."""
    return _row_gather(node, arg(node, "index"), "torch.gather(cache, 0, index)", False)


def _gather_take_along_dim(node: fx.Node) -> Gather | str:
    """``torch.take_along_dim(cache, idx[:, None, None], dim=0)``: gather that broadcasts."""
    return _row_gather(node, arg(node, "indices"), "take_along_dim(cache, index, 0)", True)


def _row_gather(node: fx.Node, index: object, spelling: str, broadcasts: bool) -> Gather | str:
    """A gather along dim 0 whose index is one slot id per cache row, repeated (or, where the
    op ``broadcasts``, of size 1) over the rest of the row."""
    source, dim = arg(node, "input"), arg(node, "dim")
    if dim != 0:
        return f"{describe(node)} gathers along dim {dim}, not the block/slot dim 0"
    if not isinstance(index, fx.Node) or fake(index).dim() != fake(source).dim() or not all(
            same_size(a, b) or broadcasts and same_size(a, 1)
            for a, b in zip(fake(index).shape[1:], fake(source).shape[1:], strict=True)):
        return f"{describe(node)}: the index covers only part of each cache row"
    path, cur = [], index
    while op_of(cur) in ("expand", "unsqueeze", "reshape", "getitem") and fake(cur).dim() > 1:
        path.append(cur)
        cur = cur.args[0]
    reason = _int_index(cur)
    if reason or fake(cur).dim() != 1:
        return reason or f"{describe(node)}: index is not a broadcast 1-D slot index"
    rows = Layout.of((("row",),), {"row": fake(cur).shape[0]})
    layout: Layout | str = rows
    for step in reversed(path):
        layout = apply_layout_op(step, layout)
        if isinstance(layout, str):
            return f"{describe(node)}: {layout}"
    if layout.dims[0] != rows.dims[0] or any(not a.startswith("rep")
                                             for d in layout.dims[1:] for a in d):
        return f"{describe(node)}: index varies along a dim other than 0"
    return _flat_index(node, cur, source, spelling, frozenset(path))


def _adds_last_dim(before: torch.Size, after: torch.Size) -> bool:
    """``after`` is ``before`` with a trailing size-1 dim (compared without adding guards)."""
    return len(after) == len(before) + 1 and same_size(after[-1], 1) and all(
        same_size(a, b) for a, b in zip(before, after, strict=False))


def _row_offsets(index: object, row: object) -> tuple[fx.Node, frozenset[fx.Node]] | None:
    """``ids`` (and the nodes computing the offsets from it) when ``index`` is
    ``ids[..., None] * row + arange(row)`` (either operand order): the element offsets of
    whole rows ``ids`` of a cache whose rows hold ``row`` elements."""
    if op_of(index) != "add":
        return None
    for scaled, offsets in ((arg(index, "input"), arg(index, "other")),
                            (arg(index, "other"), arg(index, "input"))):
        if op_of(offsets) != "arange" or op_of(scaled) != "mul":
            continue
        if len(offsets.args) != 1 or not same_size(offsets.args[0], row):
            continue  # arange(start, end, ...) or another length: not one row's offsets
        ids, factor = arg(scaled, "input"), arg(scaled, "other")
        if isinstance(ids, (int, torch.SymInt)):
            ids, factor = factor, ids
        if not isinstance(ids, fx.Node) or not same_size(factor, row):
            continue
        inner = ids.args[0] if op_of(ids) in ("unsqueeze", "getitem", "reshape") else None
        if isinstance(inner, fx.Node) and _adds_last_dim(fake(inner).shape, fake(ids).shape):
            return inner, frozenset({index, scaled, offsets, ids})
    return None


def _gather_take(node: fx.Node) -> Gather | str:
    """``torch.take(cache, ids[..., None] * row + arange(row))``: whole rows by element offsets,
    each row arriving flattened (``row`` = elements per cache row)."""
    source, flat = arg(node, "input"), frozenset()
    if op_of(source) in ("reshape", "flatten") and fake(source).dim() == 1:
        source, flat = source.args[0], frozenset({source})  # take reads the cache flat anyway
    row = math.prod(fake(source).shape[1:])
    offsets = _row_offsets(arg(node, "index"), row)
    if offsets is None:
        return (f"{describe(node)}: the index is not ids[..., None] * {row} + arange({row}), "
                "whole rows of the cache")
    ids, path = offsets
    found = _flat_index(node, ids, source, "torch.take(cache, row offsets)", path | flat)
    return replace(found, merged_rows=True) if isinstance(found, Gather) else found


GATHERS: dict[str, Callable[[fx.Node], Gather | str | None]] = {
    "getitem": _gather_getitem,
    "index_select": _gather_index_select,
    "gather": _gather_gather,
    "take_along_dim": _gather_take_along_dim,
    "take": _gather_take,
}


def read_patched(trace: Trace, anchor: fx.Node) -> Trace:
    """``trace`` with its gather read ``patched`` where its per-token copy of a float cache is
    written in place before ``anchor``; otherwise as it is (the write checks then say why a
    written copy is not fused)."""
    gather = trace.gather
    effects = effects_of(anchor.graph)
    writes = []
    position = gather.node
    while (write := effects.first_write(node_storages(gather.node), position, anchor)):
        writes.append(write)
        position = write
    if not writes or trace.scale is not None or fake(gather.index).dim() != 1 or \
            gather.flattened or gather.merged_rows or fake(gather.source).dim() != 3:
        return trace
    patched = replace(gather, source=gather.node, patched=tuple(writes), cache=gather.source,
                      spelling=f"{gather.spelling} patched in place by "
                               f"{', '.join(describe(w) for w in writes)}")
    return Trace(patched, trace.steps)


def walk(node: object, what: str) -> Trace | str:
    """The trace from ``node`` back to its gather, or why there is none."""
    steps: list[Step] = []
    cur = node
    while True:
        op = op_of(cur)
        recognise = GATHERS.get(op)
        found = recognise(cur) if recognise else None
        if isinstance(found, Gather):
            return Trace(found, tuple(reversed(steps)))
        if isinstance(found, str):
            return f"{what}: {found}"
        if is_layout_op(op) or op == "cast":
            steps.append(Step(cur, "cast" if op == "cast" else "layout"))
            cur = cur.args[0]
        elif op == "mul":
            return _walk_dequant(cur, steps, what)
        elif op == "view_dtype":
            return (f"{what}: {describe(cur)} reinterprets the {fake(cur.args[0]).dtype} bits "
                    f"as {fake(cur).dtype}, a dtype view, not a layout op")
        else:
            return (f"{what} comes from {describe(cur)}, not from a gather through a block "
                    "table (a contiguous or unrecognised cache)")


def _walk_dequant(node: fx.Node, later: list[Step], what: str) -> Trace | str:
    """A multiply: one operand is the data, the other its per-token scale (one rank less at
    the source), gathered the same way; either operand order."""
    a, b = arg(node, "input"), arg(node, "other")
    reasons = []
    for data, other in ((a, b), (b, a)):
        if not (isinstance(data, fx.Node) and isinstance(other, fx.Node)):
            continue
        data_trace, scale = walk(data, what), walk(other, f"{what} scale")
        reason = next((t for t in (data_trace, scale) if isinstance(t, str)), None)
        if reason is None and scale.scale is not None:
            reason = f"{what}: nested dequant scales"
        if reason is None and fake(scale.gather.source).dim() != \
                fake(data_trace.gather.source).dim() - 1:
            reason = f"{what}: {describe(other)} is not a per-token scale of {describe(data)}"
        if reason is None:
            step = Step(node, "scale", scale)
            return Trace(data_trace.gather, data_trace.steps + (step,) + tuple(reversed(later)))
        reasons.append(reason)
    return reasons[0] if reasons else f"{what}: {describe(node)} multiplies by a non-tensor"


def source_views(gather: Gather, role: str) -> list[SourceView]:
    """Layout hypotheses for a gather's output (see ``_source_views``); where the gather hands
    each row over flattened (torch.take), the row's dims merge into one."""
    views = _source_views(gather, role)
    if not gather.merged_rows:
        return views
    lead = 1 if gather.flattened else fake(gather.index).dim()
    return [replace(v, layout=replace(v.layout, dims=v.layout.dims[:lead] + (
        tuple(a for d in v.layout.dims[lead:] for a in d),))) for v in views]


def _source_views(gather: Gather, role: str) -> list[SourceView]:
    """Layout hypotheses for a gather's output: a data cache ("data") is [N, bs, H, D] (NHD),
    [N, H, bs, D] (HND) or a flat slot cache [S, H, D]; its scales ("scale") the same less D."""
    idx, shape = fake(gather.index), tuple(fake(gather.source).shape)
    atoms = ("batch", "block")[2 - idx.dim():]
    lead = (atoms,) if gather.flattened else tuple((a,) for a in atoms)
    sizes = dict(zip(atoms, idx.shape, strict=True))
    tail = (("dim",),) if role == "data" else ()
    paged_rank = 3 + len(tail)
    if len(shape) == paged_rank - 1:
        flat = dict(sizes, head=shape[1], **({"dim": shape[2]} if tail else {}))
        return [SourceView("flat", Layout.of(lead + (("head",),) + tail, flat),
                           ("unsqueeze", (1,)))]
    if len(shape) != paged_rank:
        return []
    dim = {"dim": shape[3]} if tail else {}
    nhd = dict(sizes, slot=shape[1], head=shape[2], **dim)
    hnd = dict(sizes, head=shape[1], slot=shape[2], **dim)
    return [SourceView("NHD", Layout.of(lead + (("slot",), ("head",)) + tail, nhd), None),
            SourceView("HND", Layout.of(lead + (("head",), ("slot",)) + tail, hnd),
                       ("transpose", (1, 2)))]


@dataclass(frozen=True)
class Resolved:
    """A trace whose layout is proven: the source view and (if dequantized) the scale's."""

    trace: Trace
    view: SourceView
    scale_view: SourceView | None
    final: Layout


def _forward(trace: Trace, view: SourceView) -> tuple[Layout, SourceView | None] | str:
    layout, scale_view = view.layout, None
    for step in trace.steps:
        if step.kind == "layout":
            layout = apply_layout_op(step.node, layout)
            if isinstance(layout, str):
                return layout
        elif step.kind == "scale":
            scale_view = _match_scale(step.scale, layout)
            if isinstance(scale_view, str):
                return scale_view
    return layout, scale_view


def _match_scale(scale: Trace, data: Layout) -> SourceView | str:
    """The scale hypothesis whose layout broadcasts onto ``data`` minus its head_dim atom."""
    want = tuple(tuple(a for a in d if a != "dim") for d in data.dims)
    for view in source_views(scale.gather, "scale"):
        layout = _forward(scale, view)
        if isinstance(layout, str):
            continue
        dims = layout[0].dims
        if len(dims) <= len(want) and dims == want[len(want) - len(dims):]:
            return view
    return (f"the dequant scale {describe(scale.gather.source)} does not line up with the "
            f"data {show(data)} token by token and head by head")


def resolve(trace: Trace, fits: Callable[[Layout], str | None]) -> Resolved | str:
    """The first source hypothesis whose forward layout ``fits``; else the first reason."""
    reasons = []
    for view in source_views(trace.gather, "data"):
        out = _forward(trace, view)
        if isinstance(out, str):
            reasons.append(f"as {view.name}: {out}")
            continue
        reason = fits(out[0])
        if reason is None:
            return Resolved(trace, view, out[1], out[0])
        reasons.append(f"as {view.name}: {reason}")
    if not reasons:
        return (f"{describe(trace.gather.source)} has shape "
                f"{tuple(fake(trace.gather.source).shape)}, not a paged or flat slot cache")
    return "; ".join(reasons)

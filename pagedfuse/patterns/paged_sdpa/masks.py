"""Read an SDPA attn_mask: a length mask becomes seq_lens, anything else stays attn_bias.

A length mask says "key j of sequence b is kept iff j < seq_lens[b]": ``arange(L) <
seq_lens[:, None]`` as a bool mask, or turned additive (0 / -inf) with ``where`` or
``masked_fill``, broadcast over heads and queries. Only that exact meaning is read as
seq_lens; anything else (an off-by-one ``<=``, a finite penalty, ALiBi, finfo.min for masked
keys) is passed through as attn_bias, which is always correct. Each spelling is one entry of
``COMPARES`` (the bool core) or ``ADDITIVE`` (0 / -inf from it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from pagedfuse.graph.layout import LAYOUT_OPS, Layout, apply_layout_op, is_one, same_size
from pagedfuse.graph.ops import arg, describe, fake, op_of
from pagedfuse.ops.validate import INDEX_DTYPES

_SHAPE_OPS = LAYOUT_OPS - {"repeat_interleave", "cast"}


@dataclass(frozen=True)
class MaskReading:
    """``seq_lens`` when the mask is a length mask; otherwise ``why_bias`` says why not.
    ``nodes``: what eager evaluates from ``seq_lens`` to the mask (where it reads them)."""

    seq_lens: fx.Node | None
    why_bias: str = ""
    nodes: frozenset[fx.Node] = frozenset()


@dataclass(frozen=True)
class _Core:
    keep: bool  # True: the value means "kept" (j < len); False: it means "masked"
    layout: Layout
    seq_lens: fx.Node
    nodes: frozenset[fx.Node]


@dataclass(frozen=True)
class _Followed:
    base: fx.Node
    layout: Layout  # of the node followed, derived forward from the base's layout
    path: frozenset[fx.Node]


def _follow(node: object, base: Callable[[fx.Node], Layout | None]) -> _Followed | None:
    """Walk back through shape ops to the node ``base`` recognises."""
    path = []
    while isinstance(node, fx.Node):
        layout = base(node)
        if layout is not None:
            for step in reversed(path):
                layout = apply_layout_op(step, layout)
                if isinstance(layout, str):
                    return None
            return _Followed(node, layout, frozenset(path))
        if not (op_of(node) in _SHAPE_OPS or _float_cast(node)):
            return None
        path.append(node)
        node = node.args[0]
    return None


def _float_cast(node: fx.Node) -> bool:
    """A cast between float dtypes keeps an additive mask's 0 and -inf meaning."""
    if op_of(node) != "cast" or not isinstance(node.args[0], fx.Node):
        return False
    src, out = fake(node.args[0]), fake(node)
    return src is not None and out is not None and src.dtype.is_floating_point and \
        out.dtype.is_floating_point


def _arange(node: fx.Node) -> Layout | None:
    if op_of(node) != "arange":
        return None
    args = list(node.args) + [node.kwargs.get(k) for k in ("start", "end", "step")
                              if k in node.kwargs]
    if len(args) == 2 and args[0] != 0 or len(args) == 3 and (args[0] != 0 or args[2] != 1):
        return None
    out = fake(node)
    return Layout.of((("key",),), {"key": out.shape[0]}) if out is not None else None


def _lengths(node: fx.Node) -> Layout | None:
    t = fake(node)
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in INDEX_DTYPES:
        return None
    return Layout.of((("batch",),), {"batch": t.shape[0]})


def _broadcast(a: Layout, b: Layout) -> Layout | None:
    rank = max(len(a.dims), len(b.dims))
    da = ((),) * (rank - len(a.dims)) + a.dims
    db = ((),) * (rank - len(b.dims)) + b.dims
    if any(x and y for x, y in zip(da, db, strict=True)):
        return None
    return Layout(tuple(x or y for x, y in zip(da, db, strict=True)), a.sizes + b.sizes)


def _positions_vs_lengths(node: fx.Node, positions: object, lengths: object,
                          keep: bool) -> _Core | None:
    pos, lens = _follow(positions, _arange), _follow(lengths, _lengths)
    if pos is None or lens is None:
        return None
    layout = _broadcast(pos.layout, lens.layout)
    nodes = pos.path | lens.path | {node, pos.base}
    return layout and _Core(keep, layout, lens.base, nodes)


def _less(node: fx.Node) -> _Core | None:  # j < len: kept
    return _positions_vs_lengths(node, arg(node, "input"), arg(node, "other"), True)


def _greater(node: fx.Node) -> _Core | None:  # len > j: kept
    return _positions_vs_lengths(node, arg(node, "other"), arg(node, "input"), True)


def _greater_equal(node: fx.Node) -> _Core | None:  # j >= len: masked
    return _positions_vs_lengths(node, arg(node, "input"), arg(node, "other"), False)


def _not(node: fx.Node) -> _Core | None:
    inner = _compare(node.args[0])
    return inner and _Core(not inner.keep, inner.layout, inner.seq_lens, inner.nodes | {node})


# Bool spellings of "key j against seq_lens[b]".
COMPARES: dict[str, Callable[[fx.Node], _Core | None]] = {
    "lt": _less, "gt": _greater, "ge": _greater_equal, "logical_not": _not,
}


def _compare(node: object) -> _Core | None:
    recognise = COMPARES.get(op_of(node))
    return recognise(node) if recognise else None


def _masked_value(value: object, dtype: torch.dtype) -> str | None:
    """None for -inf; else why ``value`` does not mask a key the way seq_lens does."""
    if isinstance(value, float) and value == -math.inf:
        return None
    if isinstance(value, float) and value == torch.finfo(dtype).min:
        return ("masked keys get finfo.min, not -inf: SDPA gives a sequence with no visible "
                "key the average over all its keys, not zeros")
    return f"masked keys get {value!r}, not -inf"


def _where(node: fx.Node) -> _Core | str | None:
    core = _compare(arg(node, "condition"))
    if core is None:
        return None
    keep_value, drop_value = arg(node, "input"), arg(node, "other")
    if not core.keep:
        keep_value, drop_value = drop_value, keep_value
    if keep_value != 0:
        return None
    why = _masked_value(drop_value, fake(node).dtype)
    return why or _Core(True, core.layout, core.seq_lens, core.nodes | {node})


def _masked_fill(node: fx.Node) -> _Core | str | None:
    core, base = _compare(arg(node, "mask")), arg(node, "input")
    zeros = op_of(base) in ("zeros", "zeros_like") or (
        op_of(base) == "full" and arg(base, "fill_value") == 0)
    if core is None or core.keep or not zeros or \
            tuple(fake(arg(node, "mask")).shape) != tuple(fake(node).shape):
        return None
    why = _masked_value(arg(node, "value"), fake(node).dtype)
    return why or _Core(True, core.layout, core.seq_lens, core.nodes | {node, base})


# Additive spellings: 0 where the core keeps a key, -inf where it masks it.
ADDITIVE: dict[str, Callable[[fx.Node], _Core | str | None]] = {
    "where": _where, "masked_fill": _masked_fill,
}


def read_mask(mask: fx.Node, batch: object, key_len: object) -> MaskReading:
    """Whether ``mask`` (SDPA's attn_mask) is exactly a length mask over ``key_len`` keys for
    ``batch`` sequences."""
    bool_mask = fake(mask).dtype == torch.bool
    found_core: _Core | str | None = None

    def base(node: fx.Node) -> Layout | None:
        nonlocal found_core
        if bool_mask:
            found_core = _compare(node)
        else:
            additive = ADDITIVE.get(op_of(node))
            found_core = additive(node) if additive else None
        return found_core.layout if isinstance(found_core, _Core) and found_core.keep else None

    found = _follow(mask, base)
    if isinstance(found_core, str):
        return MaskReading(None, found_core)
    if found is None or found_core is None:
        return MaskReading(None, f"{describe(mask)} is not arange(L) < seq_lens[:, None] "
                                 "(as bool, or 0/-inf)")
    dims = ((),) * (4 - len(found.layout.dims)) + found.layout.dims
    sizes = dict(found.layout.sizes)
    batch_ok = dims[0] == (("batch",) if "batch" in sizes else ()) and (
        "batch" not in sizes and is_one(batch) or same_size(sizes.get("batch"), batch))
    key_ok = dims[3] == ("key",) and same_size(sizes["key"], key_len)
    broadcast_ok = all(a.startswith("rep") for d in dims[1:3] for a in d)
    if len(found.layout.dims) > 4 or not (batch_ok and key_ok and broadcast_ok):
        return MaskReading(None, f"{describe(mask)} compares positions with lengths but is not "
                                 "laid out as [batch, 1, 1, keys] over the gathered keys")
    return MaskReading(found_core.seq_lens, nodes=found_core.nodes | found.path | {mask})

"""Read an SDPA attn_mask: a length mask becomes seq_lens, anything else stays attn_bias.

A length mask says "key j of sequence b is kept iff j < seq_lens[b]": ``arange(L) <
seq_lens[:, None]`` as a bool mask, or turned additive (0 / -inf) with ``where`` or
``masked_fill``, broadcast over heads and queries. Only that exact meaning is read as
seq_lens; anything else (an off-by-one ``<=``, a finite penalty, ALiBi) is passed through as
attn_bias, which is always correct.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from pagedfuse.ops.validate import INDEX_DTYPES
from pagedfuse.patterns.axes import LAYOUT_OPS, Layout, apply_layout_op, is_one, same_size
from pagedfuse.patterns.spelling import arg, describe, fake, op_of

_SHAPE_OPS = LAYOUT_OPS - {"repeat_interleave"}


@dataclass(frozen=True)
class MaskReading:
    """``seq_lens`` when the mask is a length mask; otherwise ``why_bias`` says why not."""

    seq_lens: fx.Node | None
    why_bias: str = ""


@dataclass(frozen=True)
class _Core:
    keep: bool  # True: the value means "kept" (j < len); False: it means "masked"
    layout: Layout
    seq_lens: fx.Node


def _follow(node: object, base: Callable[[fx.Node], Layout | None]) -> tuple[fx.Node,
                                                                              Layout] | None:
    """Walk back through shape ops to the node ``base`` recognises; return it and the layout
    of ``node`` derived forward from ``base``'s layout."""
    path = []
    while isinstance(node, fx.Node):
        layout = base(node)
        if layout is not None:
            for step in reversed(path):
                layout = apply_layout_op(step, layout)
                if isinstance(layout, str):
                    return None
            return node, layout
        if not (op_of(node) in _SHAPE_OPS or _float_cast(node)):
            return None
        path.append(node)
        node = node.args[0]
    return None


def _float_cast(node: fx.Node) -> bool:
    """A cast between float dtypes keeps an additive mask's 0 and -inf (or min) meaning."""
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


def _compare(node: object) -> _Core | None:
    op = op_of(node)
    if op == "logical_not":
        inner = _compare(node.args[0])
        return inner and _Core(not inner.keep, inner.layout, inner.seq_lens)
    if op not in ("lt", "gt", "ge"):
        return None
    left, right = arg(node, "input"), arg(node, "other")
    if op == "gt":  # lens > j  is  j < lens
        left, right = right, left
    pos, lens = _follow(left, _arange), _follow(right, _lengths)
    if pos is None or lens is None:
        return None
    layout = _broadcast(pos[1], lens[1])
    return layout and _Core(op != "ge", layout, lens[0])


def _is_neg_inf(value: object, dtype: torch.dtype) -> bool:
    """-inf, or the dtype's most negative value (what Hugging Face masks use)."""
    return isinstance(value, float) and (value == -math.inf or value == torch.finfo(dtype).min)


def _additive(node: fx.Node) -> _Core | None:
    """0 where kept, -inf (or the dtype's min) where masked."""
    op, out = op_of(node), fake(node)
    if op == "where":
        core = _compare(arg(node, "condition"))
        keep_value, drop_value = arg(node, "input"), arg(node, "other")
        if core is not None and not core.keep:
            keep_value, drop_value = drop_value, keep_value
        if core and keep_value == 0 and _is_neg_inf(drop_value, out.dtype):
            return _Core(True, core.layout, core.seq_lens)
    if op == "masked_fill":
        core = _compare(arg(node, "mask"))
        base, value = arg(node, "input"), arg(node, "value")
        zeros = op_of(base) in ("zeros", "zeros_like") or (
            op_of(base) == "full" and arg(base, "fill_value") == 0)
        if core and not core.keep and zeros and _is_neg_inf(value, out.dtype) and \
                tuple(fake(arg(node, "mask")).shape) == tuple(out.shape):
            return _Core(True, core.layout, core.seq_lens)
    return None


def read_mask(mask: fx.Node, batch: object, key_len: object) -> MaskReading:
    """Whether ``mask`` (SDPA's attn_mask) is exactly a length mask over ``key_len`` keys for
    ``batch`` sequences."""
    t = fake(mask)
    core: _Core | None = None

    def base(node: fx.Node) -> Layout | None:
        nonlocal core
        core = _additive(node) if t.dtype != torch.bool else _compare(node)
        return core.layout if core and core.keep else None

    found = _follow(mask, base)
    if found is None or core is None:
        return MaskReading(None, f"{describe(mask)} is not arange(L) < seq_lens[:, None] "
                                 "(as bool, or 0/-inf)")
    dims = ((),) * (4 - len(found[1].dims)) + found[1].dims
    sizes = dict(found[1].sizes)
    batch_ok = dims[0] == (("batch",) if "batch" in sizes else ()) and (
        "batch" not in sizes and is_one(batch) or same_size(sizes.get("batch"), batch))
    key_ok = dims[3] == ("key",) and same_size(sizes["key"], key_len)
    broadcast_ok = all(a.startswith("rep") for d in dims[1:3] for a in d)
    if len(found[1].dims) > 4 or not (batch_ok and key_ok and broadcast_ok):
        return MaskReading(None, f"{describe(mask)} compares positions with lengths but is not "
                                 "laid out as [batch, 1, 1, keys] over the gathered keys")
    return MaskReading(core.seq_lens)

"""A small named-axes interpreter for layout ops.

A tensor's layout is, per dim, the tuple of *atoms* it merges (outermost first), e.g. a
gathered NHD cache ``cache[block_table]`` is ``(batch,) (block,) (slot,) (head,) (dim,)``.
Atoms of size 1 are left out, so an ``unsqueeze`` or a ``[:, None]`` is a no-op on atoms.
view/reshape/flatten/unflatten/squeeze/unsqueeze regroup atoms in row-major order (read off
the output's fake shape, so ``-1`` needs no arithmetic); transpose/permute reorder dims;
expand of a size-1 dim and repeat_interleave add a repetition atom. Sizes are compared with
``statically_known_true``: a check never adds a guard or specialises a dynamic dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int, statically_known_true

from pagedfuse.patterns.spelling import arg, fake, op_of

Dims = tuple[tuple[str, ...], ...]


def is_one(size: object) -> bool:
    return statically_known_true(size == 1)


def same_size(a: object, b: object) -> bool:
    return statically_known_true(a == b)


def static_int(size: object) -> int | None:
    """``size`` as an int when it is fixed at compile time (a SymInt with a constant value
    included); None for a dynamic size. Reading it adds no guard."""
    if isinstance(size, (int, torch.SymInt)) and is_concrete_int(size):
        return int(size)
    return None


@dataclass(frozen=True)
class Layout:
    """Atoms per dim, plus each atom's size (sizes may be SymInts)."""

    dims: Dims
    sizes: tuple[tuple[str, object], ...]

    @classmethod
    def of(cls, dims: Dims, sizes: dict[str, object]) -> Layout:
        kept = {a: s for a, s in sizes.items() if not is_one(s)}
        return cls(tuple(tuple(a for a in d if a in kept) for d in dims), tuple(kept.items()))

    def size(self, atom: str) -> object:
        """The atom's size; 1 for an atom left out (atoms of size 1 are not kept)."""
        return dict(self.sizes).get(atom, 1)

    def atoms(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d)


def _dim(d: object, rank: int) -> int | None:
    return d % rank if isinstance(d, int) and -rank <= d < rank else None


def _regroup(layout: Layout, shape: tuple) -> Layout | str:
    """Row-major reinterpretation: fill each output dim with consecutive atoms."""
    atoms = list(layout.atoms())
    dims = []
    for size in shape:
        if is_one(size):
            dims.append(())
            continue
        group: list[str] = []
        while atoms and not same_size(math.prod(layout.size(a) for a in group), size):
            group.append(atoms.pop(0))
        if not group or not same_size(math.prod(layout.size(a) for a in group), size):
            return f"reshape to {tuple(shape)} splits an axis of {show(layout)}"
        dims.append(tuple(group))
    if atoms:
        return f"reshape to {tuple(shape)} drops axes {atoms}"
    return replace(layout, dims=tuple(dims))


def _permute(layout: Layout, order: list[int | None]) -> Layout | str:
    if None in order or sorted(order) != list(range(len(layout.dims))):
        return f"unsupported permutation {order}"
    return replace(layout, dims=tuple(layout.dims[i] for i in order))


def _add_repeat(layout: Layout, dim: int, size: object) -> Layout:
    """Dim ``dim`` repeated ``size`` times in place (each element ``size`` times in a row)."""
    name = f"rep{sum(a.startswith('rep') for a, _ in layout.sizes)}"
    dims = list(layout.dims)
    dims[dim] = dims[dim] + (name,)
    return Layout(tuple(dims), layout.sizes + ((name, size),))


def _getitem_layout(layout: Layout, index: object, shape: tuple) -> Layout | str:
    items = index if isinstance(index, tuple) else (index,)
    for item in items:
        if item is None or item is Ellipsis:
            continue
        if isinstance(item, slice) and item == slice(None):
            continue
        return f"indexing with {item!r} selects positions, not a whole view"
    return _regroup(layout, shape)


def _expand(layout: Layout, shape: tuple) -> Layout | str:
    lead = len(shape) - len(layout.dims)
    if lead < 0:
        return "expand to fewer dims"
    out = Layout(((),) * lead + layout.dims, layout.sizes)
    for i, size in enumerate(shape):
        if not out.dims[i] and not is_one(size):
            out = _add_repeat(out, i, size)
    return out


def apply_layout_op(node: fx.Node, layout: Layout) -> Layout | str:
    """``layout`` of ``node``'s output given ``layout`` of its input, or why it is not a
    layout op we can follow."""
    op = op_of(node)
    out = fake(node)
    if not isinstance(out, torch.Tensor):
        return f"{node.name} has no recorded shape"
    shape, rank = tuple(out.shape), len(layout.dims)
    if op in ("reshape", "flatten", "unflatten", "squeeze", "unsqueeze"):
        return _regroup(layout, shape)
    if op in ("contiguous", "cast"):
        return layout
    if op == "getitem":
        return _getitem_layout(layout, node.args[1], shape)
    if op == "expand":
        return _expand(layout, shape)
    if op == "transpose":
        d0, d1 = _dim(arg(node, "dim0"), rank), _dim(arg(node, "dim1"), rank)
        order = list(range(rank))
        if d0 is None or d1 is None:
            return "transpose with non-constant dims"
        order[d0], order[d1] = order[d1], order[d0]
        return _permute(layout, order)
    if op == "permute":
        raw = node.args[1:] if node.op == "call_method" else node.args[1:2]
        dims = raw[0] if len(raw) == 1 and isinstance(raw[0], (tuple, list)) else raw
        dims = dims or node.kwargs.get("dims", ())
        return _permute(layout, [_dim(d, rank) for d in dims])
    if op == "repeat_interleave":
        repeats, dim = arg(node, "repeats"), _dim(arg(node, "dim"), rank)
        if isinstance(repeats, fx.Node) or dim is None:
            return "repeat_interleave needs an integer repeat count and a dim"
        return _add_repeat(layout, dim, repeats)
    return f"{node.name} is not a layout op"


LAYOUT_OPS = frozenset({"reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous",
                        "getitem", "expand", "transpose", "permute", "repeat_interleave"})


def show(layout: Layout) -> str:
    return "[" + ", ".join("*".join(d) or "1" for d in layout.dims) + "]"

"""A small named-axes interpreter for layout ops, and the one table of layout ops.

A tensor's layout is, per dim, the tuple of *atoms* it merges (outermost first), e.g. a
gathered NHD cache ``cache[block_table]`` is ``(batch,) (block,) (slot,) (head,) (dim,)``.
Atoms of size 1 are left out, so an ``unsqueeze`` or a ``[:, None]`` is a no-op on atoms.
view/reshape/flatten/unflatten/squeeze/unsqueeze regroup atoms in row-major order (read off
the output's fake shape, so ``-1`` needs no arithmetic); transpose/permute reorder dims;
expand of a size-1 dim and repeat_interleave add a repetition atom. Sizes are compared with
``statically_known_true``: a check never adds a guard or specialises a dynamic dim (the one
exception, ``unify_sizes``, guards two dynamic sizes equal, for the kernels' own needs).

Each layout op is one ``@layout_rule`` entry below: its spellings and how it maps a layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import (
    guard_or_false,
    is_concrete_int,
    statically_known_true,
)

from pagedfuse.graph.ops import OpForm, arg, fake, op_of, register_op

Dims = tuple[tuple[str, ...], ...]


def is_one(size: object) -> bool:
    return statically_known_true(size == 1)


def same_size(a: object, b: object) -> bool:
    return statically_known_true(a == b)


def unify_sizes(a: object, b: object) -> bool:
    """Whether ``a == b``, for two sizes a kernel needs equal although the program never
    relates them (the K and V caches' block counts, a scale's): known equal, or two dynamic
    sizes that are equal in this trace, which a guard then keeps equal (under automatic
    dynamic shapes each input dim gets its own symbol). A call where they differ recompiles
    and is checked afresh. Never specialises a size to a constant and adds no guard when the
    sizes differ."""
    if statically_known_true(a == b):
        return True
    if not (isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt)
            and a.node.has_hint() and b.node.has_hint() and a.node.hint == b.node.hint):
        return False
    return guard_or_false(a == b)


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


# A rule maps the input's layout to the output's (``shape`` is the output's fake shape), or
# says why the op cannot be followed.
LayoutRule = Callable[[fx.Node, Layout, tuple], "Layout | str"]
LAYOUT_RULES: dict[str, LayoutRule] = {}


def layout_rule(name: str, functions: tuple = (), methods: tuple[str, ...] = (),
                signature: tuple[str, ...] = ("input",)) -> Callable[[LayoutRule], LayoutRule]:
    """Register a layout op: its spellings (none when the op table already spells it) and
    its rule."""

    def add(rule: LayoutRule) -> LayoutRule:
        if functions or methods:
            register_op(OpForm(name, functions, methods, signature))
        LAYOUT_RULES[name] = rule
        return rule

    return add


def _dim(d: object, rank: int) -> int | None:
    return d % rank if isinstance(d, int) and -rank <= d < rank else None


@layout_rule("reshape", (torch.reshape,), ("view", "reshape"))
@layout_rule("flatten", (torch.flatten,), ("flatten",))
@layout_rule("unflatten", (torch.unflatten,), ("unflatten",))
@layout_rule("squeeze", (torch.squeeze,), ("squeeze",))
@layout_rule("unsqueeze", (torch.unsqueeze,), ("unsqueeze",))
def _regroup(node: fx.Node | None, layout: Layout, shape: tuple) -> Layout | str:
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


@layout_rule("contiguous", methods=("contiguous", "clone"))
@layout_rule("cast")  # a value cast (spelled in the op table) keeps the layout
def _same_layout(node: fx.Node, layout: Layout, shape: tuple) -> Layout:
    return layout


@layout_rule("getitem")
def _getitem(node: fx.Node, layout: Layout, shape: tuple) -> Layout | str:
    index = node.args[1]
    for item in index if isinstance(index, tuple) else (index,):
        if item is None or item is Ellipsis or isinstance(item, slice) and item == slice(None):
            continue
        return f"indexing with {item!r} selects positions, not a whole view"
    return _regroup(node, layout, shape)


@layout_rule("expand", methods=("expand",))
def _expand(node: fx.Node | None, layout: Layout, shape: tuple) -> Layout | str:
    lead = len(shape) - len(layout.dims)
    if lead < 0:
        return "expand to fewer dims"
    out = Layout(((),) * lead + layout.dims, layout.sizes)
    for i, size in enumerate(shape):
        if not out.dims[i] and not is_one(size):
            out = _add_repeat(out, i, size)
    return out


def _permute(layout: Layout, order: list[int | None]) -> Layout | str:
    if None in order or sorted(order) != list(range(len(layout.dims))):
        return f"unsupported permutation {order}"
    return replace(layout, dims=tuple(layout.dims[i] for i in order))


@layout_rule("transpose", (torch.transpose, torch.swapaxes, torch.swapdims),
             ("transpose", "swapaxes", "swapdims"), ("input", "dim0", "dim1"))
def _transpose(node: fx.Node, layout: Layout, shape: tuple) -> Layout | str:
    rank = len(layout.dims)
    d0, d1 = _dim(arg(node, "dim0"), rank), _dim(arg(node, "dim1"), rank)
    if d0 is None or d1 is None:
        return "transpose with non-constant dims"
    order: list[int | None] = list(range(rank))
    order[d0], order[d1] = order[d1], order[d0]
    return _permute(layout, order)


@layout_rule("permute", (torch.permute,), ("permute",))
def _permute_rule(node: fx.Node, layout: Layout, shape: tuple) -> Layout | str:
    raw = node.args[1:] if node.op == "call_method" else node.args[1:2]
    dims = raw[0] if len(raw) == 1 and isinstance(raw[0], (tuple, list)) else raw
    dims = dims or node.kwargs.get("dims", ())
    return _permute(layout, [_dim(d, len(layout.dims)) for d in dims])


def _add_repeat(layout: Layout, dim: int, size: object) -> Layout:
    """Dim ``dim`` repeated ``size`` times in place (each element ``size`` times in a row)."""
    name = f"rep{sum(a.startswith('rep') for a, _ in layout.sizes)}"
    dims = list(layout.dims)
    dims[dim] = dims[dim] + (name,)
    return Layout(tuple(dims), layout.sizes + ((name, size),))


@layout_rule("repeat_interleave", (torch.repeat_interleave,), ("repeat_interleave",),
             ("input", "repeats", "dim"))
def _repeat_interleave(node: fx.Node, layout: Layout, shape: tuple) -> Layout | str:
    repeats, dim = arg(node, "repeats"), _dim(arg(node, "dim"), len(layout.dims))
    if isinstance(repeats, fx.Node) or dim is None:
        return "repeat_interleave needs an integer repeat count and a dim"
    return _add_repeat(layout, dim, repeats)


def is_layout_op(op: str | None) -> bool:
    """Whether ``op`` has a layout rule (read at each call, so a rule registered later by an
    extension counts)."""
    return op in LAYOUT_RULES


def apply_layout_op(node: fx.Node, layout: Layout) -> Layout | str:
    """``layout`` of ``node``'s output given ``layout`` of its input, or why it is not a
    layout op we can follow."""
    rule = LAYOUT_RULES.get(op_of(node))
    if rule is None:
        return f"{node.name} is not a layout op"
    out = fake(node)
    if not isinstance(out, torch.Tensor):
        return f"{node.name} has no recorded shape"
    return rule(node, layout, tuple(out.shape))


def show(layout: Layout) -> str:
    return "[" + ", ".join("*".join(d) or "1" for d in layout.dims) + "]"

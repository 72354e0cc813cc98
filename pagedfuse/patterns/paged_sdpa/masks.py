"""Read an attention mask as the op's masking: lengths, causal, a window, and what stays
attn_bias.

A bool mask, or one made additive (0 where kept, -inf where masked: ``where``, ``masked_fill``
on zeros, or a sum of such terms), is read as a conjunction of comparisons between integer
positions (``COMPARES``, ``ADDITIVE``). A position is affine (``POSITIONS``) in three
variables: j, the key index along the mask's last dim (an ``arange`` over the gathered keys),
t, the query index along dim -2, and len, a 1-D lengths tensor indexed by batch (dim -4).
Each comparison normalises to ``a*j + b*t + c*len + d < 0``; three forms are the op's:

- length: ``j < len``                      -> seq_lens = len
- causal: ``j <= p``                       -> causal
- window: ``p - j < W``, i.e. ``j > p - W``  -> window_left = W

where p = seq_len - q_len + t is the op's query position, seq_len being len under a length
term and the gathered keys L otherwise. The op's arguments replace the mask where they say
all of it (``exact``): a length mask alone, or causal and window terms measured from L
without a length term. Otherwise the mask goes as attn_bias, and a length or window term it
holds rides along as a hint that only skips keys the mask hides anyway: the op reads keys
j < min(len, L) and, with the window, j > p' - W where its position p' is at most the mask's
(so it keeps a superset of the mask's keys, and the bias does the rest). A causal term is
never a hint: where len exceeds the gathered keys the op's position is the smaller one, and
its causal would hide keys the mask keeps. Anything else (an off-by-one ``<=``, a finite
penalty, ALiBi, finfo.min for masked keys) is attn_bias as written, which is always correct.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from pagedfuse.graph.effects import same_value
from pagedfuse.graph.layout import is_one, same_size, static_int
from pagedfuse.graph.ops import arg, describe, fake, op_of
from pagedfuse.ops.validate import INDEX_DTYPES

Var = tuple[str, "int | None"]  # ("idx", dim) or ("len", dim); dim from the right, None: size 1


@dataclass(frozen=True)
class MaskReading:
    """What a mask says in the op's terms. ``exact``: seq_lens (None: every gathered key),
    causal and window_left say all of it, and the mask itself is dropped; otherwise it goes
    as attn_bias and ``seq_lens``/``window_left`` are hints (see the module docstring).
    ``why_bias`` says why it stays a bias; ``nodes``: where eager reads seq_lens on the way
    to the mask (for the write check)."""

    seq_lens: fx.Node | None = None
    causal: bool = False
    window_left: int | None = None
    exact: bool = False
    why_bias: str = ""
    nodes: frozenset[fx.Node] = frozenset()


@dataclass
class _Affine:
    """sum(coef[v] * v) + const over the variables; ``sizes``: the size along each variable's
    dim; ``lens``: the lengths tensor behind a "len" variable."""

    coef: dict[Var, int] = field(default_factory=dict)
    const: object = 0
    sizes: dict[Var, object] = field(default_factory=dict)
    lens: fx.Node | None = None
    nodes: frozenset[fx.Node] = frozenset()

    def plus(self, other: _Affine, sign: int = 1) -> _Affine | None:
        if self.lens is not None and other.lens is not None and \
                not same_value(self.lens, other.lens):
            return None  # two different lengths tensors
        coef = dict(self.coef)
        for var, c in other.coef.items():
            coef[var] = coef.get(var, 0) + sign * c
            if var in self.sizes and not same_size(self.sizes[var], other.sizes[var]):
                return None
        coef = {v: c for v, c in coef.items() if c}
        sizes = {v: s for v, s in {**self.sizes, **other.sizes}.items() if v in coef}
        const = self.const + other.const if sign > 0 else self.const - other.const
        lens = self.lens if any(v[0] == "len" for v in self.coef) else other.lens
        return _Affine(coef, const, sizes, lens if any(v[0] == "len" for v in coef) else None,
                       self.nodes | other.nodes)

    def times(self, k: int) -> _Affine:
        return _Affine({v: c * k for v, c in self.coef.items()}, self.const * k,
                       dict(self.sizes), self.lens, self.nodes)

    def remapped(self, dims: dict[int, int]) -> _Affine | None:
        coef, sizes = {}, {}
        for (kind, dim), c in self.coef.items():
            new = (kind, dim if dim is None else dims.get(dim))
            if new[1] is None and dim is not None:
                return None
            coef[new], sizes[new] = c, self.sizes[(kind, dim)]
        return _Affine(coef, self.const, sizes, self.lens, self.nodes)


@dataclass
class _Atom:
    """One comparison, ``form < 0``."""

    form: _Affine
    node: fx.Node


@dataclass
class _Conj:
    """A conjunction: the comparisons read, plus why other parts could not be read."""

    atoms: list[_Atom] = field(default_factory=list)
    opaque: list[str] = field(default_factory=list)
    nodes: frozenset[fx.Node] = frozenset()

    def both(self, other: _Conj) -> _Conj:
        return _Conj(self.atoms + other.atoms, self.opaque + other.opaque,
                     self.nodes | other.nodes)

    def remapped(self, dims: dict[int, int], node: fx.Node) -> _Conj:
        atoms, opaque = [], list(self.opaque)
        for atom in self.atoms:
            form = atom.form.remapped(dims)
            if form is None:
                opaque.append(f"{describe(atom.node)} moves across dims")
            else:
                atoms.append(_Atom(form, atom.node))
        return _Conj(atoms, opaque, self.nodes | {node})


# --- positions -------------------------------------------------------------------------------

def _constant(value: object) -> _Affine | None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        return None
    return _Affine(const=value)


def _arange(node: fx.Node) -> _Affine | None:
    args = list(node.args) + [node.kwargs[k] for k in ("start", "end", "step")
                              if k in node.kwargs]
    start = args[0] if len(args) >= 2 else 0
    if len(args) == 3 and args[2] != 1 or _constant(start) is None:
        return None
    size = fake(node).shape[0]
    if is_one(size):
        return _Affine(const=start, nodes=frozenset({node}))
    var = ("idx", -1)
    return _Affine({var: 1}, start, {var: size}, nodes=frozenset({node}))


def _lengths(node: fx.Node) -> _Affine:
    size = fake(node).shape[0]
    var = ("len", None if is_one(size) else -1)
    return _Affine({var: 1}, 0, {var: size}, node, frozenset({node}))


def _binary(node: fx.Node, combine: Callable[[_Affine, _Affine], _Affine | None]
            ) -> _Affine | None:
    a, b = _position(arg(node, "input")), _position(arg(node, "other"))
    if a is None or b is None:
        return None
    out = combine(a, b)
    return out and _Affine(out.coef, out.const, out.sizes, out.lens, out.nodes | {node})


def _mul(a: _Affine, b: _Affine) -> _Affine | None:
    if a.coef and b.coef:
        return None  # a product of positions is not affine
    factor, form = (b, a) if not b.coef else (a, b)
    k = static_int(factor.const)
    return None if k is None else form.times(k)


POSITIONS: dict[str, Callable[[fx.Node], _Affine | None]] = {
    "arange": _arange,
    "add": lambda n: _binary(n, lambda a, b: a.plus(b)),
    "sub": lambda n: _binary(n, lambda a, b: a.plus(b, -1)),
    "mul": lambda n: _binary(n, _mul),
    "neg": lambda n: (lambda a: a and a.times(-1))(_position(n.args[0])),
}
_VIEWS = frozenset({"unsqueeze", "squeeze", "reshape", "getitem", "expand", "contiguous",
                    "cast"})


def _is_int(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (*INDEX_DTYPES, torch.int16)


def _position(value: object) -> _Affine | None:
    """``value`` as an affine position, or None."""
    if not isinstance(value, fx.Node):
        return _constant(value)
    out = fake(value)
    if isinstance(out, (int, torch.SymInt)):  # a size read off a shape
        return _constant(out)
    if not _is_int(out):
        return None
    op = op_of(value)
    if op in POSITIONS:
        return POSITIONS[op](value)
    if op in _VIEWS:
        inner = value.args[0]
        dims = _dim_map(value, inner) if _is_int(fake(inner)) else None
        form = _position(inner) if dims is not None else None
        return form and form.remapped(dims)
    return _lengths(value) if out.dim() == 1 else None


def _dim_map(node: fx.Node, inner: object) -> dict[int, int] | None:
    """For a view op that only adds, drops or broadcasts size-1 dims: where each varying dim
    of ``inner`` (counted from the right) lands in ``node``; None for any other op."""
    if not isinstance(inner, fx.Node) or not isinstance(fake(inner), torch.Tensor):
        return None
    before, after = tuple(fake(inner).shape), tuple(fake(node).shape)
    if op_of(node) == "expand":
        return {d: d for d in range(-len(before), 0)} if len(after) >= len(before) else None
    if op_of(node) == "getitem":
        index = node.args[1]
        for item in index if isinstance(index, tuple) else (index,):
            if not (item is None or item is Ellipsis or item == slice(None)):
                return None
    varying = [(i - len(before), s) for i, s in enumerate(before) if not is_one(s)]
    targets = [(i - len(after), s) for i, s in enumerate(after) if not is_one(s)]
    if len(varying) != len(targets) or not all(
            same_size(a, b) for (_, a), (_, b) in zip(varying, targets, strict=True)):
        return None
    return {d: e for (d, _), (e, _) in zip(varying, targets, strict=True)}


# --- comparisons and their conjunctions -------------------------------------------------------

def _comparison(node: fx.Node, keep: bool) -> _Conj | None:
    """``lhs OP rhs`` as ``g < 0`` over integers (negated when ``keep`` is False)."""
    a, b = _position(arg(node, "input")), _position(arg(node, "other"))
    diff = a.plus(b, -1) if a is not None and b is not None else None
    if diff is None or not diff.coef:
        return None
    op = op_of(node)
    # lt: a - b < 0; le: a - b - 1 < 0; gt: b - a < 0; ge: b - a - 1 < 0
    form = diff if op in ("lt", "le") else diff.times(-1)
    if op in ("le", "ge"):
        form = form.plus(_Affine(const=1), -1)
    if not keep:  # not (g < 0)  <=>  -g - 1 < 0
        form = form.times(-1).plus(_Affine(const=1), -1)
    return _Conj([_Atom(form, node)], nodes=form.nodes | {node})


def _with(conj: _Conj, node: fx.Node) -> _Conj:
    return _Conj(conj.atoms, conj.opaque, conj.nodes | {node})


def _not(node: fx.Node, keep: bool) -> _Conj:
    return _with(_bool(node.args[0], not keep), node)


def _and(node: fx.Node, keep: bool) -> _Conj:
    a, b = arg(node, "input"), arg(node, "other")
    if not keep:  # not (a and b) is a disjunction
        return _Conj(opaque=[f"{describe(node)} negates a conjunction"])
    return _with(_bool(a, True).both(_bool(b, True)), node)


# Bool spellings: comparisons of positions, and how they combine.
COMPARES: dict[str, Callable[[fx.Node, bool], _Conj | None]] = {
    "lt": _comparison, "le": _comparison, "gt": _comparison, "ge": _comparison,
    "logical_not": _not, "logical_and": _and,
}


def _bool(node: object, keep: bool) -> _Conj:
    """The bool ``node`` (its negation when ``keep`` is False) as a conjunction."""
    if not isinstance(node, fx.Node) or fake(node) is None or fake(node).dtype != torch.bool:
        return _Conj(opaque=[f"{describe(node)} is not a bool mask"])
    op = op_of(node)
    if op in COMPARES:
        found = COMPARES[op](node, keep)
        if found is not None:
            return found
    elif op in _VIEWS and op != "cast":
        dims = _dim_map(node, node.args[0])
        if dims is not None:
            return _bool(node.args[0], keep).remapped(dims, node)
    return _Conj(opaque=[f"{describe(node)} is not a comparison of positions"])


# --- additive masks --------------------------------------------------------------------------

def _masked_value(value: object, dtype: torch.dtype) -> str | None:
    """None for -inf; else why ``value`` does not hide a key the way the op does."""
    if isinstance(value, float) and value == -math.inf:
        return None
    if isinstance(value, float) and value == torch.finfo(dtype).min:
        return ("masked keys get finfo.min, not -inf: SDPA gives a row with no visible key the "
                "average over all its keys, not zeros")
    return f"masked keys get {value!r}, not -inf"


def _where(node: fx.Node) -> _Conj:
    cond, kept, masked = arg(node, "condition"), arg(node, "input"), arg(node, "other")
    keep = True
    if masked == 0 and kept != 0:
        kept, masked, keep = masked, kept, False
    if kept != 0:
        return _Conj(opaque=[f"{describe(node)} keeps keys at {kept!r}, not 0"])
    why = _masked_value(masked, fake(node).dtype)
    return _Conj(opaque=[why]) if why else _with(_bool(cond, keep), node)


def _masked_fill(node: fx.Node) -> _Conj:
    base, cond = arg(node, "input"), arg(node, "mask")
    zeros = op_of(base) in ("zeros", "zeros_like") or (
        op_of(base) == "full" and arg(base, "fill_value") == 0)
    if not zeros or tuple(fake(cond).shape) != tuple(fake(node).shape):
        return _Conj(opaque=[f"{describe(node)} fills something other than zeros"])
    why = _masked_value(arg(node, "value"), fake(node).dtype)
    if why:
        return _Conj(opaque=[why])
    kept = _bool(cond, False)
    return _Conj(kept.atoms, kept.opaque, kept.nodes | {node, base})


def _sum(node: fx.Node) -> _Conj:
    """Two additive terms: -inf in either hides the key."""
    return _with(_additive(arg(node, "input")).both(_additive(arg(node, "other"))), node)


# Additive spellings: 0 where a key is kept, -inf where it is hidden.
ADDITIVE: dict[str, Callable[[fx.Node], _Conj]] = {
    "where": _where, "masked_fill": _masked_fill, "add": _sum,
}


def _float_cast(node: fx.Node) -> bool:
    """A cast between float dtypes keeps an additive mask's 0 and -inf meaning."""
    src, out = fake(node.args[0]), fake(node)
    return isinstance(src, torch.Tensor) and src.dtype.is_floating_point and \
        out.dtype.is_floating_point


def _additive(node: object) -> _Conj:
    if not isinstance(node, fx.Node) or not isinstance(fake(node), torch.Tensor):
        return _Conj(opaque=[f"{describe(node)} is a constant"])
    op = op_of(node)
    if op in ADDITIVE:
        return ADDITIVE[op](node)
    if op in _VIEWS and (op != "cast" or _float_cast(node)):
        dims = _dim_map(node, node.args[0])
        if dims is not None:
            return _additive(node.args[0]).remapped(dims, node)
    return _Conj(opaque=[f"{describe(node)} is not 0/-inf from a comparison of positions"])


# --- the op's terms --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Term:
    kind: str  # "length", "causal" or "window"
    base: str  # positions measured from "len" or "L" (the gathered keys)
    window: int | None = None


def _classify(form: _Affine, batch: object, q_len: object, keys: object) -> _Term | None:
    """Which of the op's terms ``form < 0`` is, in a mask [batch, heads, q_len, keys]."""
    j = t = c = 0
    for (kind, dim), coef in form.coef.items():
        size = form.sizes[(kind, dim)]
        if kind == "idx" and dim == -1 and same_size(size, keys):
            j = coef
        elif kind == "idx" and dim == -2 and same_size(size, q_len):
            t = coef
        elif kind == "len" and (dim == -4 and same_size(size, batch) or
                                dim is None and is_one(batch)):
            c = coef
        else:
            return None
    d = form.const
    step = 0 if is_one(q_len) else 1  # a single query row has no query index
    if (j, t, c) == (1, 0, -1) and same_size(d, 0):
        return _Term("length", "len")
    if (j, t) == (1, -step) and c in (0, -1):
        base = "len" if c else "L"
        want = q_len - 1 if c else q_len - 1 - keys
        return _Term("causal", base) if same_size(d, want) else None
    if (j, t) == (-1, step) and c in (0, 1):
        window = static_int((-q_len - d) if c else (keys - q_len - d))
        if window is None or window < 1:
            return None
        return _Term("window", "len" if c else "L", window)
    return None


def read_mask(mask: fx.Node, batch: object, q_len: object, keys: object) -> MaskReading:
    """Whether ``mask`` (attn_mask, or the mask added to explicit scores), broadcast to
    [batch, heads, q_len, keys] over the gathered keys, is in the op's terms."""
    m = fake(mask)
    conj = _bool(mask, True) if m.dtype == torch.bool else _additive(mask)
    if m.dim() > 4:
        conj = _Conj(opaque=[f"{describe(mask)} has {m.dim()} dims"])
    terms: dict[str, _Term] = {}
    lens, others = None, list(conj.opaque)
    for atom in conj.atoms:
        term = _classify(atom.form, batch, q_len, keys)
        if term is None or term.kind in terms and terms[term.kind] != term or \
                term.base == "len" and lens is not None and \
                not same_value(lens, atom.form.lens):
            others.append(f"{describe(atom.node)} is not a length, causal or window term "
                          "over the gathered keys")
            continue
        terms[term.kind] = term
        if term.base == "len":
            lens = atom.form.lens
    length = "length" in terms
    bases = {t.base for k, t in terms.items() if k != "length"}
    exact = not others and (bases <= {"L"} and not length or bases == set())
    if exact:
        window = terms.get("window")
        return MaskReading(lens, "causal" in terms, window and window.window, True,
                           nodes=conj.nodes | {mask})
    window = terms.get("window")
    hint = window.window if window and (window.base == "L" or length) else None
    if not terms:
        why = "; ".join(dict.fromkeys(others)) or "no term of it could be read"
        return MaskReading(why_bias=why)
    if others:
        why = "; ".join(dict.fromkeys(others))
    elif "len" in bases:
        why = ("its causal or window term is measured from the lengths, which may exceed the "
               "gathered keys, where the op's positions would stop at them")
    else:
        why = ("its causal or window term is measured from all the gathered keys, the op's "
               "positions under a length term from the lengths")
    return MaskReading(lens if length else None, False, hint, False, why,
                       conj.nodes | {mask} if length else frozenset())

"""What an anchor computes, in SDPA's terms: an SDPA call's own arguments, or the explicit
spelling read as them.

The explicit spelling is ``matmul(p, v)`` where ``p`` is a softmax over the key dim (maybe in
float32, cast back, maybe through dropout) of scores built from ``matmul(q, k^T)``: multiplied
or divided by constant scales (on the scores or the query), maybe soft-capped as
``c * tanh(s / c)`` (transformers' Gemma2), then with an additive mask. The chain is read
backwards from the anchor; a step the spelling allows but the op cannot say (softmax over
another dim, a scale after the softmax or after the cap, the mask added before the scale or
the cap, a lossy cast) is read all the same and recorded as the ``problem`` the named checks
report, so the site appears with a reason a user can act on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from pagedfuse.graph.ops import SDPA, arg, describe, extra_kwargs, fake, op_of
from pagedfuse.ops.validate import dtype_name

# Ops between the softmax and the final matmul that the anchor test walks through.
_PROBS_OPS = frozenset({"cast", "contiguous", "dropout", "mul", "div"})
_MAX_PROBS_STEPS = 8


@dataclass(frozen=True)
class Explicit:
    """How an explicit attention was written: its own nodes (score matmul to anchor), the
    steps in order for the report, and why it is not exactly attention the op can run
    (``problem``) or why its tanh is not a soft cap (``softcap_problem``)."""

    nodes: frozenset[fx.Node]
    steps: tuple[str, ...]
    problem: str | None = None
    softcap_problem: str | None = None


@dataclass(frozen=True)
class Attention:
    """SDPA's arguments for an anchor. ``key`` is SDPA's key operand, or for the explicit
    spelling the transposed key ``k^T`` the score matmul takes (``explicit`` is set then);
    ``scale`` None means 1/sqrt(head_dim); ``dropout`` is the probability in effect (0 when
    not training; a node when it is only known at run time); ``softcap`` the cap c."""

    anchor: fx.Node
    query: fx.Node
    key: fx.Node
    value: fx.Node
    mask: fx.Node | None = None
    is_causal: bool = False
    scale: object = None
    dropout: object = 0.0
    enable_gqa: bool = False
    softcap: float | None = None
    explicit: Explicit | None = None
    extra_args: tuple[str, ...] = field(default=())

    @property
    def spelling(self) -> str:
        return "explicit matmul-softmax-matmul" if self.explicit else "SDPA"


def is_attention_anchor(node: fx.Node) -> bool:
    """An SDPA call, or a matmul whose left operand is a softmax (through casts, dropout or
    scales) of scores from another matmul: where the built-in pattern is tried (a softmax of
    anything else, e.g. a router's, is no attention site)."""
    if op_of(node) == SDPA:
        return True
    if op_of(node) != "matmul":
        return False
    found = _softmax_behind(arg(node, "input"))
    return found is not None and _reaches_score_matmul(arg(found[0], "input"))


def _softmax_behind(node: object) -> tuple[fx.Node, list[fx.Node]] | None:
    """The softmax ``node`` comes from and the nodes in between (nearest first)."""
    path = []
    while isinstance(node, fx.Node) and len(path) <= _MAX_PROBS_STEPS:
        op = op_of(node)
        if op == "softmax":
            return node, path
        if op not in _PROBS_OPS:
            return None
        path.append(node)
        node = _tensor_operand(node)
    return None


def _tensor_operand(node: fx.Node) -> object:
    """The one tensor a unary step reads (for a binary op, its tensor side)."""
    if op_of(node) in ("mul", "div"):
        a, b = arg(node, "input"), arg(node, "other")
        return a if isinstance(fake(a), torch.Tensor) else b
    return node.args[0] if node.args else arg(node, "input")


def read_attention(anchor: fx.Node) -> Attention | str:
    """The anchor's attention in SDPA's terms, or why it is none."""
    if op_of(anchor) == SDPA:
        return Attention(anchor, arg(anchor, "query"), arg(anchor, "key"), arg(anchor, "value"),
                         arg(anchor, "attn_mask"), bool(arg(anchor, "is_causal", False)),
                         arg(anchor, "scale"), arg(anchor, "dropout_p", 0.0),
                         bool(arg(anchor, "enable_gqa", False)),
                         extra_args=tuple(extra_kwargs(anchor)))
    if op_of(anchor) == "matmul":
        return _read_explicit(anchor)
    return f"{describe(anchor)} is neither scaled_dot_product_attention nor matmul(softmax, v)"


def _scalar(value: object) -> float | None:
    """A compile-time scale: a Python number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _scale_factor(node: fx.Node) -> tuple[object, float] | None:
    """(tensor operand, factor) when ``node`` multiplies or divides a tensor by a constant."""
    op = op_of(node)
    if op not in ("mul", "div"):
        return None
    a, b = arg(node, "input"), arg(node, "other")
    if op == "mul" and _scalar(a) is not None and isinstance(b, fx.Node):
        a, b = b, a
    factor = _scalar(b)
    if not isinstance(a, fx.Node) or factor is None or factor == 0 or not math.isfinite(factor):
        return None
    return a, (factor if op == "mul" else 1.0 / factor)


def _precision(dtype: torch.dtype) -> int:
    return {torch.float64: 3, torch.float32: 2}.get(dtype, 1)


@dataclass
class _Reader:
    """The state of one backward walk over an explicit attention."""

    anchor: fx.Node
    nodes: set[fx.Node] = field(default_factory=set)
    steps: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    softcap_problems: list[str] = field(default_factory=list)
    scale: float = 1.0
    softcap: float | None = None
    mask: fx.Node | None = None
    dropout: object = 0.0
    stage: int = 0  # backwards: 0 mask, 1 soft cap, 2 scales, then the score matmul

    def note(self, node: fx.Node, step: str) -> None:
        self.nodes.add(node)
        self.steps.append(step)

    def cast(self, node: fx.Node, query_dtype: torch.dtype, what: str) -> None:
        dtype = fake(node).dtype
        self.note(node, f"to({dtype_name(dtype)})")
        if _precision(dtype) < _precision(query_dtype) or dtype.is_floating_point is False:
            self.problems.append(f"{describe(node)} casts the {what} to {dtype_name(dtype)}, "
                                 f"below the {dtype_name(query_dtype)} query (lossy)")

    def later_than(self, stage: int, node: fx.Node, what: str) -> None:
        """A step of ``stage`` met after (i.e. written before) a later-stage step."""
        if self.stage > stage:
            order = {1: "the soft cap", 2: "the scale"}[self.stage]
            self.problems.append(f"{describe(node)}: {what} comes before {order}; the op "
                                 "applies the scale, then the soft cap, then the mask")
        self.stage = max(self.stage, stage)


def _read_probs(r: _Reader, anchor: fx.Node, query_dtype: torch.dtype) -> fx.Node | str:
    """From the final matmul back to the softmax: casts, dropout; a scale here is a problem."""
    found = _softmax_behind(arg(anchor, "input"))
    if found is None:
        return f"{describe(arg(anchor, 'input'))} is not a softmax's output"
    softmax, path = found
    for node in path:
        op = op_of(node)
        if op == "dropout":
            r.note(node, "dropout")
            training = node.kwargs.get("train", arg(node, "training", True))
            p = arg(node, "p", 0.5)
            if training is False:
                continue
            r.dropout = training if isinstance(training, fx.Node) and p != 0 else p
        elif op in ("mul", "div"):
            r.note(node, op)
            r.problems.append(f"{describe(node)} scales the probabilities after the softmax; "
                              "the op's weights sum to 1")
        elif op == "cast":
            r.cast(node, query_dtype, "probabilities")
        else:
            r.note(node, op)
    r.note(softmax, f"softmax({dtype_name(fake(softmax).dtype)})")
    rank, dim = fake(softmax).dim(), arg(softmax, "dim")
    if not isinstance(dim, int) or dim % rank != rank - 1:
        r.problems.append(f"{describe(softmax)} normalises over dim {dim}, not the key dim "
                          f"(-1 of {rank})")
    if _precision(fake(softmax).dtype) < _precision(query_dtype):
        r.problems.append(f"{describe(softmax)} runs in {dtype_name(fake(softmax).dtype)}, "
                          f"below the {dtype_name(query_dtype)} query")
    return softmax


def _reaches_score_matmul(node: object, depth: int = 12) -> bool:
    """Whether ``node`` is computed from a matmul through score steps (which operand of an
    add is the scores, which the mask)."""
    while isinstance(node, fx.Node) and depth > 0:
        op = op_of(node)
        if op == "matmul":
            return True
        if op == "add":
            return any(_reaches_score_matmul(a, depth - 1)
                       for a in (arg(node, "input"), arg(node, "other")))
        if op not in ("cast", "mul", "div", "tanh", "contiguous", "masked_fill"):
            return False
        node, depth = _tensor_operand(node), depth - 1
    return False


def _read_softcap(r: _Reader, node: fx.Node) -> object:
    """``c * tanh(s / c)`` (either operand order, s / c as s * (1 / c) too); returns s."""
    a, b = arg(node, "input"), arg(node, "other")
    tanh, outer = (a, _scalar(b)) if op_of(a) == "tanh" else (b, _scalar(a))
    inner = _scale_factor(tanh.args[0]) if isinstance(tanh.args[0], fx.Node) else None
    r.note(node, "*c")
    r.note(tanh, "tanh")
    r.later_than(1, node, "the soft cap")
    if outer is None or inner is None:
        r.softcap_problems.append(f"{describe(node)} multiplies tanh by something other than "
                                  "a constant c of c * tanh(s / c)")
        return tanh.args[0]
    scores, factor = inner
    r.note(tanh.args[0], "/c")
    if factor <= 0 or outer != 1.0 / factor and outer * factor != 1.0:
        r.softcap_problems.append(f"{describe(node)} computes {outer:g} * tanh(s / "
                                  f"{1.0 / factor:g}), not c * tanh(s / c) with one c")
    elif r.softcap is not None:
        r.softcap_problems.append(f"{describe(node)}: a second soft cap")
    else:
        r.softcap = outer
    return scores


def _read_scores(r: _Reader, node: object, query_dtype: torch.dtype) -> fx.Node | str:
    """From the softmax's input back to the score matmul: mask, soft cap, scales, casts."""
    while isinstance(node, fx.Node):
        op = op_of(node)
        if op == "matmul":
            r.note(node, "matmul(q, k^T)")
            return node
        if op == "cast":
            r.cast(node, query_dtype, "scores")
            node = node.args[0]
        elif op == "add":
            a, b = arg(node, "input"), arg(node, "other")
            scores, mask = (a, b) if _reaches_score_matmul(a) else (b, a)
            r.note(node, "+mask")
            if r.mask is not None or not isinstance(mask, fx.Node):
                r.problems.append(f"{describe(node)} adds a second mask or a constant to the "
                                  "scores; the op takes one attn_bias")
            elif r.stage > 0:
                r.later_than(0, node, "the mask")
            else:
                r.mask = mask
            node = scores
        elif op == "mul" and op_of(arg(node, "input")) == "tanh" or \
                op == "mul" and op_of(arg(node, "other")) == "tanh":
            node = _read_softcap(r, node)
        elif op == "tanh":
            r.note(node, "tanh")
            r.later_than(1, node, "the soft cap")
            r.softcap_problems.append(f"{describe(node)} is tanh(s) without the c * tanh(s / c) "
                                      "around it")
            node = node.args[0]
        elif _scale_factor(node) is not None:
            inner, factor = _scale_factor(node)
            r.note(node, f"*{factor:g}")
            r.later_than(2, node, "the scale")
            r.scale *= factor
            node = inner
        elif op == "masked_fill":
            return (f"{describe(node)} fills the scores in place of an additive mask; "
                    "write scores + torch.where(keep, 0, -inf) for the op to take it")
        else:
            return (f"the scores reaching the softmax come from {describe(node)}, not from "
                    "matmul(q, k^T) through a scale, a soft cap and a mask")
    return f"the scores reaching the softmax come from {describe(node)}"


def _read_explicit(anchor: fx.Node) -> Attention | str:
    r = _Reader(anchor)
    r.note(anchor, "matmul(p, v)")
    value = arg(anchor, "other")
    out = fake(anchor)
    if not isinstance(out, torch.Tensor) or not isinstance(value, fx.Node):
        return f"{describe(anchor)} has no recorded value"
    softmax = _read_probs(r, anchor, out.dtype)
    if isinstance(softmax, str):
        return softmax
    scores = _read_scores(r, arg(softmax, "input"), out.dtype)
    if isinstance(scores, str):
        return scores
    query, key_t = arg(scores, "input"), arg(scores, "other")
    while isinstance(query, fx.Node) and _scale_factor(query) is not None:  # q * scale first
        inner, factor = _scale_factor(query)
        r.note(query, f"q*{factor:g}")
        r.scale *= factor
        query = inner
    if not isinstance(query, fx.Node) or not isinstance(key_t, fx.Node):
        return f"{describe(scores)} multiplies a non-tensor"
    explicit = Explicit(frozenset(r.nodes), tuple(reversed(r.steps)),
                        "; ".join(r.problems) or None, "; ".join(r.softcap_problems) or None)
    # matmul broadcasts a single K/V head over the query heads, which is GQA's reading
    return Attention(anchor, query, key_t, value, r.mask, False, r.scale, r.dropout, True,
                     r.softcap, explicit)

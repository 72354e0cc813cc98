"""One table that names the ops of a Dynamo (torch-level) FX graph, whatever their spelling.

``x.transpose(1, 2)`` arrives as call_method, ``torch.transpose(x, 1, 2)`` as call_function;
both are "transpose" here, and ``arg(node, "dim0")`` reads their arguments the same way.
A new spelling is one more ``OpForm``; layout ops declare theirs next to their rule
(layout.py), so each op is named in one place.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

SDPA = "scaled_dot_product_attention"


@dataclass(frozen=True)
class OpForm:
    """A normalised op: the functions and method names that spell it, its argument names in
    call order ("input" is self for a method), and optionally a test a node must also pass
    (e.g. ``view`` with a dtype is another op than ``view`` with sizes)."""

    name: str
    functions: tuple[Any, ...] = ()
    methods: tuple[str, ...] = ()
    signature: tuple[str, ...] = ("input",)
    when: Callable[[fx.Node], bool] | None = None


_FUNCTIONS: dict[Any, list[OpForm]] = {}
_METHODS: dict[str, list[OpForm]] = {}
_SIGNATURES: dict[str, tuple[str, ...]] = {}


def register_op(form: OpForm) -> None:
    """Add ``form``'s spellings; a form with a ``when`` test is tried before plain ones."""
    for table, keys in ((_FUNCTIONS, form.functions), (_METHODS, form.methods)):
        for key in keys:
            forms = table.setdefault(key, [])
            forms.insert(0 if form.when is not None else len(forms), form)
    _SIGNATURES[form.name] = form.signature


def _reinterprets_dtype(node: fx.Node) -> bool:
    """``x.view(torch.uint8)``: the same bytes read as another dtype, not a reshape."""
    return any(isinstance(a, torch.dtype) for a in (*node.args[1:2], node.kwargs.get("dtype")))


def _true_division(node: fx.Node) -> bool:
    """``torch.div`` with a rounding mode is not a division by a scale."""
    return node.kwargs.get("rounding_mode") is None and len(node.args) <= 2


_BINARY = ("input", "other")
for _form in (
    OpForm(SDPA, (torch.nn.functional.scaled_dot_product_attention,
                  torch._C._nn.scaled_dot_product_attention),
           signature=("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
                      "enable_gqa")),
    OpForm("getitem", (operator.getitem,), ("__getitem__",), ("input", "index")),
    OpForm("view_dtype", methods=("view",), signature=("input", "dtype"),
           when=_reinterprets_dtype),
    OpForm("index_select", (torch.index_select,), ("index_select",), ("input", "dim", "index")),
    OpForm("gather", (torch.gather,), ("gather",), ("input", "dim", "index")),
    OpForm("take_along_dim", (torch.take_along_dim,), ("take_along_dim",),
           ("input", "indices", "dim")),
    OpForm("take", (torch.take,), ("take",), ("input", "index")),
    OpForm("cast", methods=("to", "type", "type_as", "float", "half", "bfloat16", "double",
                            "long", "int")),
    OpForm("mul", (operator.mul, torch.mul), ("mul", "__mul__", "__rmul__"), _BINARY),
    OpForm("div", (operator.truediv, torch.div, torch.true_divide),
           ("div", "true_divide", "__truediv__"), _BINARY, when=_true_division),
    OpForm("add", (operator.add, torch.add), ("add", "__add__", "__radd__"), _BINARY),
    OpForm("sub", (operator.sub, torch.sub), ("sub", "__sub__"), _BINARY),
    OpForm("neg", (operator.neg, torch.neg), ("neg", "__neg__")),
    OpForm("lt", (operator.lt, torch.lt), ("lt", "__lt__"), _BINARY),
    OpForm("le", (operator.le, torch.le), ("le", "__le__"), _BINARY),
    OpForm("gt", (operator.gt, torch.gt), ("gt", "__gt__"), _BINARY),
    OpForm("ge", (operator.ge, torch.ge), ("ge", "__ge__"), _BINARY),
    OpForm("logical_not", (operator.invert, torch.logical_not, torch.bitwise_not),
           ("logical_not", "bitwise_not", "__invert__")),
    OpForm("logical_and", (operator.and_, torch.logical_and, torch.bitwise_and),
           ("logical_and", "bitwise_and", "__and__"), _BINARY),
    OpForm("where", (torch.where,), signature=("condition", "input", "other")),
    OpForm("masked_fill", (torch.masked_fill,), ("masked_fill",), ("input", "mask", "value")),
    OpForm("arange", (torch.arange,), signature=("end",)),
    OpForm("matmul", (operator.matmul, torch.matmul), ("matmul", "__matmul__"), _BINARY),
    # The dtype argument sits at different positions in F.softmax and torch.softmax; what it
    # did is read off the output's fake dtype instead.
    OpForm("softmax", (torch.nn.functional.softmax, torch.softmax, torch.special.softmax),
           ("softmax",), ("input", "dim")),
    OpForm("tanh", (torch.tanh, torch.nn.functional.tanh), ("tanh",)),
    OpForm("dropout", (torch.nn.functional.dropout, torch.dropout),
           signature=("input", "p", "training")),
    OpForm("zeros", (torch.zeros,), ("new_zeros",), ("size",)),
    OpForm("zeros_like", (torch.zeros_like,)),
    OpForm("full", (torch.full,), signature=("size", "fill_value")),
):
    register_op(_form)


def op_of(node: object) -> str | None:
    """The normalised name of what ``node`` computes, or None for anything unknown."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        forms = _METHODS.get(node.target, ())
    elif node.op == "call_function":
        try:
            forms = _FUNCTIONS.get(node.target, ())
        except TypeError:  # unhashable target
            return None
    else:
        return None
    return next((f.name for f in forms if f.when is None or f.when(node)), None)


def arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of ``node``, positional or keyword, per the op's signature."""
    names = _SIGNATURES[op_of(node)]
    i = names.index(name)
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, node.kwargs.get("self" if name == "input" else name, default))


def extra_kwargs(node: fx.Node) -> list[str]:
    """Keyword arguments the op's signature does not know (e.g. a future SDPA option)."""
    names = set(_SIGNATURES[op_of(node)])
    return sorted(k for k in node.kwargs if k not in names)


def fake(node: object) -> Any:
    """The fake value Dynamo (or a later trace) recorded for ``node``; None if there is none."""
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta
    return meta.get("example_value", meta.get("val"))


def describe(node: object) -> str:
    """A short human name for a node, for reasons in the report."""
    if not isinstance(node, fx.Node):
        return repr(node)
    what = op_of(node) or (node.target if isinstance(node.target, str) else
                           getattr(node.target, "__name__", str(node.target)))
    return f"{node.name} ({what})" if node.op.startswith("call") else f"{node.name} ({node.op})"

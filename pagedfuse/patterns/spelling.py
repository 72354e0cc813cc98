"""One table that names the ops of a Dynamo (torch-level) FX graph, whatever their spelling.

``x.transpose(1, 2)`` arrives as call_method, ``torch.transpose(x, 1, 2)`` as call_function;
both are "transpose" here, and ``arg(node, "dim0")`` reads their arguments the same way.
A new spelling is one more line in a table.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

SDPA = "scaled_dot_product_attention"

_FUNCTIONS: dict[Any, str] = {
    torch.nn.functional.scaled_dot_product_attention: SDPA,
    torch._C._nn.scaled_dot_product_attention: SDPA,
    operator.getitem: "getitem",
    torch.index_select: "index_select",
    torch.gather: "gather",
    torch.take_along_dim: "take_along_dim",
    torch.reshape: "reshape",
    torch.flatten: "flatten",
    torch.unflatten: "unflatten",
    torch.squeeze: "squeeze",
    torch.unsqueeze: "unsqueeze",
    torch.transpose: "transpose",
    torch.swapaxes: "transpose",
    torch.swapdims: "transpose",
    torch.permute: "permute",
    torch.repeat_interleave: "repeat_interleave",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.add: "add",
    torch.add: "add",
    torch.take: "take",
    operator.lt: "lt",
    torch.lt: "lt",
    operator.gt: "gt",
    torch.gt: "gt",
    operator.ge: "ge",
    torch.ge: "ge",
    operator.invert: "logical_not",
    torch.logical_not: "logical_not",
    torch.bitwise_not: "logical_not",
    torch.where: "where",
    torch.masked_fill: "masked_fill",
    torch.arange: "arange",
    torch.zeros: "zeros",
    torch.zeros_like: "zeros_like",
    torch.full: "full",
}

_METHODS: dict[str, str] = {
    "view": "reshape",
    "reshape": "reshape",
    "flatten": "flatten",
    "unflatten": "unflatten",
    "squeeze": "squeeze",
    "unsqueeze": "unsqueeze",
    "transpose": "transpose",
    "swapaxes": "transpose",
    "swapdims": "transpose",
    "permute": "permute",
    "contiguous": "contiguous",
    "clone": "contiguous",
    "expand": "expand",
    "repeat_interleave": "repeat_interleave",
    "index_select": "index_select",
    "gather": "gather",
    "take_along_dim": "take_along_dim",
    "__getitem__": "getitem",
    "to": "cast",
    "type": "cast",
    "float": "cast",
    "half": "cast",
    "bfloat16": "cast",
    "mul": "mul",
    "__mul__": "mul",
    "__rmul__": "mul",
    "add": "add",
    "__add__": "add",
    "__radd__": "add",
    "take": "take",
    "lt": "lt",
    "gt": "gt",
    "ge": "ge",
    "logical_not": "logical_not",
    "bitwise_not": "logical_not",
    "__invert__": "logical_not",
    "masked_fill": "masked_fill",
    "new_zeros": "zeros",
}

# Argument names in call order (for call_method, "input" is self).
_SIGNATURES: dict[str, tuple[str, ...]] = {
    SDPA: ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
           "enable_gqa"),
    "getitem": ("input", "index"),
    "index_select": ("input", "dim", "index"),
    "gather": ("input", "dim", "index"),
    "take_along_dim": ("input", "indices", "dim"),
    "transpose": ("input", "dim0", "dim1"),
    "repeat_interleave": ("input", "repeats", "dim"),
    "mul": ("input", "other"),
    "add": ("input", "other"),
    "take": ("input", "index"),
    "lt": ("input", "other"),
    "gt": ("input", "other"),
    "ge": ("input", "other"),
    "logical_not": ("input",),
    "where": ("condition", "input", "other"),
    "masked_fill": ("input", "mask", "value"),
    "full": ("size", "fill_value"),
}


def op_of(node: object) -> str | None:
    """The normalised name of what ``node`` computes, or None for anything unknown."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        return _METHODS.get(node.target)
    if node.op == "call_function":
        try:
            return _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
    return None


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


def is_mutation(node: fx.Node) -> bool:
    """An in-place op (``x.index_copy_(...)``, ``x[i] = y``): it has effects but no users."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and isinstance(name, str) and (
        name == "setitem" or name.endswith("_") and not name.startswith("__"))


def has_effects(node: fx.Node) -> bool:
    """In place, or impure to FX (e.g. random): never erased as dead, never one value with a
    look-alike."""
    return is_mutation(node) or node.op == "call_function" and node.is_impure()


def describe(node: object) -> str:
    """A short human name for a node, for reasons in the report."""
    if not isinstance(node, fx.Node):
        return repr(node)
    what = op_of(node) or (node.target if isinstance(node.target, str) else
                           getattr(node.target, "__name__", str(node.target)))
    return f"{node.name} ({what})" if node.op.startswith("call") else f"{node.name} ({node.op})"


def same_value(a: object, b: object) -> bool:
    """``a`` and ``b`` compute the same value: the same node, or the same pure op applied to
    the same arguments (e.g. ``bt.long()`` written once for K and once for V)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return type(a) is type(b) and not isinstance(a, fx.Node) and a == b
    if a.op != b.op or a.target != b.target or a.op not in ("call_function", "call_method") \
            or a.kwargs.keys() != b.kwargs.keys() or len(a.args) != len(b.args):
        return False
    if has_effects(a) or op_of(a) is None and a.op == "call_method":
        return False  # in-place, random or unknown: not provably the same value
    pairs = list(zip(a.args, b.args, strict=True)) + [(a.kwargs[k], b.kwargs[k]) for k in a.kwargs]
    return all(_same_arg(x, y) for x, y in pairs)


def _same_arg(x: object, y: object) -> bool:
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_same_arg(i, j) for i, j in zip(x, y, strict=True))
    return same_value(x, y)

"""Which nodes may write memory, and which memory: an alias analysis over one FX graph.

A node writes the arguments its schema marks mutable (custom ops declared with
``mutates_args`` included), its ``out=`` tensors, ``self`` for an in-place method or
``operator.i*``/``setitem``, and ``input`` under ``inplace=True``. A call whose effects
cannot be told (a user function, a submodule, a higher-order op) may write anything.
Memory is compared by storage, read off the fake values Dynamo records, so views,
``narrow``/``select``/``unbind``/``as_strided`` pieces and the base a view came from all
alias one another. One pass over the graph builds the index (``GraphEffects``); each
question after that costs a binary search.
"""

from __future__ import annotations

import bisect
import operator
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.fx as fx

from pagedfuse.graph.ops import fake, op_of

# Storage identity of a tensor; None stands for "some memory we cannot name".
StorageKey = int | None

_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand,
    operator.ior, operator.ixor, operator.ilshift, operator.irshift})
# Functions that write without saying so in their name (running statistics in training;
# where they sit depends on the spelling): taken to write every tensor argument.
_HIDDEN_WRITES = frozenset({"batch_norm", "instance_norm"})
_PURE_MODULES = ("torch", "_operator", "operator", "math", "builtins")


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _in_place_name(name: str) -> bool:
    """``add_``, ``index_copy_``, ``__iadd__``, ``__setitem__``: named as writing ``self``."""
    if _is_dunder(name):
        return name == "__setitem__" or name.startswith("__i") and name not in (
            "__invert__", "__index__", "__int__", "__iter__", "__init__")
    return name.endswith("_")


def _schema_writes(node: fx.Node, target: torch._ops.OpOverload) -> list[object]:
    """Arguments a torch.library schema marks as written (``Tensor(a!)``)."""
    written = []
    for i, a in enumerate(target._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if a.name in node.kwargs:
            written.append(node.kwargs[a.name])
        elif i < len(node.args) and not a.kwarg_only:
            written.append(node.args[i])
    return written


def _known_torch_callable(target: object) -> bool:
    module = getattr(target, "__module__", None) or ""
    if module.split(".")[0] in _PURE_MODULES:
        return True
    owner = getattr(target, "__objclass__", None)  # e.g. torch.Tensor.add_
    return isinstance(owner, type) and issubclass(owner, torch._C.TensorBase)


def written_args(node: fx.Node) -> list[object] | None:
    """The arguments ``node`` writes in place; None when its effects are unknown."""
    if node.op in ("placeholder", "get_attr", "output"):
        return []
    if node.op == "call_module":
        return None
    target = node.target
    if node.op == "call_function":
        if isinstance(target, torch._ops.OpOverload):
            return _schema_writes(node, target)
        if isinstance(target, torch._ops.OpOverloadPacket):
            return [a for name in target.overloads()
                    for a in _schema_writes(node, getattr(target, name))]
        if isinstance(target, torch._ops.HigherOrderOperator):
            return None
        if target in _IN_PLACE_OPERATORS:
            return [node.args[0]]
        if getattr(target, "__module__", None) in ("operator", "_operator"):
            return []  # the in-place ones are above; ``and_`` and ``or_`` only look like them
        if not _known_torch_callable(target):
            return None
        name = getattr(target, "__name__", "")
    else:
        name = target
    written: list[object] = []
    if _in_place_name(name) or node.kwargs.get("inplace") is True:
        written.append(node.args[0] if node.args else node.kwargs.get("input"))
    if "out" in node.kwargs:
        written.append(node.kwargs["out"])
    if name in _HIDDEN_WRITES:
        written.extend(node.all_input_nodes)
    return written


def storages(value: object) -> set[StorageKey]:
    """The storages a (fake) tensor or a collection of them lives in; None for a tensor
    whose storage cannot be named."""
    if isinstance(value, torch.Tensor):
        try:
            return {value.untyped_storage()._cdata}
        except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
            return {None}
    if isinstance(value, (tuple, list)):
        return set().union(*(storages(v) for v in value))
    return set()


def node_storages(node: object) -> set[StorageKey]:
    """The storages ``node``'s value lives in (a tuple/list of nodes: all of them); {None}
    for a node without a recorded value, which may be any memory."""
    if isinstance(node, (tuple, list)):
        return set().union(*(node_storages(n) for n in node))
    if not isinstance(node, fx.Node):
        return set()
    value = fake(node)
    if value is None and node.op != "output":
        return {None}
    return storages(value)


class GraphEffects:
    """Every write in one graph, by storage and position, built in one pass."""

    def __init__(self, graph: fx.Graph) -> None:
        self.graph = graph
        self._position: dict[fx.Node, float] = {}
        self._writes: dict[StorageKey, tuple[list[float], list[fx.Node]]] = {}
        self._owner: dict[StorageKey, fx.Node] = {}
        for i, node in enumerate(graph.nodes):
            self._add(node, float(i))

    def _add(self, node: fx.Node, position: float) -> None:
        self._position[node] = position
        for key in node_storages(node) - {None}:
            self._owner.setdefault(key, node)
        written = written_args(node)
        keys = {None} if written is None else node_storages(written)
        for key in keys:
            positions, nodes = self._writes.setdefault(key, ([], []))
            at = bisect.bisect(positions, position)
            positions.insert(at, position)
            nodes.insert(at, node)

    def note_inserted(self, nodes: Iterable[fx.Node], before: fx.Node) -> None:
        """Index nodes inserted right before ``before`` after the pass (a replacement)."""
        for node in nodes:
            self._add(node, self._position[before] - 0.5)

    def position(self, node: fx.Node) -> float:
        return self._position[node]

    def written_inputs(self) -> list[int]:
        """Indices of the graph's placeholders whose memory the graph may write."""
        inputs = [n for n in self.graph.nodes if n.op == "placeholder"]
        return [i for i, node in enumerate(inputs)
                if self.first_write(node_storages(node), node) is not None]

    def owner(self, key: StorageKey) -> fx.Node | None:
        """The first node whose value lives in storage ``key`` (e.g. the placeholder a view
        came from): the name to give a reader."""
        return self._owner.get(key)

    def _between(self, key: StorageKey, after: float, before: float) -> Iterator[fx.Node]:
        positions, nodes = self._writes.get(key, ((), ()))
        start = bisect.bisect_right(positions, after)
        end = bisect.bisect_left(positions, before)
        return iter(nodes[start:end])

    def first_write(self, keys: set[StorageKey], after: fx.Node | float,
                    before: fx.Node | float | None = None) -> fx.Node | None:
        """The first node strictly between ``after`` and ``before`` (default: the graph's
        end) that may write memory in ``keys``: a write to one of them, to a storage it
        cannot name, or a call with unknown effects. A key of None matches any write."""
        lo = after if isinstance(after, float) else self._position[after]
        hi = before if isinstance(before, float) else (
            float("inf") if before is None else self._position[before])
        if None in keys:
            found = [n for key in self._writes for n in self._between(key, lo, hi)]
        else:
            found = [n for key in keys | {None} for n in self._between(key, lo, hi)]
        return min(found, key=self._position.__getitem__, default=None)


_active: weakref.WeakKeyDictionary[fx.Graph, GraphEffects] = weakref.WeakKeyDictionary()


@contextmanager
def tracking(graph: fx.Graph) -> Iterator[GraphEffects]:
    """Share one index of ``graph`` with every question asked inside the block (the engine
    opens one per graph; it notes the nodes it inserts)."""
    effects = GraphEffects(graph)
    _active[graph] = effects
    try:
        yield effects
    finally:
        _active.pop(graph, None)


def effects_of(graph: fx.Graph) -> GraphEffects:
    """The shared index inside ``tracking(graph)``, else a fresh one."""
    return _active.get(graph) or GraphEffects(graph)


def has_effects(node: fx.Node) -> bool:
    """May write memory, or impure to FX (e.g. random): never erased as dead, never one
    value with a look-alike."""
    return written_args(node) != [] or node.op == "call_function" and node.is_impure()


def same_value(a: object, b: object) -> bool:
    """``a`` and ``b`` hold the same value where they are computed: the same node, or the
    same known pure op applied to the same values (e.g. ``bt.long()`` written once for K and
    once for V) with no write in between to the memory they read, and neither written later.
    Two reads of one node at different times are the caller's to compare (see
    region.stale_reads)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return type(a) is type(b) and not isinstance(a, fx.Node) and a == b
    if a.op != b.op or a.target != b.target or a.op not in ("call_function", "call_method") \
            or a.kwargs.keys() != b.kwargs.keys() or len(a.args) != len(b.args):
        return False
    if op_of(a) is None or has_effects(a):
        return False  # unknown, in-place or random: not provably the same value
    effects = effects_of(a.graph)
    first, last = sorted((a, b), key=effects.position)
    if effects.first_write(node_storages(a) | node_storages(b), first) is not None:
        return False
    pairs = [*zip(a.args, b.args, strict=True), *((a.kwargs[k], b.kwargs[k]) for k in a.kwargs)]
    return all(_same_argument(x, y, effects, first, last) for x, y in pairs)


def _same_argument(x: object, y: object, effects: GraphEffects, first: fx.Node,
                   last: fx.Node) -> bool:
    """One argument of two look-alike calls at ``first`` and ``last``: one node not written
    in between, two nodes holding the same value, or equal constants."""
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_same_argument(i, j, effects, first, last)
                                        for i, j in zip(x, y, strict=True))
    if x is y and isinstance(x, fx.Node):
        return effects.first_write(node_storages(x), first, last) is None
    return same_value(x, y)

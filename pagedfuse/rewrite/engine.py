"""Rewrite one graph: for each anchor, try the patterns anchored there in order; the first that
matches and passes every precondition replaces the site. A site no pattern takes stays exactly as
it was (a pattern that raises is reported, and anything it inserted is removed)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from pagedfuse.graph.effects import GraphEffects, has_effects, tracking
from pagedfuse.graph.layout import same_size
from pagedfuse.graph.ops import fake
from pagedfuse.patterns.base import Check, Match, Pattern
from pagedfuse.rewrite.anchors import find_anchors, site_name
from pagedfuse.rewrite.report import Report, SiteReport


@dataclass(frozen=True)
class Swap:
    """A rewritten site: the anchor's name in the original graph and the node replacing it."""

    report: SiteReport
    anchor_name: str
    replacement: fx.Node


def rewrite_graph(gm: fx.GraphModule, patterns: Sequence[Pattern],
                  graph_name: str = "") -> tuple[Report, list[Swap]]:
    """Every site of ``gm`` in graph order; one effects index serves them all (a site's own
    work is local to it, so the whole rewrite stays linear in the graph)."""
    report, swaps = Report(graph=graph_name), []
    with tracking(gm.graph) as effects:
        for anchor in find_anchors(gm.graph, patterns):
            site, new = _rewrite_site(gm, effects, anchor, patterns)
            report.sites.append(site)
            if new is not None:
                swaps.append(Swap(site, anchor.name, new))
    if swaps:
        gm.graph.lint()
        gm.recompile()
    return report, swaps


def _attempt(pattern: Pattern, anchor: fx.Node) -> tuple[Match | None, list[Check]]:
    """The match (None unless every check passed) and the checks to report."""
    try:
        match = pattern.match(anchor)
        if isinstance(match, str):
            return None, [Check("match", False, match)]
        checks = pattern.check(match)
    except Exception as exc:  # a buggy pattern must not break compilation
        return None, [Check("match", False, f"pattern {pattern.name} raised {exc!r}")]
    return (match if all(c.passed for c in checks) else None), checks


def _rewrite_site(gm: fx.GraphModule, effects: GraphEffects, anchor: fx.Node,
                  patterns: Sequence[Pattern]) -> tuple[SiteReport, fx.Node | None]:
    name = site_name(anchor)
    tried: list[SiteReport] = []
    for pattern in (p for p in patterns if p.anchor(anchor)):
        match, checks = _attempt(pattern, anchor)
        new = _replace(gm, effects, pattern, match) if match is not None else None
        if isinstance(new, fx.Node):
            return SiteReport(name, pattern.name, checks, match.replacement, True), new
        if isinstance(new, str):
            checks = checks + [Check("replace", False, new)]
        tried.append(SiteReport(name, pattern.name, checks))
    if not tried:
        return SiteReport(name, None), None
    # Report the pattern that got furthest: one that matched (and failed a check) if any.
    return next((t for t in tried if t.checks[0].passed), tried[0]), None


@contextmanager
def _created(gm: fx.GraphModule) -> Iterator[list[fx.Node]]:
    """The nodes created in ``gm``'s graph inside the block, in creation order."""
    created: list[fx.Node] = []
    hook = created.append
    gm._register_create_node_hook(hook)
    try:
        yield created
    finally:
        gm._unregister_create_node_hook(hook)


def _replace(gm: fx.GraphModule, effects: GraphEffects, pattern: Pattern,
             match: Match) -> fx.Node | str:
    """Insert the replacement, trace it with fake tensors (so the op's own fake impl checks
    its arguments at compile time) and swap it in; on any failure remove what was inserted."""
    graph = gm.graph
    with _created(gm) as inserted:
        try:
            new = pattern.replace(graph, match)
            if not isinstance(new, fx.Node):
                raise TypeError(f"replace returned {type(new).__name__}, not an fx.Node")
            _trace_fake(inserted, match.anchor)
            _same_output(new, match.anchor)
        except Exception as exc:
            for node in reversed(inserted):
                graph.erase_node(node)
            return f"pattern {pattern.name} failed to build its replacement: {exc}"
    effects.note_inserted(inserted, match.anchor)
    match.anchor.replace_all_uses_with(new)
    _erase_dead(graph, match.anchor)
    return new


def _trace_fake(nodes: list[fx.Node], anchor: fx.Node) -> None:
    """Record ``example_value`` for the inserted nodes, as Dynamo does for its own, under the
    fake mode (and shape environment) of the graph."""
    anchor_value = fake(anchor)
    if not isinstance(anchor_value, FakeTensor):
        return  # a graph without fake values: nothing to check against
    with anchor_value.fake_mode:
        for node in nodes:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), fake)
            if node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                value = node.target(*args, **kwargs)
            node.meta["example_value"] = value


def _same_output(new: fx.Node, anchor: fx.Node) -> None:
    got, want = fake(new), fake(anchor)
    if not isinstance(want, torch.Tensor):
        return
    if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.dim() != want.dim() \
            or not all(same_size(a, b) for a, b in zip(got.shape, want.shape, strict=True)):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else got
        raise ValueError(f"the replacement gives {shape}, the attention {tuple(want.shape)} "
                         f"{want.dtype}")


def _erase_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and then whatever upstream it leaves unused. Only pure computations
    go: a generic dead-code pass would also drop in-place cache writes (no users either)."""
    todo = [node]
    while todo:
        node = todo.pop()
        if node.users or node.op not in ("call_function", "call_method") or has_effects(node):
            continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        todo.extend(inputs)

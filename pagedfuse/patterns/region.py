"""Graph questions about a matched region, answered with networkx on the FX graph."""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx
import torch.fx as fx

from pagedfuse.patterns.axes import LAYOUT_OPS
from pagedfuse.patterns.spelling import describe, is_mutation, op_of


def dataflow(graph: fx.Graph) -> nx.DiGraph:
    """Edges from each node to its users."""
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        g.add_edges_from((node, user) for user in node.users)
    return g


def escapes(graph: fx.Graph, region: set[fx.Node], sources: Iterable[fx.Node],
            sink: fx.Node) -> str | None:
    """Why replacing ``region`` (everything from ``sources`` to ``sink``) would change what
    other nodes see: a region value used outside it, or another path from a source into
    ``sink`` that bypasses the region. None when the region is self-contained."""
    g = dataflow(graph)
    for node in sorted(region, key=lambda n: n.name):
        outside = set(g.successors(node)) - region - {sink}
        if outside:
            users = ", ".join(sorted(describe(u) for u in outside))
            return f"{describe(node)} is also used by {users}, outside the attention"
    upstream = nx.ancestors(g, sink)
    for source in sources:
        bypass = (nx.descendants(g, source) & upstream) - region
        if bypass:
            first = min(bypass, key=lambda n: n.name)
            return f"{describe(source)} also reaches the attention through {describe(first)}"
    return None


def _aliases(node: fx.Node) -> set[fx.Node]:
    """``node`` and every view of it built by layout ops."""
    found, todo = {node}, [node]
    while todo:
        for user in todo.pop().users:
            if op_of(user) in LAYOUT_OPS - {"repeat_interleave", "contiguous"} and \
                    user.args and user.args[0] in found and user not in found:
                found.add(user)
                todo.append(user)
    return found


def written_between(graph: fx.Graph, tensors: Iterable[fx.Node], starts: Iterable[fx.Node],
                    end: fx.Node) -> str | None:
    """A write to one of ``tensors`` (or a view of it) placed after the first of ``starts``
    (the gathers) and before ``end``: the fused op, which reads at ``end``, would see it; the
    gather did not."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    start = min(order[s] for s in starts)
    for tensor in tensors:
        for alias in _aliases(tensor):
            for user in alias.users:
                if is_mutation(user) and start < order[user] < order[end]:
                    return (f"{describe(user)} writes {tensor.name} between the gather and "
                            "the attention")
    return None

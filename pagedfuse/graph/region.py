"""Questions about a site a pattern would replace: does a value of it escape, and did memory
it read change before the anchor reads it again? Both look only at the site's own nodes
(plus the graph's shared effects index), so checking every site of a graph stays linear."""

from __future__ import annotations

from collections.abc import Iterable

import torch.fx as fx

from pagedfuse.graph.effects import StorageKey, effects_of, node_storages, written_args
from pagedfuse.graph.ops import describe


def escapes(region: Iterable[fx.Node], sink: fx.Node) -> str | None:
    """Why replacing ``region`` (the nodes that feed only ``sink``) would change what other
    nodes see: a region value used outside it. None when the region is self-contained (then
    every path out of it leads through ``sink``)."""
    inside = set(region)
    for node in sorted(inside, key=lambda n: n.name):
        outside = set(node.users) - inside - {sink}
        if outside:
            users = ", ".join(sorted(describe(u) for u in outside))
            return f"{describe(node)} is also used by {users}, outside the attention"
    return None


def stale_reads(reads: Iterable[fx.Node], sink: fx.Node) -> str | None:
    """Why a replacement that reads the site's inputs at ``sink`` would see other values than
    the eager nodes ``reads`` saw: memory one of them read or produced is written (or may be,
    by a call with unknown effects) after that read and before ``sink``."""
    effects = effects_of(sink.graph)
    first_read: dict[StorageKey, fx.Node] = {}
    for node in sorted(reads, key=effects.position):
        for key in node_storages([node, *node.all_input_nodes]):
            first_read.setdefault(key, node)
    for key, reader in sorted(first_read.items(), key=lambda kv: effects.position(kv[1])):
        writer = effects.first_write({key}, reader, sink)
        if writer is None:
            continue
        owner = effects.owner(key)
        what = owner.name if owner is not None else "memory the attention reads"
        if written_args(writer) is None or key is None:
            return (f"{describe(writer)} may write {what} (its effects are unknown) after "
                    f"{describe(reader)} read it and before the attention")
        return (f"{describe(writer)} writes {what} after {describe(reader)} read it and "
                "before the attention")
    return None

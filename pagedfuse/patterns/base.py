"""What a pattern is: a matcher anchored on one node (by default an SDPA call), named
preconditions, a replacement.

User patterns are built from the same three pieces as the built-in one, so the engine never
needs to know which pattern it is running::

    def match(sdpa: fx.Node) -> Match | str:       # a Match, or why this site is not mine
        ...
        return Match(sdpa, "mylib.attention", "what I recognised", region, facts)

    def replace(graph: fx.Graph, m: Match) -> fx.Node:   # insert before m.anchor
        with graph.inserting_before(m.anchor):
            return graph.call_function(torch.ops.mylib.attention.default, (...))

    pagedfuse.register_pattern(Pattern("mine", match, replace,
                                       [Precondition("dtype", lambda m: None)]), first=True)

The engine runs every precondition, replaces the anchor's uses with the returned node and
removes what became dead; a site whose match or checks fail is left exactly as it was.
A pattern anchored elsewhere says so with ``anchor`` (a test of a node): the built-in one
also anchors on the final matmul of an explicit matmul-softmax-matmul attention.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from pagedfuse.graph.ops import SDPA, op_of


@dataclass(frozen=True)
class Check:
    """One precondition's verdict; ``reason`` says why in words a person understands."""

    name: str
    passed: bool
    reason: str


@dataclass
class Match:
    """A site a pattern recognised.

    ``region`` holds the nodes the replacement makes redundant (removed once they are dead),
    ``replacement`` names the op swapped in, ``description`` says what was recognised, and
    ``facts`` is the pattern's own record, handed back to its checks and its replacement.
    """

    anchor: fx.Node
    replacement: str
    description: str
    region: frozenset[fx.Node] = frozenset()
    facts: Any = None


@dataclass(frozen=True)
class Precondition:
    """A named check: ``test(match)`` returns None when it passes, else the reason it fails.

    ``passes`` is what the report shows on success (e.g. "head_dim 128").
    """

    name: str
    test: Callable[[Match], str | None]
    passes: Callable[[Match], str] = field(default=lambda match: "ok")

    def run(self, match: Match) -> Check:
        reason = self.test(match)
        if reason is None:
            return Check(self.name, True, self.passes(match))
        return Check(self.name, False, reason)


def is_sdpa(node: fx.Node) -> bool:
    return op_of(node) == SDPA


@dataclass(frozen=True)
class Pattern:
    """``match(anchor)`` returns a Match or a string saying why the site is not this pattern;
    ``replace(graph, match)`` inserts the replacement before the anchor and returns the node
    that stands in for the anchor's output. ``anchor(node)``: whether ``node`` is a site
    this pattern is tried on (each such node is one site of the report)."""

    name: str
    match: Callable[[fx.Node], Match | str]
    replace: Callable[[fx.Graph, Match], fx.Node]
    preconditions: Sequence[Precondition] = ()
    anchor: Callable[[fx.Node], bool] = is_sdpa

    def check(self, match: Match) -> list[Check]:
        return [Check("match", True, match.description)] + [
            p.run(match) for p in self.preconditions
        ]

"""Anchors: the nodes some pattern is tried on (an SDPA call, the last matmul of an explicit
attention, ...; each pattern says which), with a readable site name."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch.fx as fx

from pagedfuse.patterns.base import Pattern

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def find_anchors(graph: fx.Graph, patterns: Sequence[Pattern]) -> list[fx.Node]:
    """The nodes, in graph order, that at least one of ``patterns`` anchors on."""
    return [n for n in graph.nodes if any(p.anchor(n) for p in patterns)]


def site_name(node: fx.Node) -> str:
    """The node's name plus the user's source line, when Dynamo recorded it."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return node.name
    path, line = frames[-1]
    return f"{node.name} ({os.path.basename(path)}:{line})"

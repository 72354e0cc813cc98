"""Anchors: every scaled_dot_product_attention call in the graph, with a readable site name."""

from __future__ import annotations

import os
import re

import torch.fx as fx

from pagedfuse.graph.ops import SDPA, op_of

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def find_anchors(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if op_of(n) == SDPA]


def site_name(node: fx.Node) -> str:
    """The node's name plus the user's source line, when Dynamo recorded it."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return node.name
    path, line = frames[-1]
    return f"{node.name} ({os.path.basename(path)}:{line})"

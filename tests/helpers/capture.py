"""The capture compiler: an inner compiler that keeps every graph pagedfuse hands on and
runs it eagerly, and node counting over those graphs."""

from __future__ import annotations

import torch


def count_calls(gm: torch.fx.GraphModule, *targets: object) -> int:
    """Nodes calling one of ``targets``: a function or op overload, any overload of an op
    packet, or a method name."""
    return sum(1 for n in gm.graph.nodes
               if n.op in ("call_function", "call_method") and (
                   n.target in targets or getattr(n.target, "overloadpacket", None) in targets))


class Capture:
    """An inner compiler that keeps every graph it is handed and runs it eagerly."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __deepcopy__(self, memo: dict) -> Capture:
        return self  # transformers' CompileConfig.to_dict() deep-copies the backend

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: object):
        self.graphs.append(gm)
        return gm.forward

    def count(self, *targets: object) -> int:
        return sum(count_calls(gm, *targets) for gm in self.graphs)

    def code(self) -> str:
        return "\n".join(gm.code for gm in self.graphs)

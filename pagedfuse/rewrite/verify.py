"""Verify mode (graph replay): on the first call of a compiled graph, run the original graph
and the rewritten one eagerly on clones of the inputs (so in-place cache writes do not hit
the real buffers twice), compare each rewritten site's output with the SDPA it replaced,
record the error in the report, and raise past the tolerance. A graph that failed once is
replayed on every later call for good: it never hands back a result unchecked."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from pagedfuse.numerics import max_rel_err, site_tolerance
from pagedfuse.rewrite.engine import Swap


class VerificationError(Exception):
    """A rewritten site's output differs from the original subgraph's beyond tolerance."""


def copy_module(gm: fx.GraphModule, outputs: Sequence[str] | None = None) -> fx.GraphModule:
    """A copy of ``gm`` with its own graph; with ``outputs``, it returns those nodes' values
    instead of the graph's outputs."""
    graph = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    result = graph.graph_copy(gm.graph, mapping)
    by_name = {old.name: new for old, new in mapping.items()}
    graph.output(result if outputs is None else tuple(by_name[n] for n in outputs))
    return fx.GraphModule(gm, graph)


def _clone(args: Sequence[object]) -> list[object]:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def verifying(compiled: Callable, original: fx.GraphModule, rewritten: fx.GraphModule,
              swaps: list[Swap]) -> Callable:
    """``compiled``, preceded on its first call by the replay check of every swap."""
    before = copy_module(original, [s.anchor_name for s in swaps])
    after = copy_module(rewritten, [s.replacement.name for s in swaps])
    state = "unchecked"  # then "passed" (no more replays) or "failed" (replay every call)

    def run(*args):
        nonlocal state
        if state != "passed":
            with torch.no_grad():
                want, got = before(*_clone(args)), after(*_clone(args))
            for swap, w, g in zip(swaps, want, got, strict=True):
                err = max_rel_err(g, w, skip_nan_reference=True)
                swap.report.verify_error = err
                limit = site_tolerance(w.dtype, int8="int8" in (swap.report.replacement or ""))
                if not err <= limit:
                    state = "failed"
                    raise VerificationError(
                        f"site {swap.report.site}: {swap.report.replacement} differs from the "
                        f"original subgraph by max relative error {err:.3g} > {limit:g}")
            if state == "unchecked":
                state = "passed"
        return compiled(*args)

    return run

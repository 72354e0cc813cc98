"""The Dynamo backend: rewrite the graph, record the report, hand the graph to the inner
compiler (inductor, eager, or any ``(gm, example_inputs) -> callable``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import torch
import torch.fx as fx

from pagedfuse.doctor import warn_if_degraded
from pagedfuse.graph.effects import GraphEffects
from pagedfuse.patterns import Pattern, registered_patterns
from pagedfuse.rewrite.engine import rewrite_graph
from pagedfuse.rewrite.options import BackendOptions, PatternSpec
from pagedfuse.rewrite.report import Report, record
from pagedfuse.rewrite.verify import copy_module, verifying

Compiler = Callable[[fx.GraphModule, list], Callable]
_graph_ids = itertools.count()


def _graph_name() -> str:
    """Dynamo's compile id ("frame/attempt") when there is one, else a running number."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    return f"graph {compile_id if compile_id is not None else next(_graph_ids)}"


def backend(inner: str | Compiler | None = None, verify: bool | None = None,
            patterns: Sequence[PatternSpec] | None = None, **kwargs: Any) -> Compiler:
    """A Dynamo backend that swaps paged attention for pagedfuse ops, then runs ``inner``
    ('inductor' when not given; 'eager' or any ``(gm, example_inputs) -> callable``).

    ``verify``: replay each rewritten site against the original on first call (default off).
    ``patterns``: Pattern objects or registered names (default: the registry's). ``mode`` and
    ``options`` go to inductor; ``options`` may also hold the settings above, as it does when
    they come through ``torch.compile(..., backend="pagedfuse", options={...})``. Dynamo's own
    arguments (``fullgraph``, ``dynamic``) are accepted and ignored; any other name raises,
    listing the valid ones.
    """
    given = {k: v for k, v in dict(inner=inner, verify=verify, patterns=patterns).items()
             if v is not None}
    settings = BackendOptions.from_arguments(**given, **kwargs)
    compile_inner = settings.inner_compiler()

    def pagedfuse_compile(gm: fx.GraphModule, example_inputs: list, **_: Any) -> Callable:
        if any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
            warn_if_degraded()  # e.g. a CUDA library without code for this GPU
        original = copy_module(gm) if settings.verify else None
        report, swaps = rewrite_graph(gm, settings.patterns_now(), _graph_name())
        record(report)
        rewritten = copy_module(gm) if settings.verify and swaps else None
        compiled = compile_inner(gm, example_inputs)
        if rewritten is None:
            return compiled
        return verifying(compiled, original, rewritten, swaps)

    return pagedfuse_compile


def pagedfuse_backend(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    """The backend behind ``torch.compile(..., backend="pagedfuse")`` (the entry point), with
    ``mode`` and ``options`` from torch.compile: pagedfuse's settings and inductor's."""
    return backend(**kwargs)(gm, example_inputs)


# The reports of the graphs run during the current explain() call (None outside one).
_explained: ContextVar[list[Report] | None] = ContextVar("pagedfuse_explained", default=None)
# One explain backend per pattern list: Dynamo keys its cache by the backend object, so
# repeated explain() calls reuse the graphs they traced instead of piling up recompiles.
_explain_backends: dict[tuple[int, ...], tuple[tuple[Pattern, ...], Compiler]] = {}


def _explain_backend(patterns: tuple[Pattern, ...]) -> Compiler:
    key = tuple(id(p) for p in patterns)  # the stored tuple keeps the ids from being reused
    if key not in _explain_backends:

        def explain_compile(gm: fx.GraphModule, example_inputs: list, **_: Any) -> Callable:
            original = copy_module(gm)
            report, _ = rewrite_graph(gm, patterns, _graph_name())
            record(report)
            written = set(GraphEffects(original.graph).written_inputs())

            def run(*args: Any) -> Any:
                ran = _explained.get()
                if ran is not None and not any(r is report for r in ran):
                    ran.append(report)
                return original(*(a.clone() if i in written else a
                                  for i, a in enumerate(args)))

            return run

        _explain_backends[key] = (patterns, explain_compile)
    return _explain_backends[key][1]


# Dynamo settings for explain(): every call reports what a first compile of ``fn`` with
# these inputs reports. Without them a second call with other shapes would trace them as
# dynamic (so head_dim would fail as "dynamic"), and from the 9th distinct signature Dynamo's
# recompile limit would run ``fn`` uncompiled, with no report at all.
_EXPLAIN_DYNAMO_CONFIG = {"automatic_dynamic_shapes": False, "recompile_limit": 1 << 30,
                          "accumulated_recompile_limit": 1 << 30}


def explain(fn: Callable, *args: Any, **kwargs: Any) -> Report:
    """Trace ``fn(*args, **kwargs)`` with Dynamo and return the report of every graph it ran,
    without compiling: each graph runs as written, on copies of the inputs it writes in
    place, so the caller's tensors (caches included) are left as they were. (Python code
    between graphs, around a graph break, runs as usual.) Each call reports what a first
    compile of ``fn`` with these inputs would, whatever shapes earlier calls had."""
    ran: list[Report] = []
    token = _explained.set(ran)
    try:
        with torch._dynamo.config.patch(_EXPLAIN_DYNAMO_CONFIG):
            torch.compile(fn, backend=_explain_backend(tuple(registered_patterns())))(
                *args, **kwargs)
    finally:
        _explained.reset(token)
    return Report.merged(ran)

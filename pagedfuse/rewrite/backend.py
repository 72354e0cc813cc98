"""The Dynamo backend: rewrite the graph, record the report, hand the graph to the inner
compiler (inductor, eager, or any ``(gm, example_inputs) -> callable``)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import torch
import torch.fx as fx

from pagedfuse.graph.effects import GraphEffects
from pagedfuse.patterns import Pattern, registered_patterns
from pagedfuse.rewrite.engine import rewrite_graph
from pagedfuse.rewrite.report import Report, record
from pagedfuse.rewrite.verify import copy_module, verifying

log = logging.getLogger("pagedfuse")
Compiler = Callable[[fx.GraphModule, list], Callable]
_graph_ids = itertools.count()

# torch.compile/Dynamo options that callers (e.g. transformers' CompileConfig) pass along;
# they were already applied by Dynamo and mean nothing to the inner compiler.
_DYNAMO_OPTIONS = frozenset({"fullgraph", "dynamic", "backend"})


def _graph_name() -> str:
    """Dynamo's compile id ("frame/attempt") when there is one, else a running number."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    return f"graph {compile_id if compile_id is not None else next(_graph_ids)}"


def _inductor(mode: str | None, options: dict | None) -> Compiler:
    from torch._inductor import list_mode_options

    patches = dict(list_mode_options(mode) if mode else {})  # an unknown mode raises here
    patches.update(options or {})

    def compile_inductor(gm: fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=patches or None)

    return compile_inductor


def _inner_compiler(inner: str | Compiler, kwargs: dict[str, Any]) -> Compiler:
    mode, options = kwargs.pop("mode", None), kwargs.pop("options", None)
    ignored = sorted(k for k in kwargs if k not in _DYNAMO_OPTIONS)
    if ignored:
        log.debug("pagedfuse: ignoring backend options %s", ignored)
    if callable(inner):
        return inner
    if inner == "eager":
        return lambda gm, example_inputs: gm.forward
    if inner == "inductor":
        return _inductor(mode, options)
    raise ValueError(f"inner: expected 'inductor', 'eager' or a callable, got {inner!r}")


def backend(inner: str | Compiler = "inductor", verify: bool = False,
            patterns: Sequence[Pattern] | None = None, **kwargs: Any) -> Compiler:
    """A Dynamo backend that swaps paged attention for pagedfuse ops, then runs ``inner``.

    ``patterns`` replaces the registry's patterns for this backend; extra keyword arguments
    (``mode``, ``options``) go to inductor, and Dynamo's own (``fullgraph``, ``dynamic``)
    are accepted and ignored.
    """
    compile_inner = _inner_compiler(inner, dict(kwargs))

    def pagedfuse_compile(gm: fx.GraphModule, example_inputs: list, **_: Any) -> Callable:
        chosen = list(patterns) if patterns is not None else registered_patterns()
        original = copy_module(gm) if verify else None
        report, swaps = rewrite_graph(gm, chosen, _graph_name())
        record(report)
        rewritten = copy_module(gm) if verify and swaps else None
        compiled = compile_inner(gm, example_inputs)
        if rewritten is None:
            return compiled
        return verifying(compiled, original, rewritten, swaps)

    return pagedfuse_compile


def pagedfuse_backend(gm: fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    """The backend behind ``torch.compile(..., backend="pagedfuse")`` (the entry point):
    inductor as inner compiler, with ``mode``/``options`` from torch.compile."""
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


def explain(fn: Callable, *args: Any, **kwargs: Any) -> Report:
    """Trace ``fn(*args, **kwargs)`` with Dynamo and return the report of every graph it ran,
    without compiling: each graph runs as written, on copies of the inputs it writes in
    place, so the caller's tensors (caches included) are left as they were. (Python code
    between graphs, around a graph break, runs as usual.)"""
    ran: list[Report] = []
    token = _explained.set(ran)
    try:
        torch.compile(fn, backend=_explain_backend(tuple(registered_patterns())))(*args, **kwargs)
    finally:
        _explained.reset(token)
    return Report.merged(ran)

"""The backend's settings: one record, built from ``pagedfuse.backend(...)``'s keyword arguments
or from ``torch.compile(..., backend="pagedfuse", options={...})``.

``options`` mixes pagedfuse's own settings with inductor's config options, as Torch-TensorRT's
backend takes its settings through the same dict: a key pagedfuse knows is pagedfuse's, a key
of ``torch._inductor.config`` goes to inductor, and anything else is a mistake that raises,
naming the valid settings (a misspelt ``verfy`` must not be silently ignored).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from pagedfuse.patterns import Pattern, registered_patterns

Compiler = Callable[[fx.GraphModule, list], Callable]
PatternSpec = Pattern | str

# What each of pagedfuse's own settings means (the error for an unknown name lists them).
SETTINGS = {
    "inner": "compiler the rewritten graph goes to: 'inductor' (default), 'eager' or a "
             "callable (gm, example_inputs) -> callable",
    "verify": "replay each rewritten site against the original on its graph's first call "
              "and raise beyond the tolerance (default False)",
    "patterns": "the patterns to try, as Pattern objects or registered names (default: the "
                "registry's, in order)",
    "mode": "inductor's mode ('default', 'reduce-overhead', 'max-autotune', ...)",
    "options": "a dict of the settings above and of inductor config options",
}
# Arguments of torch.compile that callers such as transformers' CompileConfig hand on to the
# backend factory; Dynamo has applied them already, so they are accepted and mean nothing here.
DYNAMO_ARGUMENTS = frozenset({"fullgraph", "dynamic", "backend"})
INNER_COMPILERS = ("inductor", "eager")


def _inductor_option_names() -> frozenset[str]:
    from torch._inductor import list_options

    return frozenset(list_options())


def _unknown(names: Sequence[str], where: str) -> ValueError:
    valid = sorted(SETTINGS)
    hints = []
    for name in names:
        close = difflib.get_close_matches(name, valid, n=1)
        if close:
            hints.append(f"{name!r}: did you mean {close[0]!r}?")
    listed = "; ".join(f"{k}: {SETTINGS[k]}" for k in valid)
    return ValueError(
        f"pagedfuse: unknown {where} {', '.join(map(repr, names))}"
        f"{' (' + ' '.join(hints) + ')' if hints else ''}. pagedfuse's settings are {listed}. "
        "In options, inductor's config options are accepted too (torch._inductor.list_options()).")


def resolve_patterns(patterns: Sequence[PatternSpec]) -> tuple[Pattern, ...]:
    """Pattern objects as given, names looked up in the registry (an unknown name raises,
    listing the registered ones)."""
    if isinstance(patterns, (str, Pattern)):
        patterns = [patterns]
    by_name = {p.name: p for p in registered_patterns()}
    chosen = []
    for p in patterns:
        if isinstance(p, Pattern):
            chosen.append(p)
        elif isinstance(p, str) and p in by_name:
            chosen.append(by_name[p])
        elif isinstance(p, str):
            raise ValueError(f"patterns: no pattern named {p!r} is registered "
                             f"(registered: {', '.join(sorted(by_name)) or 'none'})")
        else:
            raise TypeError(f"patterns: expected Pattern objects or pattern names, got "
                            f"{type(p).__name__}")
    return tuple(chosen)


@dataclass(frozen=True)
class BackendOptions:
    """Validated settings of one pagedfuse backend. ``patterns`` None: the registry's at each
    compile (so patterns registered later are used); ``inductor``: config patches for inductor."""

    inner: str | Compiler = "inductor"
    verify: bool = False
    patterns: tuple[Pattern, ...] | None = None
    mode: str | None = None
    inductor: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_arguments(cls, **kwargs: Any) -> BackendOptions:
        """Settings from ``backend()``'s keyword arguments, ``options`` split into pagedfuse's
        and inductor's; raises on an unknown name or a setting given twice."""
        unknown = [k for k in kwargs if k not in SETTINGS and k not in DYNAMO_ARGUMENTS]
        if unknown:
            raise _unknown(unknown, "backend argument" + ("s" if len(unknown) > 1 else ""))
        options = dict(kwargs.pop("options", None) or {})
        own = {k: options.pop(k) for k in list(options) if k in SETTINGS and k != "options"}
        twice = sorted(k for k in own if kwargs.get(k) is not None)
        if twice:
            raise ValueError(f"pagedfuse: {', '.join(twice)} given both as an argument and in "
                             "options")
        settings = {k: v for k, v in kwargs.items()
                    if k in SETTINGS and k != "options" and v is not None}
        settings.update(own)
        if options:
            strangers = sorted(set(options) - _inductor_option_names())
            if strangers:
                raise _unknown(strangers, "option" + ("s" if len(strangers) > 1 else ""))
        return cls._checked(inductor=options, **settings)

    @classmethod
    def _checked(cls, inner: str | Compiler = "inductor", verify: bool = False,
                 patterns: Sequence[PatternSpec] | None = None, mode: str | None = None,
                 inductor: Mapping[str, Any] | None = None) -> BackendOptions:
        if not callable(inner) and inner not in INNER_COMPILERS:
            raise ValueError(f"inner: expected 'inductor', 'eager' or a callable, got {inner!r}")
        if not isinstance(verify, bool):
            raise TypeError(f"verify: expected a bool, got {type(verify).__name__}")
        if inner != "inductor" and (inductor or mode not in (None, "default")):
            given = sorted(inductor or {}) + (["mode"] if mode not in (None, "default") else [])
            raise ValueError(f"pagedfuse: inductor settings ({', '.join(given)}) given, but "
                             f"inner is {inner!r}")
        if mode == "default":
            mode = None
        if mode is not None:
            from torch._inductor import list_mode_options

            list_mode_options(mode)  # an unknown mode raises here, naming the valid ones
        chosen = None if patterns is None else resolve_patterns(patterns)
        return cls(inner, verify, chosen, mode, dict(inductor or {}))

    def patterns_now(self) -> list[Pattern]:
        """The patterns a compile tries: the chosen ones, else the registry's at this moment."""
        return list(self.patterns) if self.patterns is not None else registered_patterns()

    def inner_compiler(self) -> Compiler:
        if callable(self.inner):
            return self.inner
        if self.inner == "eager":
            return lambda gm, example_inputs: gm.forward
        from torch._inductor import list_mode_options

        patches = {**(list_mode_options(self.mode) if self.mode else {}), **self.inductor}

        def compile_inductor(gm: fx.GraphModule, example_inputs: list) -> Callable:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs, config_patches=patches or None)

        return compile_inductor

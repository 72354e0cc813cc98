"""The pattern registry: built-in patterns and users' patterns go through the same calls.

Patterns published by other packages under the ``pagedfuse.patterns`` entry-point group are
loaded the first time the registry is read; an entry point names a Pattern, or a callable
returning one or a list of them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from importlib.metadata import entry_points

from pagedfuse.patterns.base import Pattern

ENTRY_POINT_GROUP = "pagedfuse.patterns"
_log = logging.getLogger("pagedfuse")
_patterns: list[Pattern] = []
_entry_points_loaded = False


def register_pattern(pattern: Pattern, *, first: bool = False) -> None:
    """Add ``pattern`` (tried last, or first with ``first=True``); a pattern with the same name
    is replaced."""
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern: expected a pagedfuse Pattern, got {type(pattern).__name__}")
    unregister_pattern(pattern.name)
    _patterns.insert(0 if first else len(_patterns), pattern)


def unregister_pattern(name: str) -> None:
    """Remove the pattern called ``name`` if it is registered."""
    _patterns[:] = [p for p in _patterns if p.name != name]


def registered_patterns() -> list[Pattern]:
    """The patterns in the order the backend tries them."""
    _load_entry_points()
    return list(_patterns)


def _as_patterns(obj: object) -> Iterable[Pattern]:
    if isinstance(obj, Pattern):
        return [obj]
    if callable(obj):
        return _as_patterns(obj())
    if isinstance(obj, (list, tuple)):
        return [p for item in obj for p in _as_patterns(item)]
    raise TypeError(f"expected a Pattern, a list of them or a callable returning one; "
                    f"got {type(obj).__name__}")


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            for pattern in _as_patterns(ep.load()):
                register_pattern(pattern)
        except Exception as exc:  # a broken plug-in must not break compilation
            _log.warning("pagedfuse: entry point %r of %s failed to load: %s", ep.name,
                         ENTRY_POINT_GROUP, exc)

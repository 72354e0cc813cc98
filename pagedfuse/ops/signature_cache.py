"""What a host path works out once per call signature (the op's backend choice, a launch
record, a validation verdict): an eager serving loop sees a few signatures over and over
and would otherwise redo that work on every call. A process that sees many (dynamic batch
sizes, a fuzzer, a test suite) must not grow without bound, so a cache starts over when
full, which costs only the work again."""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SignatureCache(dict[K, V]):
    """A dict that empties itself before an insert past ``limit`` entries; lookups are the
    dict's own."""

    def __init__(self, limit: int = 4096) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: K, value: V) -> V:
        """``value`` under ``key`` (the cache emptied first when full); returns ``value``."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value

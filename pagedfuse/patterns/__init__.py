"""The pattern registry and the built-in patterns (registered through the public API)."""

from pagedfuse.patterns.base import Check, Match, Pattern, Precondition
from pagedfuse.patterns.paged_sdpa import PAGED_SDPA
from pagedfuse.patterns.registry import (
    ENTRY_POINT_GROUP,
    register_pattern,
    registered_patterns,
    unregister_pattern,
)

register_pattern(PAGED_SDPA)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PAGED_SDPA",
    "Check",
    "Match",
    "Pattern",
    "Precondition",
    "register_pattern",
    "registered_patterns",
    "unregister_pattern",
]

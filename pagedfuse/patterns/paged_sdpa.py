"""The built-in pattern: SDPA over K/V gathered from a paged (or flat slot) cache."""

from __future__ import annotations

from pagedfuse.patterns.base import Pattern
from pagedfuse.patterns.paged_replace import replace_paged_sdpa
from pagedfuse.patterns.paged_site import match_paged_sdpa
from pagedfuse.patterns.preconditions import PRECONDITIONS

PAGED_SDPA = Pattern(
    name="paged_sdpa",
    match=match_paged_sdpa,
    replace=replace_paged_sdpa,
    preconditions=PRECONDITIONS,
)

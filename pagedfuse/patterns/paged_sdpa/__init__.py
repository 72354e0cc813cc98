"""The built-in pattern: attention over K/V gathered from a paged (or flat slot) cache,
spelled as SDPA or as the explicit matmul-softmax-matmul.

attention reads an anchor as SDPA's arguments (the explicit spelling included), kv_trace
walks K/V back to their gather (its ``GATHERS`` table), masks reads the mask as the op's
lengths, causal and window (its ``POSITIONS``/``COMPARES``/``ADDITIVE`` tables), site
assembles the match, preconditions holds the named checks, replace builds the op call,
sdpa_semantics asks SDPA what the op's contract leaves open.
"""

from __future__ import annotations

from pagedfuse.patterns.base import Pattern
from pagedfuse.patterns.paged_sdpa.attention import is_attention_anchor
from pagedfuse.patterns.paged_sdpa.preconditions import PRECONDITIONS
from pagedfuse.patterns.paged_sdpa.replace import replace_paged_sdpa
from pagedfuse.patterns.paged_sdpa.site import match_paged_sdpa

PAGED_SDPA = Pattern(
    name="paged_sdpa",
    match=match_paged_sdpa,
    replace=replace_paged_sdpa,
    preconditions=PRECONDITIONS,
    anchor=is_attention_anchor,
)

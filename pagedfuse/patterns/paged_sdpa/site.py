"""Recognise SDPA over K/V gathered from a paged cache: what the built-in pattern matches.

The result, a ``PagedSite``, records everything the preconditions and the replacement need,
read from fake-tensor metadata only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from pagedfuse.graph.effects import same_value
from pagedfuse.graph.layout import Layout, same_size, show
from pagedfuse.graph.ops import SDPA, arg, describe, fake, op_of
from pagedfuse.patterns.base import Match
from pagedfuse.patterns.paged_sdpa.kv_trace import Resolved, resolve, walk
from pagedfuse.patterns.paged_sdpa.masks import MaskReading, read_mask

WANT = "[batch, kv_head, block*slot, head_dim]"
# PagedSite.masking's values.
LENGTHS, TOP_LEFT_CAUSAL, AS_WRITTEN = "lengths", "top-left causal", "as written"


@dataclass(frozen=True)
class PagedSite:
    sdpa: fx.Node
    query: fx.Node
    key: Resolved
    value: Resolved
    mask: fx.Node | None
    mask_reading: MaskReading | None

    @property
    def op(self) -> str:
        return "paged_attention_int8" if self.int8 else "paged_attention"

    @property
    def int8(self) -> bool:
        return fake(self.key.trace.gather.source).dtype == torch.int8

    @property
    def index(self) -> fx.Node:
        return self.key.trace.gather.index

    @property
    def q_fake(self) -> torch.Tensor:
        return fake(self.query)

    @property
    def length_mask(self) -> bool:
        return self.mask_reading is not None and self.mask_reading.seq_lens is not None

    def reads(self) -> set[fx.Node]:
        """The nodes eager evaluates from the caches, table, scales and lengths on the way to
        the attention: eager reads those inputs there, the op only at the attention."""
        found = self.key.trace.reads() | self.value.trace.reads()
        return found | self.mask_reading.nodes if self.length_mask else found

    def size(self, atom: str) -> object:
        """Size of a K atom ("batch", "block", "slot", "head", "dim"); 1 where left out."""
        return self.key.final.size(atom)

    @property
    def masking(self) -> str:
        """How the op says SDPA's masking: LENGTHS (the mask becomes seq_lens),
        TOP_LEFT_CAUSAL (is_causal becomes a bool bias) or AS_WRITTEN (is_causal and the
        mask pass through as causal and attn_bias)."""
        if self.length_mask:
            return LENGTHS
        return TOP_LEFT_CAUSAL if self.causal_as_bias else AS_WRITTEN

    @property
    def causal_as_bias(self) -> bool:
        """SDPA's is_causal is top-left aligned, the op's bottom-right: they agree only when
        there are as many queries as keys; otherwise the mask is built as an attn_bias."""
        return bool(arg(self.sdpa, "is_causal", False)) and not same_size(
            self.q_fake.shape[2], _positions(self.key.final))

    @property
    def rep(self) -> object:
        """How many times K's heads were repeated in the graph before SDPA (1: none)."""
        heads = self.key.final.dims[1]
        return self.key.final.size(heads[-1]) if heads and heads[-1].startswith("rep") else 1


def _fits(layout: Layout) -> str | None:
    """None when ``layout`` is [batch, kv_head (x one repeat, in place), block*slot, dim]."""
    kept = dict(layout.sizes)
    present = lambda *atoms: tuple(a for a in atoms if a in kept)
    dims = layout.dims
    if len(dims) != 4:
        return f"is {show(layout)}, not {WANT}"
    heads, base = dims[1], present("head")
    grouped = heads[:len(base)] == base and len(heads) - len(base) in (0, 1) and \
        all(a.startswith("rep") for a in heads[len(base):])
    if dims[0] != present("batch") or dims[2] != present("block", "slot") or \
            dims[3] != present("dim") or not grouped:
        tiled = heads[:1] != base[:1] and heads[:1] and heads[0].startswith("rep")
        hint = " (KV heads repeated tiled, not in place)" if tiled else ""
        return f"is {show(layout)}, not {WANT}{hint}"
    return None


def match_paged_sdpa(sdpa: fx.Node) -> Match | str:
    """A Match whose facts are a PagedSite, or why ``sdpa`` is not paged attention."""
    if op_of(sdpa) != SDPA:
        return f"{describe(sdpa)} is not scaled_dot_product_attention"
    query = arg(sdpa, "query")
    q = fake(query)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return "query is not a 4-D [batch, heads, queries, head_dim] tensor"
    resolved = {}
    for what in ("key", "value"):
        trace = walk(arg(sdpa, what), what)
        if isinstance(trace, str):
            return trace
        got = resolve(trace, _fits)
        if isinstance(got, str):
            return f"{what}: {got}"
        resolved[what] = got
    key, value = resolved["key"], resolved["value"]
    index = key.trace.gather.index
    if not same_value(value.trace.gather.index, index):
        return (f"key and value are gathered with different indices ({index.name} vs "
                f"{value.trace.gather.index.name}), not one block table")
    for what, r in resolved.items():
        if r.trace.scale is not None and not same_value(r.trace.scale.gather.index, index):
            return f"{what} scale is gathered with another index than the block table"
    mask = arg(sdpa, "attn_mask")
    reading = None
    if isinstance(mask, fx.Node):
        reading = read_mask(mask, q.shape[0], _positions(key.final))
    site = PagedSite(sdpa, query, key, value, mask, reading)
    region = frozenset(key.trace.nodes() | value.trace.nodes())
    return Match(sdpa, f"pagedfuse.{site.op}", _describe(site), region, site)


def _positions(layout: Layout) -> object:
    """Keys per sequence: blocks x slots."""
    return layout.size("block") * layout.size("slot")


def _describe(site: PagedSite) -> str:
    k = site.key
    gather = k.trace.gather
    dequant = f", dequant x {k.trace.scale.gather.source.name}" if k.trace.scale else ""
    return (f"{gather.spelling} on {k.view.name} cache {gather.source.name} with "
            f"{gather.index.name}{dequant}")

"""Recognise attention over K/V gathered from a paged cache: what the built-in pattern
matches, SDPA or the explicit matmul-softmax-matmul spelling (attention.py reads either as
SDPA's arguments).

The result, a ``PagedSite``, records everything the preconditions and the replacement need,
read from fake-tensor metadata only, including the op's masking (``Masking``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from pagedfuse.graph.effects import same_value
from pagedfuse.graph.layout import Layout, same_size, show
from pagedfuse.graph.ops import describe, fake
from pagedfuse.patterns.base import Match
from pagedfuse.patterns.paged_sdpa.attention import Attention, read_attention
from pagedfuse.patterns.paged_sdpa.kv_trace import Resolved, read_patched, resolve, walk
from pagedfuse.patterns.paged_sdpa.masks import MaskReading, read_mask

WANT = "[batch, kv_head, block*slot, head_dim]"
# Masking.bias: no attn_bias, the attention's own mask, or SDPA's top-left is_causal built
# as a bool tril (the op's causal is bottom-right).
NO_BIAS, MASK_BIAS, TOP_LEFT_CAUSAL = "none", "mask", "top-left causal"


@dataclass(frozen=True)
class Masking:
    """The op's masking arguments for a site: ``seq_lens`` (None: every gathered key; a
    lengths node is clamped to them), ``causal``, ``window_left`` and which ``bias``.
    ``nan_rows``: the explicit softmax gives a row its mask hides entirely NaN (SDPA and the
    op give zeros), so the replacement sets such rows of the op's output to NaN."""

    seq_lens: fx.Node | None
    causal: bool
    window_left: int | None
    bias: str
    nan_rows: bool = False


@dataclass(frozen=True)
class PagedSite:
    attention: Attention
    key: Resolved
    value: Resolved
    mask_reading: MaskReading | None
    masking: Masking

    @property
    def anchor(self) -> fx.Node:
        return self.attention.anchor

    @property
    def query(self) -> fx.Node:
        return self.attention.query

    @property
    def mask(self) -> fx.Node | None:
        return self.attention.mask

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

    def reads(self) -> set[fx.Node]:
        """The nodes eager evaluates from the caches, table, scales and lengths on the way to
        the attention, and the explicit spelling's own (its score matmul reads the query, its
        add the mask): eager reads those inputs there, the op only at the anchor."""
        found = self.key.trace.reads() | self.value.trace.reads()
        if self.masking.seq_lens is not None:
            found |= self.mask_reading.nodes
        if self.attention.explicit is not None:
            found |= self.attention.explicit.nodes - {self.anchor}
        return found

    def size(self, atom: str) -> object:
        """Size of a K atom ("batch", "block", "slot", "head", "dim"); 1 where left out."""
        return self.key.final.size(atom)

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


def _fits_transposed(layout: Layout) -> str | None:
    """The explicit spelling's k^T: [batch, kv_head, head_dim, block*slot]."""
    dims = layout.dims
    if len(dims) != 4:
        return f"is {show(layout)}, not the transpose of {WANT}"
    return _fits(replace(layout, dims=(*dims[:2], dims[3], dims[2])))


def _masking(attention: Attention, reading: MaskReading | None, q_len: object,
             keys: object) -> Masking:
    nan_rows = attention.explicit is not None and reading is not None
    if reading is not None and reading.exact:
        return Masking(reading.seq_lens, reading.causal, reading.window_left, NO_BIAS,
                       nan_rows)
    if reading is not None:
        return Masking(reading.seq_lens, attention.is_causal, reading.window_left, MASK_BIAS,
                       nan_rows)
    if attention.is_causal and not same_size(q_len, keys):
        return Masking(None, False, None, TOP_LEFT_CAUSAL)
    return Masking(None, attention.is_causal, None, NO_BIAS)


def match_paged_sdpa(anchor: fx.Node) -> Match | str:
    """A Match whose facts are a PagedSite, or why ``anchor`` is not paged attention."""
    attention = read_attention(anchor)
    if isinstance(attention, str):
        return attention
    q = fake(attention.query)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        return "query is not a 4-D [batch, heads, queries, head_dim] tensor"
    resolved = {}
    operands = {"key": (attention.key, _fits_transposed if attention.explicit else _fits),
                "value": (attention.value, _fits)}
    for what, (operand, fits) in operands.items():
        trace = walk(operand, what)
        if isinstance(trace, str):
            return trace
        trace = read_patched(trace, anchor)
        got = resolve(trace, fits)
        if isinstance(got, str):
            return f"{what}: {got}"
        resolved[what] = got
    key, value = resolved["key"], resolved["value"]
    if bool(key.trace.gather.patched) != bool(value.trace.gather.patched):
        written = key if key.trace.gather.patched else value
        return (f"{describe(written.trace.gather.patched[0])} writes the gathered copy "
                f"{written.trace.gather.node.name} of one of K/V only; the op reads both "
                "through one table")
    index = key.trace.gather.index
    if not same_value(value.trace.gather.index, index):
        return (f"key and value are gathered with different indices ({index.name} vs "
                f"{value.trace.gather.index.name}), not one block table")
    for what, r in resolved.items():
        if r.trace.scale is not None and not same_value(r.trace.scale.gather.index, index):
            return f"{what} scale is gathered with another index than the block table"
    keys = _positions(key.final)
    reading = None
    if isinstance(attention.mask, fx.Node):
        reading = read_mask(attention.mask, q.shape[0], q.shape[2], keys)
    site = PagedSite(attention, key, value, reading,
                     _masking(attention, reading, q.shape[2], keys))
    region = key.trace.nodes() | value.trace.nodes()
    if attention.explicit:
        region |= attention.explicit.nodes - {anchor}
    return Match(anchor, f"pagedfuse.{site.op}", _describe(site), frozenset(region), site)


def _positions(layout: Layout) -> object:
    """Keys per sequence: blocks x slots."""
    return layout.size("block") * layout.size("slot")


def _describe(site: PagedSite) -> str:
    k = site.key
    gather = k.trace.gather
    dequant = f", dequant x {k.trace.scale.gather.source.name}" if k.trace.scale else ""
    explicit = " (explicit matmul-softmax-matmul)" if site.attention.explicit else ""
    if gather.patched:
        return (f"{gather.spelling} on {k.view.name} cache {gather.cache.name} with "
                f"{gather.index.name}: the op reads the patched copy {gather.node.name}"
                f"{explicit}")
    return (f"{gather.spelling} on {k.view.name} cache {gather.source.name} with "
            f"{gather.index.name}{dequant}{explicit}")

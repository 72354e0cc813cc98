"""FlexAttention on a paged cache: the peer that bench_decode.py times against pagedfuse.

torch's experimental PagedAttention maps a logical block mask onto physical pages. Here the
physical pages are the benchmark's own cache, viewed (not copied) as one sequence per KV
head, [1, Hkv, blocks * page, D], and its page table is the case's block table, so
FlexAttention reads the very bytes pagedfuse reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

# FlexAttention's decode kernel packs a query-head group into one tile only when its size is a
# power of two; other groups (qwen35's 6) take its general kernel, whose tiles must divide the
# mask's blocks, here one page (16) for both the query and the keys.
NON_POW2_OPTIONS = {"BLOCK_M": 16, "BLOCK_N": 16}
# The general kernel for any group: torch 2.11's decode kernel fails to compile with a
# sliding-window block mask (a ternary mixing int64 and int32 in its template), so a windowed
# peer that hits that still gets timed through this one.
GENERAL_OPTIONS = {**NON_POW2_OPTIONS, "FORCE_USE_FLEX_ATTENTION": True}


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def physical_pages(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, page, Hkv, D] NHD cache -> [1, Hkv, blocks * page, D], a view: a block's
    stride is page times a token's, so the two dims merge without a copy."""
    blocks, page, hkv, d = cache.shape
    pages = cache.permute(2, 0, 1, 3).reshape(1, hkv, blocks * page, d)
    if pages.data_ptr() != cache.data_ptr():
        raise ValueError("the cache's blocks and tokens do not merge into one view")
    return pages


def paged_flex_call(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    flex: Callable = flex_attention, window_left: int | None = None,
                    general: bool = False) -> Callable[[], torch.Tensor]:
    """A zero-argument call of ``flex`` (flex_attention, or a compiled one) for decode:
    query [B, Hq, D], one token per sequence, attending to the first seq_lens[b] keys of
    sequence b's pages, or with ``window_left`` to its last window_left of them (a sliding
    window: the block mask skips the pages before it); it returns [B, Hq, D]. The block
    mask is built here, once, so the call times attention alone. ``general`` takes
    FlexAttention's general kernel even where its decode kernel would run."""
    batch, _, _ = query.shape
    blocks, page, _, _ = key_cache.shape
    n = block_table.shape[1]
    device = query.device
    paged = PagedAttention(blocks, page, batch, device=str(device))
    paged.page_table[:, :n] = block_table
    rows = torch.arange(batch, device=device)[:, None]
    paged.physical_to_logical[rows, block_table.long()] = torch.arange(n, device=device)

    def length(b, h, q_idx, kv_idx):
        return kv_idx < seq_lens[b]

    def window(b, h, q_idx, kv_idx):  # the query sits at position seq_lens[b] - 1
        return (kv_idx < seq_lens[b]) & (kv_idx >= seq_lens[b] - window_left)

    logical = create_block_mask(length if window_left is None else window, batch, None, 1,
                                n * page, device=str(device), BLOCK_SIZE=page)
    mask = paged.convert_logical_block_mask(logical)
    q, k, v = query[:, :, None], physical_pages(key_cache), physical_pages(value_cache)
    options = GENERAL_OPTIONS if general else (
        None if _power_of_two(query.shape[1] // key_cache.shape[2]) else NON_POW2_OPTIONS)
    return lambda: flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=True,
                        kernel_options=options)[:, :, 0]


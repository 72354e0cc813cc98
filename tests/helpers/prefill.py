"""Building a PagedCall straight from tensors, as the op's validation would (the prefill
kernels' tests and benchmark call the kernel without the op around it)."""

from __future__ import annotations

import torch

from pagedfuse.ops.call import FLOAT_OP, INT8_OP, Geometry, PagedCall


def paged_call(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor,
               query_start_loc: torch.Tensor, scale: float, causal: bool,
               attn_bias: torch.Tensor | None = None, key_scale: torch.Tensor | None = None,
               value_scale: torch.Tensor | None = None, max_seq_len: int | None = None,
               max_query_len: int | None = None) -> PagedCall:
    """A PagedCall with its Geometry read off the shapes."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    batch, max_blocks = block_table.shape
    geo = Geometry(num_tokens, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size,
                   batch, max_blocks)
    return PagedCall(INT8_OP if key_scale is not None else FLOAT_OP, query, key_cache,
                     value_cache, key_scale, value_scale, block_table, seq_lens,
                     query_start_loc, scale, causal, attn_bias, max_seq_len, max_query_len, geo)

"""CPU kernels: thin wrappers that hand raw pointers, sizes and strides to pagedfuse._C.

(Placeholder body until the C++ kernels land: routes to the reference.)
"""

from __future__ import annotations

import torch

from pagedfuse.ops.reference import paged_attention_reference, quantize_int8_reference


def paged_attention_into(out, query, key_cache, value_cache, key_scale, value_scale, block_table,
                         seq_lens, query_start_loc, scale, causal, attn_bias, max_seq_len,
                         max_query_len) -> None:
    out.copy_(paged_attention_reference(query, key_cache, value_cache, block_table, seq_lens,
                                        query_start_loc, scale, causal, attn_bias, key_scale,
                                        value_scale))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8_reference(x)

"""Pure-torch implementations of the ops: the test oracle, and the implementation used on a
device that has no kernel yet. Written for clarity, one sequence at a time.
"""

from __future__ import annotations

import torch


def quantize_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: scale = max|x| / 127 over the last dim, round to nearest even."""
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _bias_slice(attn_bias: torch.Tensor, b: int, n: int, length: int) -> torch.Tensor:
    """Sequence b's [Hq or 1, n, length] slice of a bias broadcastable to [B, Hq, Mq, Mk]."""
    bias = attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))
    bias = bias[b if bias.shape[0] > 1 else 0]
    return bias[:, :n, :length]  # a broadcast (size-1) dim stays size 1


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """Rows [0, length) of one sequence, [length, *cache.shape[2:]], through its blocks."""
    return cache[blocks].flatten(0, 1)[:length]


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    attn_bias: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Paged attention as DESIGN.md defines it; with ``key_scale`` it is the INT8 variant.

    INT8: the query is quantized per token and head, scores are the exact integer dot
    products times q_scale * k_scale * scale; V is dequantized with ``value_scale`` if given.
    Rows whose keys are all masked produce zeros.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=compute_dtype,
                      device=query.device)
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    for b, length in enumerate(lens):
        q0, q1 = starts[b], starts[b + 1]
        n = q1 - q0
        if n == 0:
            continue
        blocks = block_table[b, : (length + block_size - 1) // block_size].long()
        k = _gather(key_cache, blocks, length).to(compute_dtype)  # [L, Hkv, D]
        v = _gather(value_cache, blocks, length).to(compute_dtype)
        q = query[q0:q1]
        if key_scale is not None:
            q_int, q_scale = quantize_int8_reference(q)
            q = q_int.to(compute_dtype) * q_scale.to(compute_dtype).unsqueeze(-1)
            k = k * _gather(key_scale, blocks, length).to(compute_dtype).unsqueeze(-1)
        if value_scale is not None:
            v = v * _gather(value_scale, blocks, length).to(compute_dtype).unsqueeze(-1)
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q.to(compute_dtype), k) * scale  # [Hq, n, L]
        if attn_bias is not None:
            bias = _bias_slice(attn_bias, b, n, length)
            if bias.dtype == torch.bool:
                scores = scores.masked_fill(~bias, float("-inf"))
            else:
                scores = scores + bias.to(compute_dtype)
        if causal:
            rows = torch.arange(n, device=query.device)[:, None] + (length - n)
            cols = torch.arange(length, device=query.device)[None, :]
            scores = scores.masked_fill(cols > rows, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        finite = torch.isfinite(row_max)
        probs = torch.exp(scores - torch.where(finite, row_max, torch.zeros_like(row_max)))
        denom = probs.sum(dim=-1, keepdim=True)
        probs = torch.where(finite, probs / denom.clamp_min(torch.finfo(compute_dtype).tiny), 0.0)
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", probs, v)
    return out.to(query.dtype)

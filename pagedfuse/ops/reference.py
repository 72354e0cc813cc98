"""Pure-torch implementations of the ops: the test oracle, and the implementation used on a
device that has no kernel yet. Written for clarity, one sequence at a time.
"""

from __future__ import annotations

import torch


def quantize_int8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: scale = max|x| / 127 over the last dim, round to nearest even.

    Non-finite rows stay visible: a NaN makes the row's scale NaN (and an Inf makes it Inf),
    so whatever is dequantized from the row is not finite either; an element whose quotient
    is NaN (x NaN, or Inf over an Inf scale) is stored as 0, a defined int8 for every kernel.
    """
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1) / 127.0  # amax propagates NaN
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe.unsqueeze(-1))
    q = torch.where(q.isnan(), 0.0, q).clamp_(-127, 127).to(torch.int8)
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
    window_left: int | None = None,
    softcap: float | None = None,
    quantize_query: bool = True,
) -> torch.Tensor:
    """Paged attention as docs/design.md defines it; with ``key_scale`` it is the INT8 variant.

    Sequence b's query token t (of q_len) sits at position p = seq_len - q_len + t, which may
    be negative, and reads keys j < seq_len, with ``causal`` only j <= p, with
    ``window_left`` only j > p - window_left (so causal and a window read (p - window_left,
    p]). A score is q.k * scale, then with ``softcap`` softcap * tanh(score / softcap) (the
    order of transformers' Gemma2), then ``attn_bias`` is added. Over the keys it reads, a
    row is eager SDPA with ``attn_bias`` as the mask (a bool False adds -inf): a NaN or +inf
    score makes the row NaN, a row whose scores are all -inf (or that reads no key) gets
    weights 0, and V enters as sum_j w_j v_j in IEEE arithmetic (so a weight-0 key with a NaN
    or Inf in V makes that column NaN). Keys a row does not read never reach it. Negative
    block ids wrap, as ``cache[block_table]`` does.

    INT8: the query is quantized per token and head, scores are the exact integer dot
    products times q_scale * k_scale * scale; V is dequantized with ``value_scale`` if given.
    ``quantize_query=False`` keeps the query as it is: a plain dequantize-then-attend of the
    same caches, the baseline that separates the cache's quantization loss from the op's.
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
        if n == 0 or length == 0:  # no row, or rows that read no key: zeros
            continue
        blocks = block_table[b, : (length + block_size - 1) // block_size].long()
        k = _gather(key_cache, blocks, length).to(compute_dtype)  # [L, Hkv, D]
        v = _gather(value_cache, blocks, length).to(compute_dtype)
        q = query[q0:q1]
        if key_scale is not None and quantize_query:
            q_int, q_scale = quantize_int8_reference(q)
            q = q_int.to(compute_dtype) * q_scale.to(compute_dtype).unsqueeze(-1)
        if key_scale is not None:
            k = k * _gather(key_scale, blocks, length).to(compute_dtype).unsqueeze(-1)
        if value_scale is not None:
            v = v * _gather(value_scale, blocks, length).to(compute_dtype).unsqueeze(-1)
        k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q.to(compute_dtype), k) * scale  # [Hq, n, L]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if attn_bias is not None:
            bias = _bias_slice(attn_bias, b, n, length)
            if bias.dtype == torch.bool:  # additive, as SDPA applies it: NaN stays NaN
                bias = torch.where(bias, 0.0, float("-inf"))
            scores = scores + bias.to(compute_dtype)
        reads = _keys_read(n, length, causal, window_left, query.device)  # [n, L]
        scores = scores.masked_fill(~reads, float("-inf"))
        poisoned = (scores.isnan() | (scores == float("inf"))).any(dim=-1, keepdim=True)
        row_max = scores.amax(dim=-1, keepdim=True)
        live = ~poisoned & (row_max > float("-inf"))
        probs = torch.exp(scores - torch.where(live, row_max, torch.zeros_like(row_max)))
        probs = torch.where(live, probs / probs.sum(dim=-1, keepdim=True), 0.0)
        rows = _weighted_values(probs, v, reads)
        out[q0:q1] = torch.where(poisoned.transpose(0, 1), float("nan"), rows)
    return out.to(query.dtype)


def _keys_read(n: int, length: int, causal: bool, window_left: int | None,
               device: torch.device) -> torch.Tensor:
    """[n, length] bool: which keys each of a sequence's n query rows reads."""
    cols = torch.arange(length, device=device)[None, :]
    positions = torch.arange(n, device=device)[:, None] + (length - n)
    reads = cols.expand(n, length) >= 0
    if causal:
        reads = reads & (cols <= positions)
    if window_left is not None:
        reads = reads & (cols > positions - window_left)
    return reads


def _weighted_values(probs: torch.Tensor, v: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
    """[n, Hq, D] sum over the keys each row reads of probs [Hq, n, L] times v [L, Hq, D].
    A product over all keys would let a key a row does not read (weight 0) turn its NaN or
    Inf in V into a NaN there, so rows that read different keys go one by one then."""
    if bool(reads.all()) or bool(v.isfinite().all()):
        return torch.einsum("hnl,lhd->nhd", probs, v)
    return torch.stack([torch.einsum("hl,lhd->hd", probs[:, i, reads[i]], v[reads[i]])
                        for i in range(reads.shape[0])])

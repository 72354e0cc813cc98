"""The oracle for the paged model: a dense float32 forward over the whole token history, with
no cache, no block table and explicit softmax attention. Same weights, independent of every
piece of paged bookkeeping (slots, block tables, masks over padded pages)."""

from __future__ import annotations

import copy

import torch

from pagedfuse.models.decoder import PagedAttention, PagedDecoder


def _dense_attention(attn: PagedAttention, x: torch.Tensor) -> torch.Tensor:
    cfg = attn.config
    batch, seq = x.shape[:2]
    positions = torch.arange(seq, device=x.device).expand(batch, seq)
    q, k, v = attn.project(x, positions)
    group = cfg.num_q_heads // cfg.num_kv_heads
    q = q.transpose(1, 2)  # [B, Hq, S, D]
    k = k.transpose(1, 2).repeat_interleave(group, dim=1)
    v = v.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * cfg.head_dim ** -0.5
    if cfg.softcap is not None:  # after the scale, before any bias
        scores = cfg.softcap * torch.tanh(scores / cfg.softcap)
    pos = torch.arange(seq, device=x.device)
    if cfg.alibi:  # slope_h * (j - i), written out here rather than shared with the model
        scores = scores + attn.slopes[:, None, None] * (pos[None, :] - pos[:, None])
    hidden = pos[None, :] > pos[:, None]
    if cfg.sliding_window is not None:  # query i sees keys (i - window, i]
        hidden = hidden | (pos[:, None] - pos[None, :] >= cfg.sliding_window)
    scores = scores.masked_fill(hidden, float("-inf"))
    out = scores.softmax(dim=-1) @ v
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


@torch.no_grad()
def dense_reference_logits(model: PagedDecoder, tokens: torch.Tensor) -> torch.Tensor:
    """float32 logits [B, S, vocab] of ``tokens`` [B, S] with causal attention over the whole
    history (within the config's sliding window, scores soft-capped where it says)."""
    ref = copy.deepcopy(model).float()
    h = ref.embed(tokens.to(ref.embed.weight.device))
    for layer in ref.layers:
        h = h + _dense_attention(layer.attn, layer.attn_norm(h))
        h = h + layer.mlp(layer.mlp_norm(h))
    return torch.nn.functional.linear(ref.norm(h), ref.output_weight())

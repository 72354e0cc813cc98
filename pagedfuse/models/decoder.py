"""A small Llama-style decoder whose attention over the paged cache is plain PyTorch: write the
new K/V by slot, gather all pages through the block table, mask, then
``F.scaled_dot_product_attention`` (with a soft cap, which SDPA has not, the explicit
matmul-softmax-matmul Gemma2's eager code writes). This is the code pagedfuse rewrites."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedfuse.models.paged_cache import LayerCache, PagedKVCache, gather_kv, write_kv
from pagedfuse.models.presets import DecoderConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_angles(positions: torch.Tensor, head_dim: int,
                theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, S, 1, D/2] of the rotary angles at positions [B, S], shared by q and k."""
    # transformers' spelling of the frequencies, so imported models match it to the last bit
    exponents = torch.arange(0, head_dim, 2, device=positions.device,
                             dtype=torch.float32) / head_dim
    inv_freq = 1.0 / theta ** exponents
    angles = positions.to(torch.float32)[..., None, None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of x [B, S, H, D] with ``rope_angles``' cos, sin."""
    x1, x2 = x.to(torch.float32).chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Geometric per-head slopes 2^(-8 h / H), h = 1..H (the ALiBi paper's sequence)."""
    return 2.0 ** (-8.0 * torch.arange(1, num_heads + 1, dtype=torch.float32) / num_heads)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor, cap: float) -> torch.Tensor:
    """Attention of q [B, Hq, S, D] over k, v [B, Hkv, L, D] with scores cap * tanh(s / cap)
    (after the 1/sqrt(D) scale, before ``mask``: bool, or additive), softmax in float32."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / cap) * cap
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, float("-inf")).to(q.dtype)
    probs = F.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def alibi_bias(slopes: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
               visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, S, L] = slope_h * (key_pos - query_pos), -inf where ``visible`` [B, 1, S, L] is
    False. query_pos [B, S], key_pos [L]."""
    distance = (key_pos[None, None, :] - query_pos[:, :, None]).to(torch.float32)
    bias = slopes[None, :, None, None] * distance[:, None]
    return bias.masked_fill(~visible, float("-inf")).to(dtype)


class PagedAttention(nn.Module):
    """GQA self-attention reading and writing a paged KV cache."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        hq, hkv, d = config.num_q_heads, config.num_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, hq * d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, config.hidden_size, bias=False)
        if config.alibi:
            self.register_buffer("slopes", alibi_slopes(hq), persistent=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [B, S, Hq, D], k and v [B, S, Hkv, D], position-encoded unless ALiBi."""
        cfg = self.config
        batch, seq = x.shape[:2]
        q = self.q_proj(x).view(batch, seq, cfg.num_q_heads, cfg.head_dim)
        k = self.k_proj(x).view(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(batch, seq, cfg.num_kv_heads, cfg.head_dim)
        if not cfg.alibi:
            cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_table: torch.Tensor, seq_lens: torch.Tensor,
                cache: LayerCache) -> torch.Tensor:
        cfg = self.config
        batch, seq = x.shape[:2]
        q, k, v = self.project(x, positions)
        attn_dtype = cfg.attention_dtype
        if attn_dtype != x.dtype:  # e.g. fp32 weights over a bf16 cache
            q, k, v = q.to(attn_dtype), k.to(attn_dtype), v.to(attn_dtype)
        write_kv(cache, slot_mapping, k.reshape(batch * seq, cfg.num_kv_heads, cfg.head_dim),
                 v.reshape(batch * seq, cfg.num_kv_heads, cfg.head_dim), cfg)
        keys, values = gather_kv(cache, block_table, attn_dtype, cfg)
        key_pos = torch.arange(block_table.shape[1] * cfg.block_size, device=x.device)
        window = cfg.sliding_window
        if seq == 1:  # decode: a length mask (and the window's start), [B, 1, 1, L]
            visible = key_pos < seq_lens[:, None]
            if window is not None:
                visible = visible & (key_pos >= seq_lens[:, None] - window)
            visible = visible[:, None, None, :]
        else:  # prefill: bottom-right causal and length (and the window), [B, 1, S, L]
            visible = ((key_pos[None, None, :] <= positions[:, :, None])
                       & (key_pos < seq_lens[:, None])[:, None, :])
            if window is not None:
                visible = visible & (positions[:, :, None] - key_pos < window)
            visible = visible[:, None]
        mask = alibi_bias(self.slopes, positions, key_pos, visible, attn_dtype) if cfg.alibi \
            else visible
        if cfg.softcap is not None:
            out = softcapped_attention(q.transpose(1, 2), keys, values, mask, cfg.softcap)
        else:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values,
                                                 attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(batch, seq, -1)
        return self.o_proj(out if attn_dtype == x.dtype else out.to(x.dtype))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = PagedAttention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)


class PagedDecoder(nn.Module):
    """Embedding, ``num_layers`` pre-norm decoder layers, final norm, LM head (tied or not).
    Random weights from ``seed``; parameters in the config's activation dtype."""

    def __init__(self, config: DecoderConfig, device: torch.device | str = "cpu",
                 seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else \
            nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights(torch.Generator().manual_seed(seed))
        self.to(device=device, dtype=config.activation_dtype)

    @torch.no_grad()
    def _init_weights(self, gen: torch.Generator) -> None:
        """Unit-variance activations, so attention scores spread and no softmax is flat."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, module.in_features ** -0.5, generator=gen)
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 1.0, generator=gen)
            elif isinstance(module, RMSNorm):
                module.weight.normal_(1.0, 0.1, generator=gen)

    def output_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, batch: int, max_len: int, seed: int = 0) -> PagedKVCache:
        return PagedKVCache(self.config, batch, max_len, self.embed.weight.device, seed)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                kv_caches: list[LayerCache]) -> torch.Tensor:
        """Logits [B, q_len, vocab] for ``input_ids`` [B, q_len]; writes their K/V into
        ``kv_caches`` first (see ``PagedKVCache.append`` for the metadata)."""
        h = self.embed(input_ids)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            h = h + layer.attn(layer.attn_norm(h), positions, slot_mapping, block_table,
                               seq_lens, cache)
            h = h + layer.mlp(layer.mlp_norm(h))
        return F.linear(self.norm(h), self.output_weight())


class Generation(NamedTuple):
    tokens: torch.Tensor  # [B, P + steps + 1]: prompts and the generated tokens
    logits: torch.Tensor  # [B, P + steps, vocab]: logits of every token fed to the model


@torch.no_grad()
def generate(model: PagedDecoder, prompts: torch.Tensor, steps: int, *,
             forward: Callable[..., torch.Tensor] | None = None,
             forced: torch.Tensor | None = None, cache_seed: int = 0,
             on_step: Callable[[], None] | None = None,
             prompt_lens: list[int] | None = None) -> Generation:
    """Prefill ``prompts`` [B, P], then ``steps`` greedy decode steps.

    ``forward`` replaces ``model`` for the calls (e.g. a compiled model); ``forced`` [B, >=
    P + steps + 1] feeds those tokens instead of the argmax (teacher forcing, to compare two
    runs position by position); ``on_step`` is called after each forward. ``prompt_lens``
    gives each row's own length when ``prompts`` is right-padded to P: the first token comes
    from the row's last prompt token, the padding's K/V are overwritten and never attended
    to, and every row's generated tokens still start at column P (so one batch, two graphs,
    serves prompts of any lengths).
    """
    forward = model if forward is None else forward
    batch, prompt_len = prompts.shape
    cache = model.new_cache(batch, prompt_len + steps, seed=cache_seed)
    tokens = prompts.to(model.embed.weight.device)
    fed, all_logits = tokens, []
    for step in range(steps + 1):
        logits = forward(*cache.append(fed), cache.layers)
        all_logits.append(logits)
        if on_step is not None:
            on_step()
        last = logits[:, -1]
        if step == 0 and prompt_lens is not None:
            cache.rewind(prompt_lens)
            last = logits[torch.arange(batch), torch.tensor(prompt_lens) - 1]
        chosen = last.argmax(dim=-1) if forced is None else forced[:, prompt_len + step]
        fed = chosen.to(tokens.device, torch.int64)[:, None]
        tokens = torch.cat((tokens, fed), dim=1)
    return Generation(tokens, torch.cat(all_logits, dim=1))

"""Llama-family weights from a transformers model into the paged decoder, so the demo, the tests
and the benchmarks can run a trained model (whose logits are far from flat) through the same
plain-PyTorch paged attention pagedfuse rewrites."""

from __future__ import annotations

import re
from typing import Any

import torch

from pagedfuse.models.decoder import PagedDecoder
from pagedfuse.models.presets import DecoderConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral")

# (the paged decoder's parameter name, transformers' name); \1 is the layer index
_RENAMES = (
    (r"^embed\.weight$", "model.embed_tokens.weight"),
    (r"^layers\.(\d+)\.attn\.(\w)_proj\.weight$", r"model.layers.\1.self_attn.\2_proj.weight"),
    (r"^layers\.(\d+)\.mlp\.(gate|up|down)\.weight$", r"model.layers.\1.mlp.\2_proj.weight"),
    (r"^layers\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^layers\.(\d+)\.mlp_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^lm_head\.weight$", "lm_head.weight"),
)


def _unsupported(hf_config: Any) -> str | None:
    """Why the paged decoder cannot reproduce this model, or None when it can."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        return f"hidden_act {hf_config.hidden_act!r}: the decoder's MLP is SwiGLU (silu)"
    for bias in ("attention_bias", "mlp_bias"):
        if getattr(hf_config, bias, False):
            return f"{bias} is set: the decoder's projections have no bias"
    if getattr(hf_config, "sliding_window", None) is not None:
        return f"sliding_window {hf_config.sliding_window}: the decoder attends to every key"
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" or "rope_theta" not in rope:
        return f"rope_parameters {rope}: only plain RoPE (rope_type 'default') is supported"
    return None


def decoder_config(hf_config: Any, **overrides: Any) -> DecoderConfig:
    """The DecoderConfig of a transformers Llama-family config: GQA head counts, head_dim,
    RoPE theta, RMSNorm eps and tied embeddings taken over; ``overrides`` sets the cache kind,
    layout, block size or dtype."""
    reason = _unsupported(hf_config)
    if reason is not None:
        raise ValueError(f"hf_config: {reason}")
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return DecoderConfig(
        num_q_heads=heads,
        num_kv_heads=hf_config.num_key_value_heads or heads,
        head_dim=head_dim,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        vocab_size=hf_config.vocab_size,
        rope_theta=float(hf_config.rope_parameters["rope_theta"]),
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        norm_eps=float(hf_config.rms_norm_eps),
        **overrides,
    )


def _hf_name(name: str) -> str:
    for pattern, replacement in _RENAMES:
        hf_name, count = re.subn(pattern, replacement, name)
        if count:
            return hf_name
    raise KeyError(f"no transformers name for the decoder's parameter {name!r}")


@torch.no_grad()
def from_transformers(hf_model: torch.nn.Module, device: torch.device | str = "cpu",
                      **overrides: Any) -> PagedDecoder:
    """A PagedDecoder holding ``hf_model``'s weights (converted to the config's dtype).

    Every decoder parameter must come from the transformers model and every transformers
    weight must be used (a tied ``lm_head`` excepted), so a renamed or extra weight fails
    here instead of giving a model that silently computes something else.
    """
    config = decoder_config(hf_model.config, **overrides)
    model = PagedDecoder(config, device=device)
    hf_state = hf_model.state_dict()
    names = {name: _hf_name(name) for name in model.state_dict()}
    missing = sorted(hf for hf in names.values() if hf not in hf_state)
    if missing:
        raise ValueError(f"hf_model: no weights named {missing[:3]}")
    unused = sorted(set(hf_state) - set(names.values())
                    - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if unused:
        raise ValueError(f"hf_model: weights the decoder has no place for: {unused[:3]}")
    model.load_state_dict({name: hf_state[hf] for name, hf in names.items()})
    return model.eval()

"""Decoder configurations with the attention geometry of real models, shrunk everywhere else
(2 layers, hidden 256) so a CPU runs them in milliseconds."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

KV_CACHE_KINDS = ("bf16", "fp32", "int8")
LAYOUTS = ("nhd", "hnd")
_FLOAT_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class DecoderConfig:
    """A Llama-style decoder. ``kv_cache`` is how K (and V, unless ``value_cache`` names a
    float kind for an int8 K) are stored (int8: per-token, per-KV-head float32 scales);
    ``layout`` is the page layout: nhd = [blocks, block_size, Hkv, D], hnd = [blocks, Hkv,
    block_size, D]. ``dtype`` is the dtype of the weights and activations; None derives it from
    a float cache or fp32 for int8. Attention runs in the float cache's dtype (the fused op
    needs cache and query in one dtype), so fp32 weights over a bf16 cache cast q, k, v to
    bf16 and the attention output back.
    ``sliding_window``: a query sees the last that many keys, itself included (None: all);
    ``softcap``: attention scores become softcap * tanh(score / softcap) (None: off)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    vocab_size: int = 512
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    alibi: bool = False
    kv_cache: str = "fp32"
    value_cache: str | None = None
    layout: str = "nhd"
    block_size: int = 16
    dtype: torch.dtype | None = None
    norm_eps: float = 1e-6
    sliding_window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache: {self.kv_cache!r} not in {KV_CACHE_KINDS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout: {self.layout!r} not in {LAYOUTS}")
        if self.num_kv_heads < 1 or self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads: {self.num_q_heads} is not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be None or >= 1, got {self.sliding_window}")
        if self.softcap is not None and not (math.isfinite(self.softcap) and self.softcap > 0):
            raise ValueError(f"softcap: must be None or a finite float > 0, got {self.softcap}")
        if self.value_cache is not None and self.value_cache != self.kv_cache and (
                self.kv_cache != "int8" or self.value_cache not in _FLOAT_CACHE_DTYPES):
            raise ValueError(f"value_cache: {self.value_cache!r} with a {self.kv_cache} K cache; "
                             "only an int8 K cache takes a float V cache "
                             f"{tuple(_FLOAT_CACHE_DTYPES)}")

    @property
    def value_kind(self) -> str:
        """How V is stored: ``value_cache`` where given, else as K."""
        return self.value_cache or self.kv_cache

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.dtype or self.attention_dtype

    @property
    def attention_dtype(self) -> torch.dtype:
        """dtype of q, k, v in attention: the float cache's (V's for an int8 K), else the
        activation dtype (fp32 unless ``dtype`` says otherwise)."""
        for kind in (self.kv_cache, self.value_kind):
            if kind in _FLOAT_CACHE_DTYPES:
                return _FLOAT_CACHE_DTYPES[kind]
        return self.dtype or torch.float32

    @property
    def cache_dtype(self) -> torch.dtype:
        """dtype of the K pages (int8 for a quantized cache)."""
        return _kind_dtype(self.kv_cache, self.attention_dtype)

    @property
    def value_cache_dtype(self) -> torch.dtype:
        """dtype of the V pages."""
        return _kind_dtype(self.value_kind, self.attention_dtype)


def _kind_dtype(kind: str, float_dtype: torch.dtype) -> torch.dtype:
    return torch.int8 if kind == "int8" else float_dtype


PRESETS: dict[str, DecoderConfig] = {
    "qwen35": DecoderConfig(num_q_heads=24, num_kv_heads=4, head_dim=256, tie_embeddings=True),
    "tinyllama": DecoderConfig(num_q_heads=32, num_kv_heads=4, head_dim=64),
    "llama3": DecoderConfig(num_q_heads=32, num_kv_heads=8, head_dim=128),
    # Gemma2-9B's attention: 16 query heads over 8 KV heads of 256, a sliding window of 4096
    # and scores capped at 50 (here every layer slides).
    "gemma2": DecoderConfig(num_q_heads=16, num_kv_heads=8, head_dim=256, sliding_window=4096,
                            softcap=50.0),
}


def preset(name: str, **overrides: object) -> DecoderConfig:
    """The named preset with fields replaced, e.g. ``preset("llama3", kv_cache="int8")``."""
    if name not in PRESETS:
        raise ValueError(f"preset: {name!r} not in {tuple(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)

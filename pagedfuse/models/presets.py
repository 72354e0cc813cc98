"""Decoder configurations with the attention geometry of real models, shrunk everywhere else
(2 layers, hidden 256) so a CPU runs them in milliseconds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

KV_CACHE_KINDS = ("bf16", "fp32", "int8")
LAYOUTS = ("nhd", "hnd")
_FLOAT_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class DecoderConfig:
    """A Llama-style decoder. ``kv_cache`` is how K/V are stored (int8: per-token, per-KV-head
    float32 scales); ``layout`` is the page layout: nhd = [blocks, block_size, Hkv, D],
    hnd = [blocks, Hkv, block_size, D]. ``dtype`` is the activation dtype; None derives it
    from a float cache (the fused op needs cache and query in one dtype) or fp32 for int8."""

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
    layout: str = "nhd"
    block_size: int = 16
    dtype: torch.dtype | None = None
    norm_eps: float = 1e-6

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
        cache_dtype = _FLOAT_CACHE_DTYPES.get(self.kv_cache)
        if self.dtype is not None and cache_dtype not in (None, self.dtype):
            raise ValueError(f"dtype: {self.dtype} differs from the {self.kv_cache} cache; "
                             "a float cache stores K/V in the activation dtype")

    @property
    def activation_dtype(self) -> torch.dtype:
        return self.dtype or _FLOAT_CACHE_DTYPES.get(self.kv_cache, torch.float32)

    @property
    def cache_dtype(self) -> torch.dtype:
        """dtype of the K/V pages (int8 for a quantized cache)."""
        return torch.int8 if self.kv_cache == "int8" else self.activation_dtype


PRESETS: dict[str, DecoderConfig] = {
    "qwen35": DecoderConfig(num_q_heads=24, num_kv_heads=4, head_dim=256, tie_embeddings=True),
    "tinyllama": DecoderConfig(num_q_heads=32, num_kv_heads=4, head_dim=64),
    "llama3": DecoderConfig(num_q_heads=32, num_kv_heads=8, head_dim=128),
}


def preset(name: str, **overrides: object) -> DecoderConfig:
    """The named preset with fields replaced, e.g. ``preset("llama3", kv_cache="int8")``."""
    if name not in PRESETS:
        raise ValueError(f"preset: {name!r} not in {tuple(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)

"""A small paged-KV decoder (presets with real models' attention geometry, or a real model's
weights imported from transformers) for the demo, the tests and the benchmarks."""

from pagedfuse.models.decoder import Generation, PagedDecoder, generate
from pagedfuse.models.hf_llama import decoder_config, from_transformers
from pagedfuse.models.paged_cache import LayerCache, PagedKVCache, StepInputs
from pagedfuse.models.presets import KV_CACHE_KINDS, LAYOUTS, PRESETS, DecoderConfig, preset
from pagedfuse.models.reference import dense_reference_logits

__all__ = [
    "KV_CACHE_KINDS",
    "LAYOUTS",
    "PRESETS",
    "DecoderConfig",
    "Generation",
    "LayerCache",
    "PagedDecoder",
    "PagedKVCache",
    "StepInputs",
    "decoder_config",
    "dense_reference_logits",
    "from_transformers",
    "generate",
    "preset",
]

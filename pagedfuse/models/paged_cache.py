"""A paged KV cache in plain PyTorch: storage, a block manager, and the cache write and
gather the model's forward calls (the code pagedfuse must recognise in a graph)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedfuse.models.presets import DecoderConfig
from pagedfuse.ops.reference import quantize_int8_reference


class LayerCache(NamedTuple):
    """One layer's pages; the scales are None for a float cache. In nhd layout the pages are
    [num_blocks, block_size, Hkv, D] and the scales [num_blocks, block_size, Hkv]; in hnd
    they are [num_blocks, Hkv, block_size, D] and [num_blocks, Hkv, block_size]."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None
    value_scale: torch.Tensor | None


class StepInputs(NamedTuple):
    """What one forward needs besides the caches, in the model's argument order."""

    input_ids: torch.Tensor  # [B, q_len] int64
    positions: torch.Tensor  # [B, q_len] int64, position of each query token in its sequence
    slot_mapping: torch.Tensor  # [B * q_len] int64, block_id * block_size + offset per token
    block_table: torch.Tensor  # [B, max_blocks] int32, padded with block 0 (masked)
    seq_lens: torch.Tensor  # [B] int32, keys per sequence after this step's write


def _token_major(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A view with block_size as dim 1 (hnd storage transposed), for writing by slot."""
    return t if layout == "nhd" else t.transpose(1, 2)


def write_kv(cache: LayerCache, slot_mapping: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, config: DecoderConfig) -> None:
    """Store new tokens' K/V [N, Hkv, D] in place at their slots (quantized for int8)."""
    block, offset = slot_mapping // config.block_size, slot_mapping % config.block_size
    for pages, scales, rows in ((cache.key, cache.key_scale, key),
                                (cache.value, cache.value_scale, value)):
        if scales is not None:
            rows, row_scales = quantize_int8_reference(rows)
            _token_major(scales, config.layout)[block, offset] = row_scales
        _token_major(pages, config.layout)[block, offset] = rows.to(pages.dtype)


def _gather_pages(pages: torch.Tensor, scales: torch.Tensor | None, block_table: torch.Tensor,
                  dtype: torch.dtype, config: DecoderConfig) -> torch.Tensor:
    """[B, Hkv, max_blocks * block_size, D]: each sequence's pages through its block table.
    Sizes come from the config and the block table, never from the gathered tensor, so the
    gathered K/V feed nothing but the attention (even with dynamic shapes)."""
    x = pages[block_table]  # nhd [B, MB, bs, Hkv, D]; hnd [B, MB, Hkv, bs, D]
    if scales is not None:
        x = (x.to(torch.float32) * scales[block_table][..., None]).to(dtype)
    batch, kv_heads, head_dim = block_table.shape[0], config.num_kv_heads, config.head_dim
    if config.layout == "nhd":
        return x.reshape(batch, -1, kv_heads, head_dim).transpose(1, 2)
    return x.transpose(1, 2).reshape(batch, kv_heads, -1, head_dim)


def gather_kv(cache: LayerCache, block_table: torch.Tensor, dtype: torch.dtype,
              config: DecoderConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [B, Hkv, L, D] in ``dtype``, L = max_blocks * block_size (mask the tail)."""
    return (_gather_pages(cache.key, cache.key_scale, block_table, dtype, config),
            _gather_pages(cache.value, cache.value_scale, block_table, dtype, config))


class PagedKVCache:
    """Storage for every layer plus a block manager: sequences get blocks from a shuffled free
    list as they grow (so block tables are neither identity nor contiguous), and each step's
    metadata keeps a fixed block-table width so every decode step is the same graph. Unwritten
    slots hold random values, so a masking bug shows up as wrong numbers."""

    def __init__(self, config: DecoderConfig, batch: int, max_len: int,
                 device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.config = config
        self.device = torch.device(device)
        self.max_blocks = -(-max_len // config.block_size)
        num_blocks = batch * self.max_blocks
        gen = torch.Generator().manual_seed(seed)
        self._free = torch.randperm(num_blocks, generator=gen).tolist()
        self.blocks: list[list[int]] = [[] for _ in range(batch)]
        self.lengths = [0] * batch
        self.layers = [self._new_layer(num_blocks, gen) for _ in range(config.num_layers)]

    def _new_layer(self, num_blocks: int, gen: torch.Generator) -> LayerCache:
        cfg = self.config
        bs, hkv = cfg.block_size, cfg.num_kv_heads
        scale_shape = (num_blocks, bs, hkv) if cfg.layout == "nhd" else (num_blocks, hkv, bs)
        shape = (*scale_shape, cfg.head_dim)

        def pages(dtype: torch.dtype) -> torch.Tensor:
            if dtype == torch.int8:
                return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
            return torch.randn(shape, generator=gen).to(dtype)

        def scales(dtype: torch.dtype) -> torch.Tensor | None:
            if dtype != torch.int8:
                return None
            return torch.rand(scale_shape, generator=gen) * 0.05 + 0.01

        k_dtype, v_dtype = cfg.cache_dtype, cfg.value_cache_dtype
        tensors = (pages(k_dtype), pages(v_dtype), scales(k_dtype), scales(v_dtype))
        return LayerCache(*(t if t is None else t.to(self.device) for t in tensors))

    def rewind(self, lengths: list[int]) -> None:
        """Forget each sequence's tokens past ``lengths`` (e.g. the padding of a right-padded
        prefill): the next append overwrites their slots and seq_lens masks what is left."""
        if len(lengths) != len(self.lengths) or not all(
                0 <= new <= old for new, old in zip(lengths, self.lengths, strict=True)):
            raise ValueError(f"lengths: {lengths} must be one per sequence, each at most its "
                             f"current length {self.lengths}")
        self.lengths = list(lengths)

    def append(self, tokens: torch.Tensor) -> StepInputs:
        """Metadata for feeding ``tokens`` [B, q_len] after each sequence's current tokens
        (prefill when empty, decode with q_len 1); allocates blocks as needed."""
        batch, q_len = tokens.shape
        if batch != len(self.lengths):
            raise ValueError(f"tokens: batch {batch} != the cache's {len(self.lengths)}")
        bs = self.config.block_size
        positions, slots = [], []
        for b, start in enumerate(self.lengths):
            end = start + q_len
            need = -(-end // bs)
            if need > self.max_blocks:
                raise ValueError(f"tokens: sequence {b} would hold {end} tokens, more than the "
                                 f"cache's {self.max_blocks * bs}")
            while len(self.blocks[b]) < need:
                self.blocks[b].append(self._free.pop())
            positions.append(list(range(start, end)))
            slots.extend(self.blocks[b][p // bs] * bs + p % bs for p in range(start, end))
            self.lengths[b] = end
        table = [row + [0] * (self.max_blocks - len(row)) for row in self.blocks]
        as_tensor = lambda data, dtype: torch.tensor(data, dtype=dtype, device=self.device)
        return StepInputs(
            input_ids=tokens.to(device=self.device, dtype=torch.int64),
            positions=as_tensor(positions, torch.int64),
            slot_mapping=as_tensor(slots, torch.int64),
            block_table=as_tensor(table, torch.int32),
            seq_lens=as_tensor(self.lengths, torch.int32),
        )

"""The torch.library definitions of torch.ops.pagedfuse.*: schema, fake impl, per-device kernels.

Each op validates its arguments (validate.py), allocates its output and hands both to the
kernel of the tensors' device. The default implementation, for a device with no kernel, is
the pure-torch reference. Annotations here are read by ``custom_op`` to infer the schema, so
this module does not use ``from __future__ import annotations``.
"""

from collections.abc import Callable

import torch

from pagedfuse.ops import cpu
from pagedfuse.ops.reference import paged_attention_reference, quantize_int8_reference
from pagedfuse.ops.validate import (
    check_metadata,
    check_quantize_input,
    check_values,
    value_checks_enabled,
)

Tensor = torch.Tensor

# A kernel fills `out` in place: (out, query, key_cache, value_cache, key_scale, value_scale,
# block_table, seq_lens, query_start_loc, scale, causal, attn_bias, max_seq_len,
# max_query_len) -> None. Arguments arrive validated.
PagedKernel = Callable[..., None]


def _reference_kernel(out, query, key_cache, value_cache, key_scale, value_scale, block_table,
                      seq_lens, query_start_loc, scale, causal, attn_bias, max_seq_len,
                      max_query_len) -> None:
    out.copy_(paged_attention_reference(query, key_cache, value_cache, block_table, seq_lens,
                                        query_start_loc, scale, causal, attn_bias, key_scale,
                                        value_scale))


def _run(op: str, kernel: PagedKernel, query, key_cache, value_cache, key_scale, value_scale,
         block_table, seq_lens, query_start_loc, scale, causal, attn_bias, max_seq_len,
         max_query_len) -> Tensor:
    geo = check_metadata(op, query, key_cache, value_cache, block_table, seq_lens,
                         query_start_loc, scale, attn_bias, key_scale, value_scale)
    if value_checks_enabled(query.device):
        check_values(geo, block_table, seq_lens, query_start_loc, attn_bias, max_seq_len,
                     max_query_len)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.numel():
        kernel(out, query, key_cache, value_cache, key_scale, value_scale, block_table,
               seq_lens, query_start_loc, float(scale), bool(causal), attn_bias, max_seq_len,
               max_query_len)
    return out


@torch.library.custom_op("pagedfuse::paged_attention", mutates_args=())
def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    causal: bool,
    attn_bias: Tensor | None = None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
) -> Tensor:
    """Attention of packed queries [T, Hq, D] over a paged float KV cache (see DESIGN.md)."""
    return _run("paged_attention", _reference_kernel, query, key_cache, value_cache, None, None,
                block_table, seq_lens, query_start_loc, scale, causal, attn_bias, max_seq_len,
                max_query_len)


@torch.library.custom_op("pagedfuse::paged_attention_int8", mutates_args=())
def paged_attention_int8(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    key_scale: Tensor,
    value_scale: Tensor | None,
    block_table: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    causal: bool,
    attn_bias: Tensor | None = None,
    max_seq_len: int | None = None,
    max_query_len: int | None = None,
) -> Tensor:
    """Paged attention over an INT8 K cache (per-token, per-KV-head scales); V int8 or float."""
    return _run("paged_attention_int8", _reference_kernel, query, key_cache, value_cache,
                key_scale, value_scale, block_table, seq_lens, query_start_loc, scale, causal,
                attn_bias, max_seq_len, max_query_len)


@torch.library.custom_op("pagedfuse::quantize_int8", mutates_args=())
def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8 over the last dim: (x_int8, scale = max|x| / 127 as float32)."""
    check_quantize_input(x)
    return quantize_int8_reference(x)


@paged_attention.register_fake
def _paged_attention_fake(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
                          scale, causal, attn_bias=None, max_seq_len=None, max_query_len=None):
    check_metadata("paged_attention", query, key_cache, value_cache, block_table, seq_lens,
                   query_start_loc, scale, attn_bias, fake=True)
    return query.new_empty(query.shape)


@paged_attention_int8.register_fake
def _paged_attention_int8_fake(query, key_cache, value_cache, key_scale, value_scale,
                               block_table, seq_lens, query_start_loc, scale, causal,
                               attn_bias=None, max_seq_len=None, max_query_len=None):
    check_metadata("paged_attention_int8", query, key_cache, value_cache, block_table, seq_lens,
                   query_start_loc, scale, attn_bias, key_scale, value_scale, fake=True)
    return query.new_empty(query.shape)


@quantize_int8.register_fake
def _quantize_int8_fake(x):
    check_quantize_input(x)
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


_kernel_devices: set[str] = set()


def kernel_devices() -> frozenset[str]:
    """Device types whose kernels (not the slow reference) serve the paged ops."""
    return frozenset(_kernel_devices)


def register_device_kernels(device_type: str, kernel: PagedKernel,
                            quantize: Callable[[Tensor], tuple[Tensor, Tensor]]) -> None:
    """Route all three ops on ``device_type`` to ``kernel`` / ``quantize``."""
    _kernel_devices.add(device_type)

    @paged_attention.register_kernel(device_type)
    def _float(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
               causal, attn_bias=None, max_seq_len=None, max_query_len=None):
        return _run("paged_attention", kernel, query, key_cache, value_cache, None, None,
                    block_table, seq_lens, query_start_loc, scale, causal, attn_bias,
                    max_seq_len, max_query_len)

    @paged_attention_int8.register_kernel(device_type)
    def _int8(query, key_cache, value_cache, key_scale, value_scale, block_table, seq_lens,
              query_start_loc, scale, causal, attn_bias=None, max_seq_len=None,
              max_query_len=None):
        return _run("paged_attention_int8", kernel, query, key_cache, value_cache, key_scale,
                    value_scale, block_table, seq_lens, query_start_loc, scale, causal,
                    attn_bias, max_seq_len, max_query_len)

    @quantize_int8.register_kernel(device_type)
    def _quantize(x):
        check_quantize_input(x)
        return quantize(x)


register_device_kernels("cpu", cpu.paged_attention_into, cpu.quantize_int8)

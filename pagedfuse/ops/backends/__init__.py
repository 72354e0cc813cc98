"""Kernel backends of the paged-attention ops, one module each, registered at import.

Adding one is a new module that ends with ``register_backend(Backend(...))`` plus its import
below (see registry.py for the contract). Built in: ``reference`` (pure torch, any device),
``cpu`` (the C++ kernels), and where Triton is installed ``triton``, ``triton_prefill`` (q_len
> 1) and ``cuda_decode`` (the CUDA C++ decode, which launches its own query quantization
and split combine, and falls back on Triton's quantize where its library does not run);
``gluon_prefill`` (the Gluon prefill, sm_90, for the calls where it measured faster);
``mixed_batch`` (decode rows beside prompt chunks: the CUDA decode for the one and a prefill
kernel for the other);
``cudnn_prefill`` (cuDNN's
paged SDPA, q_len > 1) where the optional ``nvidia-cudnn-frontend`` is installed too.
"""

from __future__ import annotations

import importlib.util

import torch

from pagedfuse.ops.backends import cpu, reference  # noqa: F401  (register themselves)
from pagedfuse.ops.backends.registry import (
    Backend,
    SupportReport,
    all_backends,
    backends_for,
    choose,
    get_backend,
    head_dim_reason,
    kernel_devices,
    quantize_kernel,
    reason,
    register_backend,
    report_for,
    supported_head_dims,
    unregister_backend,
)

if importlib.util.find_spec("triton") is not None:  # without it CUDA runs the reference
    from pagedfuse.ops.backends import (  # noqa: F401
        cuda_decode,
        gluon_prefill,
        mixed_batch,
        triton,
        triton_prefill,
    )

    # cuDNN's paged SDPA: only where the optional frontend is installed beside CUDA torch
    if importlib.util.find_spec("cudnn") is not None and torch.version.cuda is not None:
        from pagedfuse.ops.backends import cudnn_prefill  # noqa: F401

Tensor = torch.Tensor


def support_report(op: str, query: Tensor, key_cache: Tensor, value_cache: Tensor,
                   block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, *,
                   key_scale: Tensor | None = None, value_scale: Tensor | None = None,
                   attn_bias: Tensor | None = None, causal: bool = False,
                   max_seq_len: int | None = None, max_query_len: int | None = None,
                   window_left: int | None = None,
                   softcap: float | None = None) -> SupportReport:
    """Which backend would run this call on its device, and why each other would not,
    from shapes, strides, dtypes and devices alone: the tensors may be fake (no data is read,
    no pointer checked). Raises like the op would where the metadata itself is invalid (a
    head_dim no backend serves is not that: the report names each backend's reason)."""
    from pagedfuse.ops.validate import build_call  # validate imports this package

    call = build_call(op, query, key_cache, value_cache, key_scale, value_scale, block_table,
                      seq_lens, query_start_loc, 1.0, causal, attn_bias, max_seq_len,
                      max_query_len, fake=True, capability=False, window_left=window_left,
                      softcap=softcap)
    return report_for(call)


__all__ = [
    "Backend",
    "SupportReport",
    "all_backends",
    "backends_for",
    "choose",
    "get_backend",
    "head_dim_reason",
    "kernel_devices",
    "quantize_kernel",
    "reason",
    "register_backend",
    "report_for",
    "support_report",
    "supported_head_dims",
    "unregister_backend",
]

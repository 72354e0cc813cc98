"""torch.ops.pagedfuse.*: importing this package registers the ops and their kernels."""

from pagedfuse.ops.library import (
    kernel_devices,
    paged_attention,
    paged_attention_int8,
    quantize_int8,
    register_device_kernels,
)
from pagedfuse.ops.reference import paged_attention_reference, quantize_int8_reference
from pagedfuse.ops.validate import head_dim_reason, supported_head_dims

try:  # CUDA kernels are Triton; a machine without Triton keeps the reference on CUDA.
    import triton  # noqa: F401
except ImportError:
    pass
else:
    from pagedfuse.ops import cuda  # noqa: F401  (registers the "cuda" kernels)

__all__ = [
    "head_dim_reason",
    "kernel_devices",
    "paged_attention",
    "paged_attention_int8",
    "paged_attention_reference",
    "quantize_int8",
    "quantize_int8_reference",
    "register_device_kernels",
    "supported_head_dims",
]

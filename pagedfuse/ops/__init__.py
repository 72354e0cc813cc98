"""torch.ops.pagedfuse.*: importing this package registers the ops and their kernel backends."""

from pagedfuse.ops.backends import (
    head_dim_reason,
    kernel_devices,
    register_backend,
    support_report,
    supported_head_dims,
)
from pagedfuse.ops.library import paged_attention, paged_attention_int8, quantize_int8
from pagedfuse.ops.reference import paged_attention_reference, quantize_int8_reference

__all__ = [
    "head_dim_reason",
    "kernel_devices",
    "paged_attention",
    "paged_attention_int8",
    "paged_attention_reference",
    "quantize_int8",
    "quantize_int8_reference",
    "register_backend",
    "support_report",
    "supported_head_dims",
]

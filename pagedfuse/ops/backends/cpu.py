"""The C++ CPU kernels (pagedfuse._C, bound in ops/cpu.py) as a backend."""

from __future__ import annotations

import torch

from pagedfuse.ops import cpu
from pagedfuse.ops.backends.registry import Backend, register_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall, options_missing

# The head dims the C++ kernels serve (and tests/test_cpu_kernels.py covers); the INT8 ones
# fewer, as their integer dot products are exact in fp32 only up to head_dim 256.
FLOAT_HEAD_DIMS = frozenset({32, 64, 80, 96, 128, 160, 192, 256})
INT8_HEAD_DIMS = frozenset({64, 128, 256})


def supports(call: PagedCall) -> str | None:
    return options_missing(call, "cpu", implemented=("window_left", "softcap"))


def host_launch(call: PagedCall) -> dict | None:
    """What the C++ host path (csrc/host) launches this call's signature with: the kernel's
    arguments but pointers (None: the call stays in Python)."""
    args = cpu.signature_args(call)
    if args is None:
        return None
    return {"launcher": "cpu", "args": args, "launch": cpu.kernel_address("paged_attention")}


def host_quantize(x: torch.Tensor) -> dict:
    """The C++ host path's launch of quantize_int8 for x's signature."""
    return {"launcher": "cpu_quantize", "dtype": cpu.dtype_code(x),
            "launch": cpu.kernel_address("quantize_rows")}


BACKEND = register_backend(Backend(
    name="cpu", device="cpu", priority=100,
    head_dims={FLOAT_OP: FLOAT_HEAD_DIMS, INT8_OP: INT8_HEAD_DIMS}, supports=supports,
    run=cpu.paged_attention_into, quantize=cpu.quantize_int8, host_launch=host_launch,
    host_quantize=host_quantize))

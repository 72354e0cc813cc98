"""The CUDA C++ library's binding on any machine: when it is missing, and why a call cannot
take it (the checks run before the device is asked; the kernels are tested on the GPU in
test_cuda_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from pagedfuse.ops import cuda_native


def _args(dtype=torch.bfloat16, hq=8, hkv=2, d=128, row_pad=0):
    query = torch.zeros(3, hq, d, dtype=dtype)
    cache = torch.zeros(4, 16, hkv, d + row_pad, dtype=torch.int8)[..., :d]
    return query, cache, cache, hq // hkv


def test_cpu_tensors_never_take_the_cuda_library():
    assert not cuda_native.int8_decode_available(torch.device("cpu"))
    assert cuda_native.int8_decode_unsupported(*_args()) == \
        "pagedfuse._cuda_kernels not built for this device"


@pytest.mark.parametrize(("kwargs", "reason"), [
    (dict(dtype=torch.float32), "query dtype torch.float32 (bfloat16 or float16 only)"),
    (dict(d=96), "head_dim 96"),
    (dict(hq=32, hkv=2), "16 query heads per KV head (at most 8)"),
    (dict(row_pad=8), "cache rows not 16-byte aligned"),
])
def test_unsupported_calls_say_why(kwargs, reason):
    assert cuda_native.int8_decode_unsupported(*_args(**kwargs)) == reason


"""quantize_int8 on CUDA (the CUDA C++ library's kernel, and Triton's where the library does
not run) equals the reference bit for bit: ties, zero rows, NaN and Inf rows, half inputs,
strided inputs, long rows."""

from __future__ import annotations

import pytest
import torch

from pagedfuse.ops import cuda_native
from pagedfuse.ops.reference import quantize_int8_reference

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _kernels():
    from pagedfuse.ops.triton_quantize import quantize_int8 as triton_quantize

    found = {"op": torch.ops.pagedfuse.quantize_int8, "triton": triton_quantize}
    if cuda_native.decode_available(torch.device("cuda")):
        found["library"] = cuda_native.quantize_int8
    return found


def _assert_matches(x: torch.Tensor) -> None:
    want_q, want_s = quantize_int8_reference(x.cpu())
    for name, kernel in _kernels().items():
        q, s = kernel(x)
        assert q.dtype == torch.int8 and s.dtype == torch.float32, name
        assert q.shape == x.shape and s.shape == x.shape[:-1], name
        assert torch.equal(q.cpu(), want_q), name
        torch.testing.assert_close(s.cpu(), want_s, rtol=0, atol=0, equal_nan=True,
                                   msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 5, 128), (300, 256), (4, 33), (3, 1000)])
def test_random_rows(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape))
    x = torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 10
    _assert_matches(x.to(dtype).cuda())


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_zero_rows_and_non_finite_values(dtype):
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -127.0, 3.25, -0.25])
    x = torch.randn(6, 10) * 3
    x[0] = ties
    x[1] = 0
    x[2, 3] = float("nan")
    x[3, 1] = float("inf")
    x[4, 2], x[4, 5] = float("-inf"), float("inf")
    x[5, 0] = -0.0
    _assert_matches(x.to(dtype).cuda())
    q, s = torch.ops.pagedfuse.quantize_int8(x.to(dtype).cuda())
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, -2, -127, 3, 0] and s[0].item() == 1.0
    assert s[2].isnan() and s[3].isinf() and not q[1].any()


def test_strided_and_empty_inputs():
    x = torch.randn(64, 6, 8, device="cuda").transpose(0, 2)  # last dim has stride 48
    _assert_matches(x)
    _assert_matches(torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)[::2])
    q, s = torch.ops.pagedfuse.quantize_int8(torch.empty(3, 0, device="cuda"))
    assert q.shape == (3, 0) and torch.equal(s.cpu(), torch.zeros(3))

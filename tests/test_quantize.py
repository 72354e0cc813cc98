"""quantize_int8's C++ kernel, and the Triton one in the interpreter, equal the reference bit
for bit (ties, zero rows, half inputs)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedfuse.ops import cpu
from pagedfuse.ops.reference import quantize_int8_reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_matches_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    want_q, want_s = quantize_int8_reference(x)
    for q, s in (cpu.quantize_int8(x), torch.ops.pagedfuse.quantize_int8(x)):
        assert q.dtype == torch.int8 and s.dtype == torch.float32
        assert q.shape == x.shape and s.shape == x.shape[:-1]
        assert torch.equal(q, want_q)
        assert torch.equal(s, want_s)
    return want_q, want_s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (2, 3, 5, 128), (300, 256), (4, 33)])
def test_random_rows(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=gen) * torch.rand(shape[:-1] + (1,), generator=gen) * 10)
    assert_matches_reference(x.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_round_to_even_and_negatives(dtype):
    # max|x| = 127 makes the scale exactly 1, so x / scale lands on the .5 ties.
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -127.0, 3.25, -0.25])
    q, s = assert_matches_reference(row.to(dtype))
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -2, -127, 3, 0]
    assert s.item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows(dtype):
    x = torch.randn(3, 4, 64).to(dtype)
    x[1, 2] = 0
    x[0, 0] = -0.0
    q, s = assert_matches_reference(x)
    assert s[1, 2] == 0 and s[0, 0] == 0
    assert not q[1, 2].any() and not q[0, 0].any()


def test_non_contiguous_input():
    x = torch.randn(64, 6, 8).transpose(0, 2)  # last dim has stride 48
    assert_matches_reference(x)



# The Triton kernel (triton_quantize, the GPU's query quantization) on CPU tensors under
# Triton's interpreter, which takes its rounding without libdevice: fresh random rows, a zero
# row, NaN and Inf, the ties above; a subprocess, since the interpreter is chosen when
# Triton kernels are defined.
_TRITON_SCRIPT = """
import torch
from pagedfuse.ops.reference import quantize_int8_reference
from pagedfuse.ops.triton_quantize import quantize_int8
gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
for d in (64, 128, 256, 33):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(37, 3, d, generator=gen) * 10).to(dtype)
        x[0, 0] = 0
        x[1, 1, 5] = float("nan")
        x[2, 2, 7] = float("inf")
        x[3, 0, :10] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -127.0, 3.25,
                                     -0.25])
        x[3, 0, 10:] = 0
        (q, s), (want_q, want_s) = quantize_int8(x), quantize_int8_reference(x)
        assert torch.equal(q, want_q), (d, dtype, "int8 values")
        assert torch.equal(s.isnan(), want_s.isnan()), (d, dtype, "NaN scales")
        assert torch.equal(s.nan_to_num(), want_s.nan_to_num()), (d, dtype, "scales")
print("matched")
"""


def test_triton_kernel_in_the_interpreter():
    pytest.importorskip("triton")
    run = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0 and "matched" in run.stdout, run.stderr[-3000:]

"""The C++ CPU kernels (pagedfuse._C via pagedfuse.ops.cpu) against the pure-torch reference.

Each case runs twice: through torch.ops.pagedfuse.* (so validation runs too) and straight
into a NaN-filled output (so an element the kernel never writes fails the test). Block tables
are random (out of order, repeated blocks) and their unused tail points outside the cache, so
a kernel that reads past seq_len would read garbage or crash. Both instruction-set paths
(PAGEDFUSE_CPU_ISA=portable and avx512) run where the CPU has AVX-512 VNNI.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
from helpers.backends import threads, use_isa
from helpers.cases import BIAS_SHAPES, Case, make_case
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedfuse
from pagedfuse import numerics
from pagedfuse.ops import cpu
from pagedfuse.ops.backends import get_backend

ISAS = ("portable", "avx512")
CPU = get_backend("cpu")


@pytest.fixture(params=ISAS)
def isa(request):
    with use_isa(request.param):
        yield request.param


def tolerance(c: Case) -> float:
    """The CPU kernels keep INT8 scores exact and P in fp32: an fp32 INT8 call matches the
    reference to fp32 rounding."""
    if c.key_scale is not None and c.query.dtype == torch.float32:
        return numerics.EXACT_INT8_RTOL
    return numerics.KERNEL_RTOL[c.query.dtype]


def check(c: Case, tol: float | None = None) -> torch.Tensor:
    """The op and the kernel straight into a NaN-filled output, against float64."""
    tol = tolerance(c) if tol is None else tol
    ref = c.reference()
    assert ref.abs().sum() > 0, "degenerate case: the reference is all zeros"
    for out in (c.run_op(), c.run_backend(CPU)):
        assert out.dtype == c.query.dtype and out.shape == c.query.shape
        err = numerics.rel_err(out, ref)
        assert err <= tol, f"relative error {err:.3g} > {tol}"
    return out


GQA = [(4, 4, 64), (8, 2, 128), (10, 2, 64), (12, 2, 256), (8, 1, 128)]  # ratios 1, 4, 5, 6, 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}-D{h[2]}")
def test_decode_grid(isa, dtype, layout, heads):
    hq, hkv, d = heads
    for block_size, lens in ((1, [7, 30]), (16, [1, 37, 100]), (256, [300, 5])):
        check(make_case(lens, None, hq, hkv, d, block_size, dtype, layout, seed=block_size))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_prefill(isa, causal, index_dtype, dtype):
    # q_len > 1, one sequence with no query tokens, one whose queries are all its keys, and a
    # query tensor passed by strides.
    c = make_case([50, 19, 33, 70], [5, 0, 33, 17], 12, 2, 64, 16, dtype, "HND", index_dtype,
                  causal=causal, strided_query=True)
    check(c)


@pytest.mark.parametrize("head_dim", [32, 80, 96, 160, 192])
def test_other_float_head_dims(isa, head_dim):
    check(make_case([40, 9], [3, 1], 6, 3, head_dim, 16, causal=True))


@pytest.mark.parametrize("kind", ["float", "int8_kv"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_every_group_size(isa, group, kind):
    # 3 query tokens x group heads per KV head: every row-blocking remainder of the kernels.
    check(make_case([37, 70], [3, 5], group, 1, 64, 16, causal=True, kind=kind))


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", ["full", "per_batch", "per_head_row", "2d"])
def test_attn_bias(isa, kind, shape):
    check(make_case([45, 20, 64], [4, 1, 3], 8, 2, 64, 16, bias=kind, bias_shape=shape,
                    causal=shape == "full"))


def test_half_and_expanded_bias(isa):
    c = make_case([45, 20], [2, 3], 8, 2, 64, 16)
    gen = torch.Generator().manual_seed(5)
    bias = torch.randn(1, 1, 3, 45, generator=gen).to(torch.bfloat16).expand(2, 8, 3, 45)
    check(c.with_(attn_bias=bias))
    bias = torch.randn(2, 8, 3, 1, generator=gen).to(torch.float16)  # one column
    check(c.with_(attn_bias=bias))


def test_fully_masked_rows_are_zero(isa):
    c = make_case([40, 30], [2, 2], 8, 2, 64, 16, bias="bool", bias_shape="full")
    c.attn_bias[0, 3, 1, :] = False  # token 1 of sequence 0, head 3: nothing left
    c.attn_bias[1, :, 0, :] = False  # token 0 of sequence 1, every head
    c.attn_bias[0, 0, 0, :] = True
    for out in (c.run_op(), c.run_backend(CPU)):
        assert torch.equal(out[1, 3], torch.zeros(64))
        assert torch.equal(out[2], torch.zeros(8, 64))
    check(c)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["float", "int8_kv"])
def test_split_kv_combine(isa, causal, kind):
    # One long sequence and one KV head: fewer items than threads, so the context is split
    # and the partial results combined. The bias masks every key of some splits for some rows.
    c = make_case([2000, 700], [2, 1], 4, 1, 128, 16, causal=causal, kind=kind,
                  bias="bool", bias_shape="full")
    c.attn_bias[0, 1, :, 300:] = False
    c.attn_bias[1, 2, :, :650] = False
    with threads(4):
        check(c, 1e-4)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kind", ["int8_kv", "int8_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_against_reference(isa, layout, kind, dtype, head_dim):
    # The reference quantizes the query exactly as the kernel does: only fp32 rounding differs.
    check(make_case([70, 33, 1], [1, 4, 1], 10, 2, head_dim, 16, dtype, layout, causal=True,
                    kind=kind, seed=head_dim))


@pytest.mark.parametrize("kind", ["int8_kv", "int8_k"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_against_unquantized_attention(isa, kind, head_dim):
    # 48 query tokens keep the measured error near its expectation.
    c = make_case([300, 129, 64], [16, 16, 16], 8, 2, head_dim, 16, kind=kind, seed=7)
    ref = c.reference(unquantized=True)
    for out in (c.run_op(), c.run_backend(CPU)):
        assert numerics.rel_err(out, ref) <= numerics.QUANTIZATION_RTOL


def test_isa_env_is_checked():
    with contextlib.ExitStack() as stack:
        stack.callback(os.environ.pop, "PAGEDFUSE_CPU_ISA", None)
        os.environ["PAGEDFUSE_CPU_ISA"] = "sse9"
        with pytest.raises(ValueError, match="PAGEDFUSE_CPU_ISA"):
            make_case([5], [1], 2, 1, 64, 16).run_backend(CPU)


def test_missing_extension_says_make_setup(monkeypatch):
    monkeypatch.delattr(pagedfuse, "_C", raising=False)
    monkeypatch.setitem(sys.modules, "pagedfuse._C", None)
    with pytest.raises(ImportError, match="make setup"):
        cpu.selected_isa()


@st.composite
def fuzz_cases(draw):
    batch = draw(st.integers(1, 3))
    block_size = draw(st.sampled_from([1, 2, 16, 256]))
    seq_lens = draw(st.lists(st.integers(1, 300), min_size=batch, max_size=batch))
    q_lens = [draw(st.integers(0, min(n, 6))) for n in seq_lens]
    if sum(q_lens) == 0:
        q_lens[0] = 1
    num_kv_heads = draw(st.integers(1, 2))
    ratio = draw(st.sampled_from([1, 4, 5, 6, 8, 16]))
    kind = draw(st.sampled_from(["float", "int8_kv", "int8_k"]))
    head_dim = draw(st.sampled_from([32, 64, 80, 128, 256] if kind == "float" else
                                    [64, 128, 256]))
    return dict(
        seq_lens=seq_lens, q_lens=q_lens, num_q_heads=num_kv_heads * ratio,
        num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])),
        layout=draw(st.sampled_from(["NHD", "HND"])),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        causal=draw(st.booleans()), bias=draw(st.sampled_from([None, "bool", "float"])),
        bias_shape=draw(st.sampled_from(BIAS_SHAPES)),
        kind=kind, strided_query=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
    ), draw(st.sampled_from(cpu.available_isas())), draw(st.sampled_from([1, 2, 4]))


@settings(max_examples=40, deadline=None)
@given(fuzz_cases())
def test_fuzz(drawn):
    kwargs, isa_name, n_threads = drawn
    c = make_case(**kwargs)
    with use_isa(isa_name), threads(n_threads):
        ref = c.reference()
        for out in (c.run_op(), c.run_backend(CPU)):
            err = numerics.rel_err(out, ref)
            assert err <= tolerance(c), f"relative error {err:.3g}"

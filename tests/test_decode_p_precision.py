"""benchmarks/decode_p_precision.py's emulation of the INT8 K+V decode kernels: with exact
P·V it must be plain attention (on the dequantized caches, with the query as given or as
quantize_int8 makes it) whatever its tiles, streams, lazy max and splits; with int8 P it must
be the per-tile quantization written out directly (step = tile max of p * v_scale / 127,
l from the unquantized p); and on rows whose scores spread as real ones do the int8 P must
lose attention mass where fp16 P' does not, the error the emulation was built to measure."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
dpp = pytest.importorskip("decode_p_precision")

LOG2E = 1.4426950408889634


def _case(seed: int, batch: int = 2, length: int = 301, hq: int = 6, hkv: int = 2,
          d: int = 64, sink: float = 0.0, sharp: float = 1.0):
    """Random q (times ``sharp``: scores spread that much wider), K, V (token 0's scores
    raised by ``sink`` for every head), INT8 caches."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, length, hkv, d, generator=gen)
    v = torch.randn(batch, length, hkv, d, generator=gen) * torch.rand(
        batch, length, hkv, 1, generator=gen).add(0.1)
    q = torch.randn(batch, hq, d, generator=gen) * sharp
    if sink:
        group = hq // hkv
        k[:, 0] = q.view(batch, hkv, group, d).mean(2) * sink
    (k8, ks), (v8, vs) = (dpp.quantize_int8_reference(x) for x in (k, v))
    return q, k8, ks, v8, vs, 1.0 / math.sqrt(d)


def _kernels(head_dim: int = 64):
    return [dpp.cuda_kernel(head_dim), dpp.TRITON]


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("quantize_query", [False, True])
def test_exact_pv_is_plain_attention(splits, quantize_query):
    q, k8, ks, v8, vs, scale = _case(0)
    length = k8.shape[1]
    query = dpp.quantized_query(q) if quantize_query else q
    want = dpp.attend(query, dpp.dequantize(k8, ks), dpp.dequantize(v8, vs), scale)
    for kernel in _kernels():
        got = dpp.emulate(q, k8, ks, v8, vs, length, scale,
                          dpp.Variant(kernel, "float", quantize_query), splits=splits)
        assert got.out.isfinite().all()
        torch.testing.assert_close(got.out.double(), want, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(got.mass.double(), torch.ones_like(got.mass.double()),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_causal_rows_are_plain_causal_attention(splits):
    """Several query tokens (the Triton kernel's prefill): row t reads keys up to position
    length - n + t, bottom-right aligned."""
    q, k8, ks, v8, vs, scale = _case(3, length=200)
    rows = torch.randn(q.shape[0], 5, *q.shape[1:], generator=torch.Generator().manual_seed(4))
    length = k8.shape[1]
    k, v = dpp.dequantize(k8, ks), dpp.dequantize(v8, vs)
    got = dpp.emulate(rows, k8, ks, v8, vs, length, scale,
                      dpp.Variant(dpp.TRITON, "float", quantize_query=False), splits=splits)
    assert got.out.shape == rows.shape
    for t in range(5):
        last = length - 5 + t  # the row's own position
        want = dpp.attend(rows[:, t], k[:, :last + 1], v[:, :last + 1], scale)
        torch.testing.assert_close(got.out[:, t].double(), want, rtol=2e-5, atol=2e-5)


def _int8_direct(q, k8, ks, v8, vs, scale, tile: int, ties_even: bool):
    """Per-tile int8 P written out over the whole row at once (tiles from key 0): returns
    the output and the mass the numerator keeps."""
    batch, hq, d = q.shape
    hkv = k8.shape[2]
    k = dpp.dequantize(k8, ks).repeat_interleave(hq // hkv, dim=2)  # [B, L, Hq, D]
    x = v8.double().repeat_interleave(hq // hkv, dim=2)
    v_scale = vs.double().repeat_interleave(hq // hkv, dim=2)  # [B, L, Hq]
    s = torch.einsum("bhd,blhd->bhl", dpp.quantized_query(q), k) * scale * LOG2E
    p = torch.exp2(s - s.amax(-1, keepdim=True))  # [B, Hq, L]
    pv = p * v_scale.transpose(1, 2)
    out = torch.zeros(batch, hq, d, dtype=torch.float64)
    kept = torch.zeros(batch, hq, dtype=torch.float64)
    for lo in range(0, p.shape[-1], tile):
        part = pv[..., lo:lo + tile]
        step = part.amax(-1, keepdim=True) / 127
        scaled = part / step
        units = torch.round(scaled) if ties_even else torch.where(
            scaled >= 0, scaled + 0.5, scaled - 0.5).trunc()
        out += torch.einsum("bhl,blhd->bhd", units * step, x[:, lo:lo + tile])
        kept += (units * step / v_scale.transpose(1, 2)[..., lo:lo + tile]).sum(-1)
    total = p.sum(-1)
    return out / total.unsqueeze(-1), kept / total


@pytest.mark.parametrize("splits", [1, 4])
def test_int8_p_is_the_per_tile_quantization(splits):
    q, k8, ks, v8, vs, scale = _case(1, length=333, sink=3.0)
    for kernel in _kernels():
        want, kept = _int8_direct(q, k8, ks, v8, vs, scale, kernel.tile, kernel.ties_even)
        got = dpp.emulate(q, k8, ks, v8, vs, k8.shape[1], scale, dpp.Variant(kernel, "int8"),
                          splits=splits)
        torch.testing.assert_close(got.out.double(), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.mass.double(), kept, rtol=0, atol=1e-5)
        assert (got.mass < 1).any()  # the case does drop mass: the check above has teeth


def test_peaked_rows_int8_p_drops_mass_that_fp16_keeps():
    q, k8, ks, v8, vs, scale = _case(2, batch=3, length=512, sharp=2.0)
    ref = dpp.attend(dpp.quantized_query(q), dpp.dequantize(k8, ks), dpp.dequantize(v8, vs),
                     scale)

    def err(out):
        return float((out.double() - ref).norm() / ref.norm())

    for kernel in _kernels():
        int8 = dpp.emulate(q, k8, ks, v8, vs, 512, scale, dpp.Variant(kernel, "int8"))
        fp16 = dpp.emulate(q, k8, ks, v8, vs, 512, scale, dpp.Variant(kernel, "fp16"))
        pair = dpp.emulate(q, k8, ks, v8, vs, 512, scale, dpp.Variant(kernel, "int8x2"))
        assert float(int8.mass.mean()) < 1 - 1e-3
        assert abs(float(fp16.mass.mean()) - 1) < 1e-4
        assert err(fp16.out) < err(int8.out) / 10
        assert err(pair.out) < err(int8.out) / 10


def test_variant_names():
    assert dpp.variant_named("cuda", 64) == dpp.Variant(dpp.cuda_kernel(64), "fp16")
    assert dpp.variant_named("triton", 64) == dpp.Variant(dpp.TRITON, "fp16")
    assert dpp.variant_named("triton/int8", 64).pv == "int8"
    assert dpp.variant_named("triton+prefill", 64).prefill
    for bad in ("cuda/int4", "cuda+prefill"):
        with pytest.raises(ValueError, match=f"variant '{re.escape(bad)}'"):
            dpp.variant_named(bad, 64)

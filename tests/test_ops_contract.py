"""The op contract: opcheck and export, the reference against an independent float64 oracle,
bad inputs."""

from __future__ import annotations

import math
import re

import pytest
import torch
from helpers.cases import make_case
from torch.library import opcheck

import pagedfuse  # noqa: F401  (registers torch.ops.pagedfuse.*)
from pagedfuse.numerics import rel_err
from pagedfuse.ops import paged_attention_reference, quantize_int8_reference

OPS = torch.ops.pagedfuse


def brute_force(query, key_cache, value_cache, block_table, seq_lens, query_start_loc, scale,
                causal,
                bias=None, key_scale=None, value_scale=None):
    """Token by token, head by head, key by key through the block table, in float64."""
    qsl = query_start_loc
    T, Hq, D = query.shape
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    for b in range(block_table.shape[0]):
        L = int(seq_lens[b])
        q0, q1 = int(qsl[b]), int(qsl[b + 1])
        for i, t in enumerate(range(q0, q1)):
            for h in range(Hq):
                kv = h // (Hq // Hkv)
                q = query[t, h].double()
                if key_scale is not None:  # the INT8 op quantizes the query per token/head
                    qs = q.abs().max() / 127
                    q = torch.round(q / qs).clamp(-127, 127) * qs if qs > 0 else q * 0
                logits, values = [], []
                for j in range(L):
                    blk, slot = int(block_table[b, j // bs]), j % bs
                    k = key_cache[blk, slot, kv].double()
                    v = value_cache[blk, slot, kv].double()
                    if key_scale is not None:
                        k = k * float(key_scale[blk, slot, kv])
                    if value_scale is not None:
                        v = v * float(value_scale[blk, slot, kv])
                    s = float(q @ k) * scale
                    if causal and j > L - (q1 - q0) + i:
                        s = -math.inf
                    if bias is not None:
                        e = bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0,
                                 i if bias.shape[2] > 1 else 0, j if bias.shape[3] > 1 else 0]
                        s = (s if bool(e) else -math.inf) if e.dtype == torch.bool else s + float(e)
                    logits.append(s)
                    values.append(v)
                m = max(logits, default=-math.inf)
                if m == -math.inf:
                    continue
                w = [math.exp(s - m) for s in logits]
                out[t, h] = sum(wi * vi for wi, vi in zip(w, values, strict=True)) / sum(w)
    return out


def contract_case(seed: int, hnd: bool = False, **changes) -> dict:
    """Three sequences of 5, 11 and 7 keys with 1, 3 and 2 query tokens in a 24-block cache of
    4-token pages (the sizes the bad-input messages below name), as the op's first six
    arguments."""
    spec = dict(seq_lens=(5, 11, 7), q_lens=(1, 3, 2), block_size=4, num_blocks=24,
                spare_blocks=0, layout="HND" if hnd else "NHD", seed=seed)
    case = make_case(**{**spec, **changes})
    return {k: v for k, v in case.op_args().items()
            if k in ("query", "key_cache", "value_cache", "block_table", "seq_lens",
                     "query_start_loc")}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hnd", [False, True])
def test_reference_matches_brute_force(causal, hnd):
    c = contract_case(1 + causal + 2 * hnd, hnd)
    want = brute_force(**c, scale=0.2, causal=causal)
    got = paged_attention_reference(**c, scale=0.2, causal=causal, compute_dtype=torch.float64)
    assert rel_err(got, want) < 1e-6  # float64 math, rounded to the float32 output


@pytest.mark.parametrize("scale", [0.0, -0.35])
def test_zero_and_negative_scales_run_as_sdpa_does(scale):
    """SDPA takes any finite scale (0: uniform weights over the visible keys), so the op does
    too: a compiled site with such a scale must not raise where eager runs."""
    c = contract_case(11)
    want = brute_force(**c, scale=scale, causal=True)
    got = OPS.paged_attention(**c, scale=scale, causal=True)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("bias_kind", ["bool", "float"])
def test_reference_bias_matches_brute_force(bias_kind):
    c = contract_case(3)
    g = torch.Generator().manual_seed(4)
    if bias_kind == "bool":
        bias = torch.rand(3, 1, 3, 11, generator=g) > 0.3
        bias[..., 0] = True  # keep one key per row so no row is fully masked
    else:
        bias = torch.randn(1, 8, 3, 11, generator=g)
    want = brute_force(**c, scale=0.3, causal=False, bias=bias)
    got = paged_attention_reference(**c, scale=0.3, causal=False, attn_bias=bias,
                                     compute_dtype=torch.float64)
    assert rel_err(got, want) < 1e-6  # float64 math, rounded to the float32 output


def test_reference_int8_matches_brute_force():
    c = contract_case(5)
    kq, ks = quantize_int8_reference(c["key_cache"])
    vq, vs = quantize_int8_reference(c["value_cache"])
    c.update(key_cache=kq, value_cache=vq)
    want = brute_force(**c, scale=0.125, causal=True, key_scale=ks, value_scale=vs)
    got = paged_attention_reference(**c, scale=0.125, causal=True, key_scale=ks, value_scale=vs,
                                    compute_dtype=torch.float64)
    assert rel_err(got, want) < 1e-6  # float64 math, rounded to the float32 output


def test_reference_can_leave_the_query_unquantized():
    """quantize_query=False: a plain dequantize-then-attend of the INT8 caches (the fidelity
    benchmark's baseline), which is float attention over the dequantized K and V."""
    c = contract_case(7)
    kq, ks = quantize_int8_reference(c["key_cache"])
    vq, vs = quantize_int8_reference(c["value_cache"])
    dequantized = dict(c, key_cache=kq.double() * ks.double().unsqueeze(-1),
                       value_cache=vq.double() * vs.double().unsqueeze(-1))
    want = brute_force(**dequantized, scale=0.125, causal=True)
    c.update(key_cache=kq, value_cache=vq)
    got = paged_attention_reference(**c, scale=0.125, causal=True, key_scale=ks, value_scale=vs,
                                    compute_dtype=torch.float64, quantize_query=False)
    assert rel_err(got, want) < 1e-6
    quantized = paged_attention_reference(**c, scale=0.125, causal=True, key_scale=ks,
                                          value_scale=vs, compute_dtype=torch.float64)
    assert rel_err(quantized, want) > 1e-4  # the op's own semantics do quantize it


def test_fully_masked_rows_are_zero():
    c = contract_case(6)
    bias = torch.ones(3, 1, 3, 11, dtype=torch.bool)
    bias[1] = False
    out = OPS.paged_attention(**c, scale=0.1, causal=False, attn_bias=bias)
    assert torch.equal(out[1:4], torch.zeros_like(out[1:4]))
    assert out[0].abs().sum() > 0 and out[4:].abs().sum() > 0


def test_quantize_int8_reference_semantics():
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0], [0.0, 0.0, 0.0, 0.0], [-254.0, 1.0, 3.0, 2.0]])
    q, s = OPS.quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3,)
    assert s.tolist() == [1.0, 0.0, 2.0]
    assert q.tolist() == [[1, -2, 0, 127], [0, 0, 0, 0], [-127, 0, 2, 1]]  # half to even


def test_int8_op_tracks_unquantized_attention():
    c = contract_case(7, head_dim=128, seq_lens=(40, 64, 33), num_blocks=64)
    exact = paged_attention_reference(**c, scale=128 ** -0.5, causal=True)
    kq, ks = OPS.quantize_int8(c["key_cache"])
    vq, vs = OPS.quantize_int8(c["value_cache"])
    out = OPS.paged_attention_int8(c["query"], kq, vq, ks, vs, *list(c.values())[3:],
                                   scale=128 ** -0.5, causal=True)
    assert rel_err(out, exact) <= 1.2e-2


# --- opcheck (schema, fake impl, autograd registration, dynamic shapes) ---------------------

def _float_args(c):
    return (c["query"], c["key_cache"], c["value_cache"], c["block_table"], c["seq_lens"],
            c["query_start_loc"], 0.125, True)


@pytest.mark.parametrize("hnd", [False, True])
def test_opcheck_paged_attention(hnd):
    c = contract_case(8, hnd)
    opcheck(OPS.paged_attention.default, _float_args(c))
    bias = torch.randn(3, 8, 3, 11)
    opcheck(OPS.paged_attention.default, _float_args(c), {"attn_bias": bias, "max_seq_len": 11})


def test_opcheck_paged_attention_int8():
    c = contract_case(9)
    kq, ks = OPS.quantize_int8(c["key_cache"])
    vq, vs = OPS.quantize_int8(c["value_cache"])
    base = _float_args(c)
    opcheck(OPS.paged_attention_int8.default, (base[0], kq, vq, ks, vs, *base[3:]))
    opcheck(OPS.paged_attention_int8.default, (base[0], kq, c["value_cache"], ks, None, *base[3:]))


def test_opcheck_quantize_int8():
    opcheck(OPS.quantize_int8.default, (torch.randn(5, 3, 64),))
    opcheck(OPS.quantize_int8.default, (torch.randn(7, 128, dtype=torch.bfloat16),))


def test_opcheck_autograd_registration():
    """Inputs that require grad: the op has an Autograd kernel (its outputs get a backward
    that raises, tested in test_backends.py)."""
    c = contract_case(8)
    c["query"] = c["query"].clone().requires_grad_()
    opcheck(OPS.paged_attention.default, _float_args(c),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_export_keeps_the_ops():
    """torch.export traces the ops through their fake impls into the exported graph, whose
    module computes what eager does."""

    class Attend(torch.nn.Module):
        def forward(self, query, key_cache, value_cache, block_table, seq_lens,
                    query_start_loc):
            kq, ks = OPS.quantize_int8(key_cache)
            return OPS.paged_attention_int8(query, kq, value_cache, ks, None, block_table,
                                            seq_lens, query_start_loc, 0.125, True)

    args = tuple(contract_case(14).values())
    exported = torch.export.export(Attend(), args)
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count(OPS.quantize_int8.default) == 1
    assert targets.count(OPS.paged_attention_int8.default) == 1
    assert torch.equal(exported.module()(*args), Attend()(*args))


def test_compiles_with_dynamic_shapes_without_recompiling():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def f(q, kc, vc, bt, sl, qsl):
        return OPS.paged_attention(q, kc, vc, bt, sl, qsl, 0.125, False)

    for B, L in ((5, 26), (6, 37), (9, 45)):  # sizes unlike any other dim (duck sizing)
        c = contract_case(B, q_lens=(1,) * B, seq_lens=(L,) * B, num_blocks=128)
        got = f(*(c[k] for k in ("query", "key_cache", "value_cache", "block_table",
                                 "seq_lens", "query_start_loc")))
        want = paged_attention_reference(**c, scale=0.125, causal=False)
        assert rel_err(got, want) < 1e-5
    assert counter.frame_count == 1


# --- bad inputs: each raises an error naming the argument ------------------------------------

def _call(c, **over):
    args = {**c, "scale": 0.1, "causal": False, **over}
    return OPS.paged_attention(**args)


BAD_INPUTS = [
    ("query rank", lambda c: {"query": c["query"][0]}, ValueError, "query: expected rank 3"),
    ("query dtype", lambda c: {"query": c["query"].int()}, TypeError, "query: dtype int32"),
    ("cache dtype", lambda c: {"key_cache": c["key_cache"].half()}, TypeError,
     "key_cache: dtype float16 must match"),
    ("cache rank", lambda c: {"value_cache": c["value_cache"][0]}, ValueError,
     "value_cache: expected rank 4"),
    ("value shape", lambda c: {"value_cache": c["value_cache"][:5]}, ValueError,
     "value_cache: shape"),
    ("head_dim mismatch", lambda c: {"query": torch.randn(6, 8, 32)}, ValueError,
     "key_cache: head_dim 64 must equal"),
    ("gqa ratio", lambda c: {"query": torch.randn(6, 3, 64)}, ValueError,
     "query: num_q_heads 3 is not a multiple"),
    ("empty cache", lambda c: {"key_cache": c["key_cache"][:0], "value_cache":
                               c["value_cache"][:0]}, ValueError,
     "key_cache: no blocks, but there are query tokens"),
    ("block_table dtype", lambda c: {"block_table": c["block_table"].float()}, TypeError,
     "block_table: dtype float32"),
    ("block_table rank", lambda c: {"block_table": c["block_table"].flatten()}, ValueError,
     "block_table: expected rank 2"),
    ("block id too large", lambda c: {"block_table": c["block_table"] + 24}, ValueError,
     "block_table: entries in use span"),
    ("block id below -num_blocks", lambda c: {"block_table": c["block_table"] - 30}, ValueError,
     "block_table: entries in use span"),
    ("seq_lens beyond capacity", lambda c: {"seq_lens": torch.tensor([5, 13, 7])}, ValueError,
     "seq_lens: max 13 exceeds the block table's capacity"),
    ("negative seq_len", lambda c: {"seq_lens": torch.tensor([5, -1, 7])}, ValueError,
     "seq_lens: entries must be >= 0"),
    ("seq_lens length", lambda c: {"seq_lens": torch.tensor([5, 11])}, ValueError,
     "seq_lens: length 2 must equal"),
    ("qsl decreasing", lambda c: {"query_start_loc": torch.tensor([0, 4, 3, 6])}, ValueError,
     "query_start_loc: must be non-decreasing"),
    ("qsl start", lambda c: {"query_start_loc": torch.tensor([1, 2, 5, 6])}, ValueError,
     "query_start_loc: must start at 0"),
    ("qsl end", lambda c: {"query_start_loc": torch.tensor([0, 1, 4, 5])}, ValueError,
     "query_start_loc: last entry 5 must equal"),
    ("qsl length", lambda c: {"query_start_loc": torch.tensor([0, 6])}, ValueError,
     "query_start_loc: length 2 must be batch + 1"),
    ("device", lambda c: {"seq_lens": c["seq_lens"].to("meta")}, ValueError,
     "seq_lens: on meta"),
    ("not a tensor", lambda c: {"block_table": [[0, 1]]}, RuntimeError,
     "for argument 'block_table' but instead found type 'list'"),
    ("misaligned rows", lambda c: {"query": torch.randn(6, 8, 65)[..., :64]}, ValueError,
     "query: stride 65 of dim 1 is not a multiple of 16 bytes"),
    ("non-contiguous innermost", lambda c: {"query": torch.randn(6, 64, 8).transpose(1, 2)},
     ValueError, "query: innermost dim must be contiguous"),
    ("overlapping strides", lambda c: {
        "key_cache": torch.randn(24, 1, 2, 64).expand(24, 4, 2, 64)}, ValueError,
     "key_cache: overlapping strides"),
    ("bias rank", lambda c: {"attn_bias": torch.randn(11)}, ValueError,
     "attn_bias: must have 2 to 4 dims"),
    ("bias batch", lambda c: {"attn_bias": torch.randn(2, 1, 3, 11)}, ValueError,
     "attn_bias: shape (2, 1, 3, 11) does not broadcast"),
    ("bias too short", lambda c: {"attn_bias": torch.randn(3, 1, 3, 8)}, ValueError,
     "attn_bias: 8 key columns"),
    ("bias dtype", lambda c: {"attn_bias": torch.ones(3, 1, 3, 11, dtype=torch.int32)},
     TypeError, "attn_bias: dtype int32"),
    ("scale", lambda c: {"scale": float("nan")}, ValueError, "scale: must be a finite float"),
    ("max_seq_len hint", lambda c: {"max_seq_len": 4}, ValueError,
     "max_seq_len: hint 4 < longest sequence 11"),
]


@pytest.mark.parametrize("name,override,exc,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_argument(name, override, exc, message):
    c = contract_case(10)
    with pytest.raises(exc, match=re.escape(message)):
        _call(c, **override(c))


def test_bad_input_caught_at_trace_time():
    """Shape errors surface from the fake impl, before any kernel runs."""
    c = contract_case(11)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in c.items()}
        with pytest.raises(ValueError, match="query: num_q_heads 3 is not a multiple"):
            _call(fake, query=torch.empty(6, 3, 64))


@pytest.mark.parametrize("case", ["key_scale missing", "key_scale shape", "value_scale missing",
                                  "value_scale with float V", "key not int8", "head_dim"])
def test_bad_int8_inputs(case):
    c = contract_case(12)
    kq, ks = OPS.quantize_int8(c["key_cache"])
    vq, vs = OPS.quantize_int8(c["value_cache"])
    args = dict(query=c["query"], key_cache=kq, value_cache=vq, key_scale=ks, value_scale=vs)
    expect = {
        "key_scale missing": (ValueError, "key_scale: required by paged_attention_int8"),
        "key_scale shape": (ValueError, r"key_scale: shape \(24, 4, 1\) must be \(24, 4, 2\)"),
        "value_scale missing": (ValueError, "value_scale: required when value_cache is int8"),
        "value_scale with float V": (ValueError, "value_scale: must be None when value_cache"),
        "key not int8": (TypeError, "key_cache: dtype float32 not in"),
        "head_dim": (ValueError, r"query: head_dim 32 not in \{64, 128, 256\} for "
                                 "paged_attention_int8 on cpu"),
    }[case]
    if case == "key_scale missing":
        args["key_scale"] = None
    elif case == "key_scale shape":
        args["key_scale"] = ks[..., :1]
    elif case == "value_scale missing":
        args["value_scale"] = None
    elif case == "value_scale with float V":
        args["value_cache"] = c["value_cache"]
    elif case == "key not int8":
        args["key_cache"] = c["key_cache"]
    else:
        args = dict(query=c["query"][..., :32].contiguous(), key_cache=kq[..., :32].contiguous(),
                    value_cache=vq[..., :32].contiguous(), key_scale=ks, value_scale=vs)
    with pytest.raises(expect[0], match=expect[1]):
        OPS.paged_attention_int8(**args, block_table=c["block_table"], seq_lens=c["seq_lens"],
                                 query_start_loc=c["query_start_loc"], scale=0.1, causal=False)


def test_quantize_bad_input():
    with pytest.raises(TypeError, match="x: dtype int32"):
        OPS.quantize_int8(torch.ones(3, 4, dtype=torch.int32))


# --- value checks: eager on CPU, behind PAGEDFUSE_CHECKS=1 on a device -----------------------

def test_value_checks_switch(monkeypatch):
    from pagedfuse.ops.validate import value_checks_enabled

    monkeypatch.delenv("PAGEDFUSE_CHECKS", raising=False)
    assert value_checks_enabled(torch.device("cpu"))
    assert not value_checks_enabled(torch.device("cuda"))
    monkeypatch.setenv("PAGEDFUSE_CHECKS", "1")
    assert value_checks_enabled(torch.device("cuda"))


@pytest.mark.cuda
def test_cuda_block_ids_checked_on_request_and_clamped_otherwise(monkeypatch):
    c = {k: v.cuda() for k, v in contract_case(13, head_dim=128).items()}
    bad = c["block_table"].clone()
    bad[1, 0] = 10**6
    monkeypatch.setenv("PAGEDFUSE_CHECKS", "1")
    with pytest.raises(ValueError, match="block_table: entries in use span"):
        _call(c, block_table=bad)
    monkeypatch.delenv("PAGEDFUSE_CHECKS")
    out = _call(c, block_table=bad)  # no host sync: the kernel clamps the id, reads in bounds
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    good = _call(c)
    assert torch.equal(out[0], good[0]) and torch.equal(out[4:], good[4:])  # other sequences


def test_block_ids_are_checked_only_where_a_sequence_uses_them():
    """A sequence with no keys may hold any ids (the check must not take its row as in use,
    nor any column past a sequence's blocks); an id outside the cache that a later sequence
    uses is refused, naming block_table."""
    c = make_case(seq_lens=(0, 9, 21), q_lens=(1, 1, 1), num_blocks=16, block_size=4)
    c.block_table[0] = 10_000  # sequence 0 reads no key
    got = c.run_op()
    assert rel_err(got, c.reference()) < 1e-5
    used = c.with_(block_table=c.block_table.clone())
    used.block_table[2, 5] = 16  # sequence 2's sixth block (keys 20..23): one past the cache
    with pytest.raises(ValueError, match=r"block_table: entries in use span \[.*, 16\]"):
        used.run_op()

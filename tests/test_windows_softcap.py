"""The ops' options ``window_left`` and ``softcap``: their semantics against an independent
float64 oracle, argument checks (eager and at trace time), opcheck, and how the kernel
backends that do not implement them yet decline (the op then runs the reference).

The semantics: sequence b's query token t of q_len sits at position p = seq_len - q_len + t
and, with ``window_left`` W, reads only keys j > p - W (with ``causal`` too: (p - W, p]);
with ``softcap`` c a scaled score s becomes c * tanh(s / c) before attn_bias is added, the
order of transformers' Gemma2 (scale, cap, mask)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.cases import make_case
from torch.library import opcheck

import pagedfuse  # noqa: F401  (registers torch.ops.pagedfuse.*)
from pagedfuse import numerics
from pagedfuse.ops.backends import all_backends, get_backend, reason, support_report
from pagedfuse.ops.reference import paged_attention_reference

OPS = torch.ops.pagedfuse


def oracle(case) -> torch.Tensor:
    """Dense float64 attention per sequence, its mask written from the positions, written
    independently of the reference (no shared helper)."""
    c = case.to("cpu")
    query = c.query.double()
    out = torch.zeros(query.shape, dtype=torch.float64)
    block_size, hkv = c.key_cache.shape[1], c.key_cache.shape[2]
    group = query.shape[1] // hkv
    bias = c.attn_bias
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    starts = c.query_start_loc.tolist()
    for b, length in enumerate(c.seq_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        n = q1 - q0
        keys = [(int(c.block_table[b, j // block_size]), j % block_size) for j in range(length)]
        k = torch.stack([c.key_float[blk, slot] for blk, slot in keys]).double() \
            if keys else torch.zeros(0, hkv, query.shape[2], dtype=torch.float64)
        v = torch.stack([c.value_float[blk, slot] for blk, slot in keys]).double() \
            if keys else torch.zeros(0, hkv, query.shape[2], dtype=torch.float64)
        for i in range(n):
            p = length - n + i
            for h in range(query.shape[1]):
                s = (k[:, h // group] @ query[q0 + i, h]) * c.scale
                if c.softcap is not None:
                    s = c.softcap * torch.tanh(s / c.softcap)
                keep = torch.ones(length, dtype=torch.bool)
                j = torch.arange(length)
                if c.causal:
                    keep &= j <= p
                if c.window_left is not None:
                    keep &= p - j < c.window_left
                if bias is not None:
                    e = bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0,
                             i if bias.shape[2] > 1 else 0][..., :length].double()
                    s = s + (torch.where(e.bool(), 0.0, -math.inf)
                             if bias.dtype == torch.bool else e).expand(length)
                s = s.masked_fill(~keep, -math.inf)
                if length and s.max() > -math.inf:  # else no visible key: zeros
                    out[q0 + i, h] = torch.softmax(s, dim=0) @ v[:, h // group]
    return out


# (name, make_case arguments): windows of 1, 7, 16, 4096 and longer than every context,
# with and without causal, q_len > 1; softcap alone, with a window and with a bias.
CASES = {
    "w1-decode": dict(window_left=1),
    "w7-prefill-causal": dict(seq_lens=(30, 12, 5), q_lens=(6, 12, 2), causal=True,
                              window_left=7),
    "w7-prefill-noncausal": dict(seq_lens=(30, 12, 5), q_lens=(6, 12, 2), window_left=7),
    "w16-decode-hnd": dict(seq_lens=(45, 16, 3), layout="HND", window_left=16),
    "w16-prefill-gqa8": dict(seq_lens=(40, 17), q_lens=(9, 17), num_q_heads=16,
                             causal=True, window_left=16),
    "w4096-long": dict(seq_lens=(4200, 33), q_lens=(3, 2), num_q_heads=4, num_kv_heads=1,
                       head_dim=32, causal=True, window_left=4096),
    "w-beyond-context": dict(seq_lens=(37, 20, 5), q_lens=(2, 3, 5), causal=True,
                             window_left=10_000),
    "w3-more-queries-than-keys": dict(seq_lens=(2, 6), q_lens=(4, 6), causal=True,
                                      window_left=3),
    "softcap": dict(seq_lens=(30, 12), q_lens=(3, 1), softcap=2.0),
    "softcap-window-bias": dict(seq_lens=(30, 12), q_lens=(4, 2), causal=True,
                                bias="float", bias_shape="per_batch", window_left=5,
                                softcap=3.0),
    "softcap-w4-bool-bias": dict(seq_lens=(33, 9), q_lens=(2, 3), bias="bool",
                                 bias_shape="2d", window_left=4, softcap=50.0),
}


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_the_oracle(name):
    case = make_case(**CASES[name], seed=len(name))
    want = oracle(case)
    assert want.abs().sum() > 0
    got = case.reference()
    assert numerics.rel_err(got, want) < 1e-6, name  # float64 math, float32 output


@pytest.mark.parametrize("name", CASES)
def test_the_op_matches_the_oracle_on_the_cpu(name):
    """Through torch.ops.pagedfuse: no CPU kernel implements the options yet, so the op runs
    the reference (the contract holds everywhere, only the speed differs)."""
    case = make_case(**CASES[name], seed=len(name))
    got = case.run_op()
    assert numerics.rel_err(got, oracle(case)) <= numerics.kernel_tolerance(torch.float32)


def test_the_window_and_the_cap_change_the_result():
    """The cases above would pass with the options ignored if they never mattered."""
    base = make_case(seq_lens=(40, 33), q_lens=(5, 3), causal=True, seed=3)
    plain = base.reference()
    for changes in (dict(window_left=7), dict(softcap=1.0)):
        other = base.with_(**changes).reference()
        assert numerics.rel_err(other, plain) > 1e-2, changes


@pytest.mark.parametrize("window_left", [1, 7])
def test_int8_window_and_softcap_match_the_oracle(window_left):
    """The INT8 op quantizes the query: compare with float attention over the caches before
    quantization, to quantization accuracy, and with its own reference exactly."""
    case = make_case(seq_lens=(40, 21), q_lens=(3, 2), head_dim=128, kind="int8_kv",
                     causal=True, window_left=window_left, softcap=4.0, seed=5)
    got = case.run_op()
    assert numerics.rel_err(got, case.reference()) <= numerics.EXACT_INT8_RTOL * 10
    assert numerics.rel_err(got, oracle(case)) <= numerics.QUANTIZATION_RTOL


def test_window_beyond_every_context_is_no_window():
    case = make_case(seq_lens=(37, 20, 5), q_lens=(2, 3, 5), causal=True, seed=9)
    windowed = case.with_(window_left=38).run_op()
    assert torch.equal(windowed, case.reference(dtype=torch.float32))


def _args(case) -> dict:
    return {k: v for k, v in case.op_args().items() if k not in ("window_left", "softcap")}


@pytest.mark.parametrize(("option", "value"), [
    ("window_left", 0), ("window_left", -3), ("softcap", 0.0),
    ("softcap", -1.0), ("softcap", float("nan")), ("softcap", float("inf")),
])
def test_bad_options_name_the_argument(option, value):
    case = make_case(seed=1)
    with pytest.raises(ValueError, match=f"^{option}: "):
        OPS.paged_attention(**_args(case), **{option: value})
    with torch._subclasses.FakeTensorMode() as mode:  # the fake impl checks them at trace time
        fake_args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                     for k, v in _args(case).items()}
        with pytest.raises(ValueError, match=f"^{option}: "):
            OPS.paged_attention(**fake_args, **{option: value})


def test_opcheck_with_options():
    case = make_case(seq_lens=(13, 6), q_lens=(3, 1), causal=True, seed=2)
    args = _args(case)
    positional = tuple(args.pop(k) for k in ("query", "key_cache", "value_cache", "block_table",
                                             "seq_lens", "query_start_loc", "scale", "causal"))
    opcheck(OPS.paged_attention.default, positional,
            {"window_left": 4, "softcap": 30.0, "max_seq_len": 13})
    int8 = make_case(seq_lens=(13, 6), q_lens=(3, 1), head_dim=128, kind="int8_kv", seed=2)
    opcheck(OPS.paged_attention_int8.default,
            (int8.query, int8.key_cache, int8.value_cache, int8.key_scale, int8.value_scale,
             int8.block_table, int8.seq_lens, int8.query_start_loc, 0.1, False),
            {"window_left": 2, "softcap": 5.0})


def test_kernels_without_the_options_decline_with_a_reason():
    case = make_case(seed=4)
    for options, names in ((dict(window_left=8), "window_left"), (dict(softcap=5.0), "softcap"),
                           (dict(window_left=8, softcap=5.0), "window_left, softcap")):
        call = case.with_(**options).call()
        for backend in all_backends():
            why = reason(backend, call)
            if backend.device is None:
                assert why is None, backend.name  # the reference serves every call
            elif backend.device == "cpu":
                assert why == f"{names}: not in the cpu kernel yet"
        report = support_report(case.op, case.query, case.key_cache, case.value_cache,
                                case.block_table, case.seq_lens, case.query_start_loc,
                                **options)
        assert report.chosen is None and f"cpu: {names}: not in the cpu kernel yet" in str(report)


def test_a_forced_backend_without_the_option_is_an_error(monkeypatch):
    case = make_case(seed=4)
    monkeypatch.setenv("PAGEDFUSE_BACKEND", "cpu")
    with pytest.raises(ValueError, match="PAGEDFUSE_BACKEND=cpu cannot run this call: "
                                         "window_left: not in the cpu kernel yet"):
        OPS.paged_attention(**_args(case), window_left=3)
    monkeypatch.setenv("PAGEDFUSE_BACKEND", "reference")
    got = OPS.paged_attention(**_args(case), window_left=3)
    assert torch.equal(got, case.with_(window_left=3).reference(dtype=torch.float32))


def test_the_choice_per_signature_tells_the_options_apart():
    """The op caches its backend choice per call signature: a window call after a plain one
    of the same shapes must not reuse the kernel chosen for the plain one."""
    case = make_case(seq_lens=(40, 33), q_lens=(5, 3), causal=True, seed=6)
    plain = case.run_op()
    windowed = case.with_(window_left=4).run_op()
    capped = case.with_(softcap=1.5).run_op()
    assert numerics.rel_err(plain, case.reference()) <= 1e-4
    assert numerics.rel_err(windowed, oracle(case.with_(window_left=4))) <= 1e-4
    assert numerics.rel_err(capped, oracle(case.with_(softcap=1.5))) <= 1e-4
    assert torch.equal(case.run_op(), plain)


def test_reference_keyword_defaults_are_off():
    case = make_case(seq_lens=(20, 9), q_lens=(2, 1), causal=True, seed=8)
    c = case.op_args()
    explicit = paged_attention_reference(c["query"], c["key_cache"], c["value_cache"],
                                         c["block_table"], c["seq_lens"], c["query_start_loc"],
                                         c["scale"], True, window_left=None, softcap=None)
    assert torch.equal(explicit, case.reference(dtype=torch.float32))
    assert get_backend("reference").supports(case.with_(window_left=2).call()) is None

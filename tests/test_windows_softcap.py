"""The ops' options ``window_left`` and ``softcap``: their semantics against an independent
float64 oracle, argument checks (eager and at trace time), opcheck, how a kernel backend
that does not implement them declines, and the rewrite of sliding-window masks to
window_left (held to eager with a stand-in that runs the reference; the soft cap's rewrite is
in test_explicit_attention.py, the kernels' numerics in test_window_kernels.py).

The semantics: sequence b's query token t of q_len sits at position p = seq_len - q_len + t
and, with ``window_left`` W, reads only keys j > p - W (with ``causal`` too: (p - W, p]);
with ``softcap`` c a scaled score s becomes c * tanh(s / c) before attn_bias is added, the
order of transformers' Gemma2 (scale, cap, mask)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import programs
from helpers.backends import NO_OPTIONS, OPTIONS_STAND_IN, registered, without_backends
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
    """Through torch.ops.pagedfuse, which runs the CPU kernel."""
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
    assert torch.equal(windowed, case.run_op())


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


OPTION_SETS = ((dict(window_left=8), "window_left"), (dict(softcap=5.0), "softcap"),
               (dict(window_left=8, softcap=5.0), "window_left, softcap"))


def test_kernels_without_the_options_decline_with_a_reason():
    """On a device whose only kernel lacks the options (NO_OPTIONS), a call using them is
    declined with the names, and no backend is chosen; the CPU kernels take them all."""
    case = make_case(seed=4)
    for options, _ in OPTION_SETS:
        call = case.with_(**options).call()
        assert [b.name for b in all_backends() if b.device in (None, "cpu")
                and reason(b, call) is not None] == []
    with without_backends("cpu"), registered(NO_OPTIONS):
        for options, names in OPTION_SETS:
            call = case.with_(**options).call()
            assert reason(NO_OPTIONS, call) == f"{names}: not in the no_options kernel yet"
            assert reason(get_backend("reference"), call) is None
            report = support_report(case.op, case.query, case.key_cache, case.value_cache,
                                    case.block_table, case.seq_lens, case.query_start_loc,
                                    **options)
            assert report.chosen is None
            assert f"no_options: {names}: not in the no_options kernel yet" in str(report)


def test_a_forced_backend_without_the_option_is_an_error(monkeypatch):
    case = make_case(seed=4)
    with registered(NO_OPTIONS):
        monkeypatch.setenv("PAGEDFUSE_BACKEND", "no_options")
        with pytest.raises(ValueError, match="PAGEDFUSE_BACKEND=no_options cannot run this "
                                             "call: window_left: not in the no_options "
                                             "kernel yet"):
            OPS.paged_attention(**_args(case), window_left=3)
    monkeypatch.setenv("PAGEDFUSE_BACKEND", "reference")
    got = OPS.paged_attention(**_args(case), window_left=3)
    assert torch.equal(got, case.with_(window_left=3).reference(dtype=torch.float32))
    monkeypatch.setenv("PAGEDFUSE_BACKEND", "cpu")
    got = OPS.paged_attention(**_args(case), window_left=3)
    assert numerics.rel_err(got, oracle(case.with_(window_left=3))) <= 1e-4


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


# --- the rewrite: sliding-window masks read as window_left ------------------------------------

def windowed(mask_fn):
    """Paged attention whose mask ``mask_fn(q_len, keys, sl)`` is a sliding window."""

    def fn(q, kc, vc, bt, sl, *rest):
        k = kc[bt].flatten(1, 2).transpose(1, 2)
        v = vc[bt].flatten(1, 2).transpose(1, 2)
        mask = mask_fn(q.shape[2], k.shape[2], sl)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return fn


W = 5


def _bottom_right(q_len, keys, sl):  # causal and (p - j < W) at the op's positions
    pos, q_pos = torch.arange(keys), torch.arange(q_len)[:, None] + (keys - q_len)
    return (pos <= q_pos) & (q_pos - pos < W)


def _additive_sum(q_len, keys, sl):  # the same as a sum of two 0/-inf masks
    pos, q_pos = torch.arange(keys), torch.arange(q_len)[:, None] + (keys - q_len)
    causal = torch.where(pos <= q_pos, 0.0, float("-inf"))
    return causal + torch.where(pos > q_pos - W, 0.0, float("-inf"))


def _top_left(q_len, keys, sl):  # queries at 0..q_len-1: another window, not the op's causal
    pos, q_pos = torch.arange(keys), torch.arange(q_len)[:, None]
    return (pos <= q_pos) & (q_pos - pos < W)


def _decode_lengths(q_len, keys, sl):  # the last W keys of each sequence
    pos = torch.arange(keys)
    return ((pos < sl[:, None]) & (pos >= sl[:, None] - W))[:, None, None, :]


def _causal_off_by_one(q_len, keys, sl):  # one future key visible: no causal term
    pos, q_pos = torch.arange(keys), torch.arange(q_len)[:, None] + (keys - q_len)
    return (pos <= q_pos + 1) & (q_pos - pos < W)


# name: (mask, q_len, op's window_left, causal read, mask kept as attn_bias, sliced table)
WINDOWS = {
    "bottom-right": (_bottom_right, 4, W, True, False, False),
    "square": (_bottom_right, 12, W, True, False, False),
    "additive sum": (_additive_sum, 3, W, True, False, False),
    "top-left": (_top_left, 3, 12 - 3 + W, False, True, False),
    "decode lengths": (_decode_lengths, 1, W, False, True, False),
    "decode lengths, sliced table": (_decode_lengths, 1, W, False, True, True),
    "causal off by one": (_causal_off_by_one, 3, W, False, True, False),
}


def _window_case(q_len: int, sliced: bool) -> programs.Case:
    case = programs.make_case(programs.Spec(), q_len=q_len, seed=q_len)
    if sliced:  # lengths up to 12 over the first 2 blocks (8 keys): the mask clips them
        case.bt = case.bt[:, :2]
    return case


@pytest.mark.parametrize("name", WINDOWS)
def test_window_masks_are_read_and_held_to_eager(name):
    """With a stand-in for the window kernels, each sliding-window mask is rewritten to the
    op with window_left (and causal where the mask says it at the op's positions), and the
    rewritten program equals eager; a mask the op's terms do not say entirely stays as
    attn_bias, the window only a hint that skips keys it hides anyway."""
    mask_fn, q_len, window, causal, bias, sliced = WINDOWS[name]
    case = _window_case(q_len, sliced)
    fn = windowed(mask_fn)
    with registered(OPTIONS_STAND_IN):
        capture, report, out = programs.compile_fn(fn, case.args())
    assert report.num_rewritten == 1, str(report)
    node = programs.op_node(capture)
    assert node.kwargs == {"window_left": window}
    assert node.args[7] is causal and (node.args[8] is not None) is bias
    assert numerics.max_rel_err(out, fn(*case.args()), skip_nan_reference=True) < \
        programs.TOL[torch.float32]
    checks = {c.name: c.reason for c in report.sites[0].checks}
    assert f"window_left {window}" in checks["window"]
    assert ("as a hint" in checks["window"]) is bias


def test_a_window_that_is_not_the_ops_stays_attn_bias():
    """``p - j < W`` measured from lengths without a length term: the op's positions (from
    the gathered keys) may be later than the mask's, so no window is read; the site is
    rewritten with the mask as attn_bias alone."""
    def mask_fn(q_len, keys, sl):
        pos = torch.arange(keys)
        return (pos >= sl[:, None] - W)[:, None, None, :]

    case = _window_case(1, False)
    fn = windowed(mask_fn)
    capture, report, out = programs.compile_fn(fn, case.args())
    assert report.num_rewritten == 1, str(report)
    node = programs.op_node(capture)
    assert node.kwargs == {} and node.args[8] is not None
    checks = {c.name: c.reason for c in report.sites[0].checks}
    assert checks["window"].startswith("no window read off the mask")
    assert numerics.max_rel_err(out, fn(*case.args())) < 1e-4


def test_window_site_is_rewritten():
    """With the CPU kernel itself: rewritten with window_left, and equal to eager."""
    case = _window_case(4, False)
    fn = windowed(_bottom_right)
    capture, report, out = programs.compile_fn(fn, case.args())
    assert report.num_rewritten == 1, str(report)
    assert programs.op_node(capture).kwargs == {"window_left": W}
    assert numerics.max_rel_err(out, fn(*case.args()), skip_nan_reference=True) < \
        programs.TOL[torch.float32]


def test_window_site_says_which_kernel_lacks_it():
    case = _window_case(4, False)
    with without_backends("cpu"), registered(NO_OPTIONS):
        capture, report, _ = programs.compile_fn(windowed(_bottom_right), case.args())
    failed = report.sites[0].first_failure
    assert failed.name == "kernel"
    assert "no_options: window_left: not in the no_options kernel yet" in failed.reason
    assert capture.count(*programs.PAGED) == 0

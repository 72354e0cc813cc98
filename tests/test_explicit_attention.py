"""The explicit spelling of attention (matmul, scale, soft cap, + mask, softmax, cast back,
dropout, matmul), as transformers' eager code writes it: every variant that computes what
SDPA computes is rewritten to the same op, and every near miss stays as written with the
reason the report gives."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.backends import NO_OPTIONS, OPTIONS_STAND_IN, registered, without_backends
from helpers.capture import count_calls
from helpers.differential import differential
from helpers.programs import PAGED, TOL, Spec, compile_fn, make_case, op_node

from pagedfuse.numerics import max_rel_err


def gathered(kc, vc, bt, group):
    """K/V [B, Hq, L, D] gathered through the table, heads repeated for GQA."""
    k = kc[bt].flatten(1, 2).transpose(1, 2)
    v = vc[bt].flatten(1, 2).transpose(1, 2)
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def length_mask(sl, keys, dtype):
    valid = torch.arange(keys) < sl[:, None]
    return torch.where(valid, 0.0, float("-inf"))[:, None, None, :].to(dtype)


def _transformers(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    scores = scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _div_sqrt(q, k, v, mask):
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(scores, dim=-1) @ v


def _query_scaled(q, k, v, mask):
    q = q * q.shape[-1] ** -0.5
    return (q @ k.transpose(-2, -1) + mask).softmax(-1) @ v


def _float_softmax_type_as(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
    return torch.matmul(scores.float().softmax(dim=3).type_as(q), v)


def _dropout_eval(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
    probs = F.dropout(F.softmax(scores, dim=-1), p=0.3, training=False)
    return torch.matmul(probs, v)


def _dropout_zero_training(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask
    return torch.matmul(F.dropout(F.softmax(scores, dim=-1), p=0.0, training=True), v)


def _no_mask(q, k, v, mask):
    return torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.2, dim=-1) @ v


SPELLINGS = {
    "transformers": _transformers, "div_sqrt": _div_sqrt, "query_scaled": _query_scaled,
    "float_softmax_type_as": _float_softmax_type_as, "dropout_eval": _dropout_eval,
    "dropout_zero_training": _dropout_zero_training, "no_mask": _no_mask,
}


def program(spelling, group_repeat: bool = True):
    def fn(q, kc, vc, bt, sl, *rest):
        group = q.shape[1] // kc.shape[2] if group_repeat else 1
        k, v = gathered(kc, vc, bt, group)
        return SPELLINGS[spelling](q, k, v, length_mask(sl, k.shape[2], q.dtype))

    return fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_explicit_spellings_are_rewritten(spelling, dtype):
    case = make_case(Spec(dtype=dtype), q_len=2)
    fn = program(spelling)
    capture, report, out = compile_fn(fn, case.args())
    assert report.num_sites == report.num_rewritten == 1, str(report)
    assert capture.count(*PAGED) == 1
    gm = capture.graphs[0]
    assert count_calls(gm, torch.matmul, F.softmax, torch.softmax, "softmax") == 0, gm.code
    assert max_rel_err(out, fn(*case.args())) < TOL[dtype]
    checks = {c.name: c for c in report.sites[0].checks}
    assert "matmul(q, k^T)" in checks["explicit attention"].reason


def test_a_single_kv_head_broadcast_by_matmul_is_gqa():
    case = make_case(Spec(), q_len=3, kv_heads=1)
    fn = program("transformers", group_repeat=False)
    capture, report, out = compile_fn(fn, case.args())
    assert report.num_rewritten == 1, str(report)
    assert max_rel_err(out, fn(*case.args())) < TOL[torch.float32]


def test_rows_the_mask_hides_entirely_are_nan_as_the_explicit_softmax_gives_them():
    """The explicit softmax gives a row with no visible key NaN (SDPA and the op: zeros); the
    replacement sets those rows of the op's output to NaN, so the rewritten program gives the
    same NaN rows (the length mask itself becomes seq_lens)."""
    case = make_case(Spec(), q_len=2)
    case.sl[1] = 0  # sequence 1 sees no key
    outcome = differential(program("transformers"), case.args())
    outcome.check()
    assert outcome.rewritten, str(outcome.report)
    capture, report, out = compile_fn(program("transformers"), case.args())
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()
    node = op_node(capture)
    assert node.args[4].target == "clamp" and node.args[8] is None
    masked_rows = next(c for c in report.sites[0].checks if c.name == "masked rows")
    assert "set to NaN after the op, as the explicit softmax gives it" in masked_rows.reason


def _capped(q, k, v, mask, cap: float = 30.0):
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.125
    scores = torch.tanh(scores / cap) * cap
    scores = scores + mask
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def capped_program(cap: float):
    def fn(q, kc, vc, bt, sl, *rest):
        k, v = gathered(kc, vc, bt, q.shape[1] // kc.shape[2])
        return _capped(q, k, v, length_mask(sl, k.shape[2], q.dtype), cap)

    return fn


@pytest.mark.parametrize("cap", [0.5, 50.0])
def test_softcap_is_read_and_held_to_eager(cap):
    """With a stand-in for the soft-cap kernels the site is rewritten with softcap=c, and the
    rewritten program equals eager (the cap applied after the scale, before the mask)."""
    case = make_case(Spec(), q_len=3)
    fn = capped_program(cap)
    with registered(OPTIONS_STAND_IN):
        capture, report, out = compile_fn(fn, case.args())
    assert report.num_rewritten == 1, str(report)
    assert op_node(capture).kwargs == {"softcap": cap}
    assert max_rel_err(out, fn(*case.args())) < TOL[torch.float32]
    checks = {c.name: c.reason for c in report.sites[0].checks}
    assert checks["softcap"].startswith(f"softcap {cap:g}")


def test_softcap_site_is_rewritten():
    """With the CPU kernel itself: rewritten with softcap, and equal to eager."""
    case = make_case(Spec(), q_len=3)
    fn = capped_program(50.0)
    capture, report, out = compile_fn(fn, case.args())
    assert report.num_rewritten == 1, str(report)
    assert op_node(capture).kwargs == {"softcap": 50.0}
    assert max_rel_err(out, fn(*case.args())) < TOL[torch.float32]


def test_softcap_site_says_which_kernel_lacks_it():
    """Where the device's kernels lack the cap, the site stays as written, saying why."""
    case = make_case(Spec(), q_len=3)
    with without_backends("cpu"), registered(NO_OPTIONS):
        capture, report, out = compile_fn(capped_program(50.0), case.args())
    failed = report.sites[0].first_failure
    assert failed.name == "kernel"
    assert "no_options: softcap: not in the no_options kernel yet" in failed.reason
    assert capture.count(*PAGED) == 0


# --- near misses -----------------------------------------------------------------------------

def near_miss(body):
    def fn(q, kc, vc, bt, sl, *rest):
        k, v = gathered(kc, vc, bt, q.shape[1] // kc.shape[2])
        return body(q, k, v, length_mask(sl, k.shape[2], q.dtype))

    return fn


def _softmax_over_queries(q, k, v, mask):
    return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask, 2), v)


def _scale_after_softmax(q, k, v, mask):
    probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) + mask, dim=-1) * 0.125
    return torch.matmul(probs, v)


def _cap_with_two_constants(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.125
    return torch.matmul(torch.softmax(torch.tanh(scores / 30.0) * 50.0 + mask, dim=-1), v)


def _bare_tanh(q, k, v, mask):
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * 0.125)
    return torch.matmul(torch.softmax(scores + mask, dim=-1), v)


def _mask_before_cap(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask
    return torch.matmul(torch.softmax(torch.tanh(scores / 30.0) * 30.0, dim=-1), v)


def _scale_after_cap(q, k, v, mask):
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) / 30.0) * 30.0
    return torch.matmul(torch.softmax(scores * 0.125 + mask, dim=-1), v)


def _dropout_in_training(q, k, v, mask):
    probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask, dim=-1)
    return torch.matmul(F.dropout(probs, p=0.1, training=True), v)


def _half_softmax(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask
    return torch.matmul(F.softmax(scores, dim=-1, dtype=torch.float16).float(), v)


def _bool_added(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.125 + (mask == 0)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _weights_returned(q, k, v, mask):
    probs = torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.125 + mask, dim=-1)
    return torch.matmul(probs, v), probs


def _masked_fill_scores(q, k, v, mask):
    scores = (torch.matmul(q, k.transpose(2, 3)) * 0.125).masked_fill(mask != 0, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


NEAR_MISSES = {
    "softmax over the query dim": (_softmax_over_queries, "explicit attention",
                                   "normalises over dim 2, not the key dim"),
    "a scale after the softmax": (_scale_after_softmax, "explicit attention",
                                  "scales the probabilities after the softmax"),
    "a cap with two constants": (_cap_with_two_constants, "softcap",
                                 "50 * tanh(s / 30), not c * tanh(s / c) with one c"),
    "a bare tanh": (_bare_tanh, "softcap", "is tanh(s) without the c * tanh(s / c)"),
    "the mask before the cap": (_mask_before_cap, "explicit attention",
                                "the mask comes before the soft cap"),
    "a scale after the cap": (_scale_after_cap, "explicit attention",
                              "the soft cap comes before the scale"),
    "dropout in training": (_dropout_in_training, "dropout",
                            "dropout p (in training)=0.1: the fused kernels do not apply "
                            "dropout (run the model in eval mode, or with p=0)"),
    "softmax in float16": (_half_softmax, "explicit attention",
                           "runs in float16, below the float32 query"),
    "a bool tensor added": (_bool_added, "mask", "is a bool tensor added to the scores"),
    "the weights returned": (_weights_returned, "self-contained", "outside the attention"),
    "masked_fill on the scores": (_masked_fill_scores, "match",
                                  "fills the scores in place of an additive mask"),
}


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_misses_stay_as_written(name):
    body, check, reason = NEAR_MISSES[name]
    fn = near_miss(body)
    case = make_case(Spec(), q_len=2)
    capture, report, out = compile_fn(fn, case.args())
    baseline, _, _ = compile_fn(fn, case.args(), patterns=[])
    assert report.num_sites == 1 and report.num_rewritten == 0, str(report)
    failed = report.sites[0].first_failure
    assert failed.name == check and reason in failed.reason, failed
    assert capture.code() == baseline.code()
    want = fn(*case.args())
    if name != "dropout in training":  # random: only the graph can be compared
        assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in zip(
            out if isinstance(out, tuple) else (out,),
            want if isinstance(want, tuple) else (want,), strict=True))


def test_matmuls_that_are_not_attention_are_no_sites():
    def fn(q, kc, vc, bt, sl, *rest):
        k, v = gathered(kc, vc, bt, q.shape[1] // kc.shape[2])
        not_softmax = torch.matmul(q, k.transpose(2, 3)).relu() @ v
        router = torch.softmax(length_mask(sl, k.shape[2], q.dtype).expand(
            -1, q.shape[1], q.shape[2], -1), -1) @ v  # a softmax of no scores
        return not_softmax + router

    _, report, _ = compile_fn(fn, make_case(Spec()).args())
    assert report.num_sites == 0


def test_a_query_written_after_the_score_matmul_is_not_fused():
    """Eager reads the query at the score matmul, the op at the last matmul: a write to the
    query in between would reach the op only."""

    def fn(q, kc, vc, bt, sl, *rest):
        k, v = gathered(kc, vc, bt, q.shape[1] // kc.shape[2])
        scores = torch.matmul(q, k.transpose(2, 3)) * 0.125 + length_mask(sl, k.shape[2],
                                                                           q.dtype)
        probs = torch.softmax(scores, dim=-1)
        q.mul_(2.0)
        return torch.matmul(probs, v)

    case = make_case(Spec(), q_len=2)
    outcome = differential(fn, case.args())
    outcome.check()
    failed = outcome.report.sites[0].first_failure
    assert failed.name == "cache writes" and "mul_" in failed.reason, failed

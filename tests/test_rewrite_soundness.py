"""One regression test per class of unsound rewrite found by the adversarial sweep (issue 20):
each program sits next to the pattern, and the compiled program must either keep the site
(the report saying why) or leave exactly what eager leaves behind."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.differential import INT8_TOLERANCE, differential

import pagedfuse

B, HQ, HKV, D, BS, M, N = 3, 8, 2, 64, 4, 3, 16


@torch.library.custom_op("pagedfuse_test::halve_", mutates_args=("x",))
def halve_(x: torch.Tensor) -> None:
    """A cache write declared the way serving code declares one (mutates_args)."""
    x.mul_(0.5)


@halve_.register_fake
def _halve_fake(x: torch.Tensor) -> None:
    return None


def _inputs(seed: int = 0, batch: int = B, q_len: int = 1, kv_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HQ, q_len, D, generator=g)
    if kv_dtype == torch.int8:
        kc = torch.randint(-127, 128, (N, BS, HKV, D), generator=g, dtype=torch.int8)
        vc = torch.randint(-127, 128, (N, BS, HKV, D), generator=g, dtype=torch.int8)
    else:
        kc, vc = torch.randn(N, BS, HKV, D, generator=g), torch.randn(N, BS, HKV, D, generator=g)
    bt = torch.randperm(N, generator=g)[:batch * M].view(batch, M)
    sl = torch.randint(1, M * BS + 1, (batch,), generator=g)
    return q, kc, vc, bt, sl


def _int8_inputs() -> tuple[torch.Tensor, ...]:
    """_inputs with INT8 caches, plus their per-token K and V scales."""
    scales = [torch.rand(N, BS, HKV) * 0.02 + 0.005 for _ in range(2)]
    return (*_inputs(kv_dtype=torch.int8), *scales)


def _bhld(pages: torch.Tensor) -> torch.Tensor:
    return pages.flatten(1, 2).transpose(1, 2)


def _assert_kept(outcome, check: str, reason: str) -> None:
    outcome.check()
    assert not outcome.rewritten, outcome.report
    failed = outcome.report.sites[0].first_failure
    assert failed.name == check and reason in failed.reason, failed


# ---- class 1: writes into a cache between the gather and the attention, in any form ----

def _write_in_place_operator(kc, bt):
    kc *= 2


def _write_out_argument(kc, bt):
    torch.mul(kc, 2.0, out=kc)


def _write_through_narrow(kc, bt):
    kc.narrow(0, 0, N // 2).mul_(0.5)


def _write_through_select(kc, bt):
    kc.select(2, 0).zero_()


def _write_through_unbind(kc, bt):
    for page in kc.unbind(0):
        page.add_(1.0)


def _write_through_as_strided(kc, bt):
    kc.as_strided((N * BS * HKV * D // 2,), (2,)).fill_(3.0)


def _write_through_custom_op(kc, bt):
    halve_(kc)


WRITES = {f.__name__.removeprefix("_write_"): f for f in (
    _write_in_place_operator, _write_out_argument, _write_through_narrow,
    _write_through_select, _write_through_unbind, _write_through_as_strided,
    _write_through_custom_op)}


@pytest.mark.parametrize("write", WRITES.values(), ids=WRITES.keys())
def test_cache_write_between_gather_and_attention_in_any_form(write):
    def fn(q, kc, vc, bt, sl):
        k, v = _bhld(kc[bt]), _bhld(vc[bt])
        write(kc, bt)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    _assert_kept(differential(fn, _inputs()), "cache writes", "l_kc_")


def test_cache_written_through_the_base_it_was_viewed_from():
    """``kv[0]`` is read, ``kv[0, b] = x`` writes the same memory through the base."""

    q, kc, vc, bt, _ = _inputs()
    block = int(bt[0, 0])

    def fn(q, kv, bt, x):
        k, v = _bhld(kv[0][bt]), _bhld(kv[1][bt])
        kv[0, block] = x
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    outcome = differential(fn, (q, torch.stack((kc, vc)), bt, torch.randn(BS, HKV, D)))
    _assert_kept(outcome, "cache writes", "l_kv_")


# ---- class 2: value hazards ----

def test_lengths_written_after_the_mask_was_built():
    def fn(q, kc, vc, bt, sl):
        keys = M * BS
        mask = (torch.arange(keys) < sl[:, None])[:, None, None, :]
        sl.sub_(1)  # eager's mask already holds the old lengths
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), attn_mask=mask,
                                              enable_gqa=True)

    q, kc, vc, bt, sl = _inputs()
    differential(fn, (q, kc, vc, bt, sl.clamp_min(2))).check()


def test_block_table_written_through_a_view_after_the_gather():
    def fn(q, kc, vc, bt, sl):
        k, v = _bhld(kc[bt]), _bhld(vc[bt])
        bt.narrow(1, 0, 1).copy_(bt.narrow(1, 1, 1))
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    _assert_kept(differential(fn, _inputs()), "cache writes", "l_bt_")


def test_scales_written_through_a_view_after_the_gather():
    def fn(q, kc, vc, bt, sl, ks, vs):
        k = _bhld(kc[bt].float() * ks[bt][..., None])
        v = _bhld(vc[bt].float() * vs[bt][..., None])
        ks.select(1, 0).mul_(4.0)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    outcome = differential(fn, _int8_inputs(), tolerance=INT8_TOLERANCE)
    _assert_kept(outcome, "cache writes", "l_ks_")


def test_two_reads_of_the_table_on_either_side_of_a_write_are_two_values():
    def fn(q, kc, vc, bt, sl):
        k = _bhld(kc[bt.to(torch.int32)])
        bt[:, 0] = bt[:, 1]
        v = _bhld(vc[bt.to(torch.int32)])
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    outcome = differential(fn, _inputs())
    outcome.check()
    assert not outcome.rewritten


# ---- class 3: views that reinterpret the dtype end the walk ----

@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn], ids=["uint8", "fp8"])
def test_dtype_view_of_an_int8_cache_is_not_a_reshape(dtype):
    def fn(q, kc, vc, bt, sl, ks, vs):
        k = _bhld(kc[bt].view(dtype).float() * ks[bt][..., None])
        v = _bhld(vc[bt].float() * vs[bt][..., None])
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    outcome = differential(fn, _int8_inputs(), tolerance=INT8_TOLERANCE)
    _assert_kept(outcome, "match", "view")


# ---- class 4: gradients, decided at the node ----

def test_learnable_bias_that_requires_grad_is_not_fused():
    def fn(q, kc, vc, bt, sl, slopes):
        keys = M * BS
        bias = slopes[None, :, None, None] * torch.arange(keys, dtype=torch.float32)
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), attn_mask=bias,
                                              enable_gqa=True)

    slopes = torch.rand(HQ, requires_grad=True)
    outcome = differential(fn, (*_inputs(), slopes), backward=True)
    _assert_kept(outcome, "autograd", "the attn_mask")


def test_attention_under_enable_grad_called_from_no_grad():
    def fn(q, kc, vc, bt, sl):
        with torch.enable_grad():
            return F.scaled_dot_product_attention(q * 1.0, _bhld(kc[bt]), _bhld(vc[bt]),
                                                  enable_gqa=True)

    q, *rest = _inputs()
    with torch.no_grad():
        outcome = differential(fn, (q.requires_grad_(), *rest))
    _assert_kept(outcome, "autograd", "require grad where the attention runs with grad enabled")


# ---- class 5: SDPA semantics the rewrite must keep ----

def _length_masked(q, kc, vc, bt, sl):
    keys = bt.shape[1] * BS
    mask = (torch.arange(keys) < sl[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), attn_mask=mask,
                                          enable_gqa=True)


def test_padded_row_whose_sequence_has_no_keys():
    q, kc, vc, bt, sl = _inputs()
    sl[1] = 0
    outcome = differential(_length_masked, (q, kc, vc, bt, sl))
    outcome.check()
    assert outcome.rewritten


def test_padded_prefill_with_more_queries_than_keys():
    q, kc, vc, bt, sl = _inputs(q_len=4)
    sl[:] = torch.tensor([M * BS, 2, 3])
    outcome = differential(_length_masked, (q, kc, vc, bt, sl))
    outcome.check()
    assert outcome.rewritten


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_zero_or_negative_scale_is_rewritten_and_runs(scale):
    """SDPA runs with any finite scale; the op once refused 0, so the compiled program raised
    where eager ran."""
    def fn(q, kc, vc, bt, sl):
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), scale=scale,
                                              enable_gqa=True)

    outcome = differential(fn, _inputs(seed=5))
    outcome.check()
    assert outcome.rewritten


def test_minus_one_padding_in_the_table_under_a_host_built_mask():
    def fn(q, kc, vc, bt, bias):
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), attn_mask=bias,
                                              enable_gqa=True)

    q, kc, vc, bt, _ = _inputs()
    bt[1:, -1] = -1  # unused pages, masked on the host
    bias = torch.zeros(B, 1, 1, M * BS)
    bias[1:, ..., -BS:] = float("-inf")
    outcome = differential(fn, (q, kc, vc, bt, bias))
    outcome.check()
    assert outcome.rewritten


def test_key_value_batch_of_one_broadcast_against_two_queries():
    q, kc, vc, bt, _ = _inputs()

    def fn(q, kc, vc, bt):
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), enable_gqa=True)

    outcome = differential(fn, (q[:2], kc, vc, bt[:1]))
    outcome.check()
    assert outcome.rewritten


def test_length_mask_over_a_sliced_table_with_longer_lengths():
    def fn(q, kc, vc, bt, sl):
        return _length_masked(q, kc, vc, bt[:, :2], sl)

    q, kc, vc, bt, sl = _inputs()
    sl[:] = torch.tensor([M * BS, 2 * BS + 1, 5])  # past the two gathered pages
    outcome = differential(fn, (q, kc, vc, bt, sl))
    outcome.check()
    assert outcome.rewritten


def test_min_valued_mask_with_an_empty_sequence_attends_like_sdpa():
    """With finfo.min (not -inf) SDPA gives a row with no visible key a uniform average, not
    zeros: such a mask is attention bias, not sequence lengths."""

    def fn(q, kc, vc, bt, sl):
        keys = M * BS
        valid = torch.arange(keys) < sl[:, None]
        mask = torch.where(valid, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), attn_mask=mask,
                                              enable_gqa=True)

    q, kc, vc, bt, sl = _inputs()
    sl[1] = 0
    outcome = differential(fn, (q, kc, vc, bt, sl))
    outcome.check()
    assert outcome.rewritten
    mask = next(c for c in outcome.report.sites[0].checks if c.name == "mask")
    assert "attn_bias" in mask.reason and "finfo.min" in mask.reason


def test_value_head_dim_other_than_the_key_is_a_named_check():
    def fn(q, kc, vc, bt):
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), enable_gqa=True)

    q, kc, _, bt, _ = _inputs()
    vc = torch.randn(N, BS, HKV, D // 2)
    _assert_kept(differential(fn, (q, kc, vc, bt)), "value cache",
                 "value head_dim 32 differs from the key's 64")


# ---- class 7: verify and explain ----

def _double_output(name: str) -> pagedfuse.Pattern:
    from pagedfuse.patterns import PAGED_SDPA

    def replace(graph, match):
        with graph.inserting_before(match.anchor):
            sdpa = graph.call_function(match.anchor.target, match.anchor.args,
                                       dict(match.anchor.kwargs))
            return graph.call_function(torch.mul, (sdpa, 2.0))

    return pagedfuse.Pattern(name, PAGED_SDPA.match, replace)


def test_verification_stays_on_after_a_failure():
    def fn(q, kc, vc, bt):
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), enable_gqa=True)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=pagedfuse.backend(
        inner="eager", verify=True, patterns=[_double_output("double")]))
    q, kc, vc, bt, _ = _inputs()
    for _ in range(3):
        with pytest.raises(pagedfuse.VerificationError):
            compiled(q, kc, vc, bt)


def _writes_its_cache(q, kc, vc, bt, new):
    kc[bt[:, 0]] = new
    return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), enable_gqa=True)


def test_explain_leaves_the_callers_data_untouched():
    q, kc, vc, bt, _ = _inputs()
    before = kc.clone()
    report = pagedfuse.explain(_writes_its_cache, q, kc, vc, bt, torch.randn(B, BS, HKV, D))
    assert report.num_sites == 1 and report.sites[0].checks[0].passed
    assert torch.equal(kc, before)


def test_explain_keeps_working_on_repeated_calls():
    q, kc, vc, bt, _ = _inputs()
    new = torch.randn(B, BS, HKV, D)
    for _ in range(12):
        report = pagedfuse.explain(_writes_its_cache, q, kc, vc, bt, new)
        assert report.num_sites == 1, report

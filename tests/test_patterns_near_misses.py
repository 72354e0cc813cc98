"""Near misses: sites that look like paged attention but must stay exactly as written, each
with the reason the report gives."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers.backends import without_backends
from helpers.capture import Capture
from helpers.programs import (
    PAGED,
    SDPA,
    TOL,
    Spec,
    attention,
    compile_and_compare,
    make_case,
)

import pagedfuse
from pagedfuse.numerics import max_rel_err as rel_err
from pagedfuse.patterns import PAGED_SDPA
from pagedfuse.rewrite.engine import rewrite_graph
from pagedfuse.rewrite.verify import copy_module


def _compile(fn, args, patterns=None):
    torch._dynamo.reset()
    pagedfuse.clear_reports()
    capture = Capture()
    out = torch.compile(fn, backend=pagedfuse.backend(inner=capture, patterns=patterns))(*args)
    return capture, pagedfuse.last_report(), out


def assert_kept(fn, args, check: str, reason: str):
    """Not rewritten, reported with ``reason`` under ``check``, graph exactly as written."""
    capture, report, out = _compile(fn, args)
    baseline, _, _ = _compile(fn, args, patterns=[])
    assert capture.count(SDPA) == 1 and capture.count(*PAGED) == 0
    assert report.num_sites == 1 and report.num_rewritten == 0
    failed = report.sites[0].first_failure
    assert failed.name == check and reason in failed.reason, failed
    assert capture.code() == baseline.code()
    assert rel_err(out, fn(*args)) == 0 or torch.equal(out, fn(*args))


def test_gathered_key_used_outside_the_attention():
    def fn(q, kc, vc, bt, *rest):
        pages = kc[bt]
        pages.mul_(2.0)  # the gathered copy is changed: reading the cache would not see it
        k = pages.flatten(1, 2).transpose(1, 2)
        v = vc[bt].flatten(1, 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    assert_kept(fn, make_case(Spec()).args(), "self-contained", "also used by")


def test_gather_along_positions_is_not_a_block_table():
    def fn(q, cache, positions):
        k = cache[:, positions].transpose(1, 2)  # per-sequence cache, positions picked on dim 1
        return F.scaled_dot_product_attention(q, k, k, enable_gqa=True)

    args = (torch.randn(2, 4, 1, 64), torch.randn(2, 16, 2, 64), torch.tensor([3, 1, 7, 2]))
    assert_kept(fn, args, "match", "outside dim 0")


def test_take_of_partial_rows_is_not_a_gather():
    def fn(q, cache, slots):
        row = cache[0].numel()
        shifted = slots[..., None] * row + torch.arange(row) + 64  # starts mid-row
        k = torch.take(cache, shifted).view(1, -1, 2, 64).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, k, enable_gqa=True)

    args = (torch.randn(1, 4, 1, 64), torch.randn(16, 2, 64), torch.tensor([3, 1, 7, 2]))
    assert_kept(fn, args, "match", "not ids[..., None] * 128 + arange(128)")


def test_contiguous_cache_is_not_paged():
    def fn(q, k_cache, v_cache, length: int):
        k = k_cache[:, :, :length]
        v = v_cache[:, :, :length]
        return F.scaled_dot_product_attention(q, k, v)

    args = (torch.randn(2, 4, 1, 64), torch.randn(2, 4, 12, 64), torch.randn(2, 4, 12, 64), 9)
    assert_kept(fn, args, "match", "not from a gather through a block table")


def test_dropout_is_not_fused():
    spec = Spec(dropout=0.5)
    fn = attention(spec)
    capture, report, _ = _compile(fn, make_case(spec).args())
    baseline, _, _ = _compile(fn, make_case(spec).args(), patterns=[])
    failed = report.sites[0].first_failure
    assert (failed.name, failed.reason) == ("dropout", "dropout_p=0.5: the fused kernels do not "
                                                       "apply dropout")
    assert capture.count(*PAGED) == 0 and capture.code() == baseline.code()


def test_tiled_head_repeat_is_not_gqa():
    def fn(q, kc, vc, bt, *rest):
        def tiled(pages):
            x = pages.flatten(1, 2).transpose(1, 2)
            b, h, n, d = x.shape
            return x[:, None].expand(b, 4, h, n, d).reshape(b, 4 * h, n, d)  # (rep, head)

        return F.scaled_dot_product_attention(q, tiled(kc[bt]), tiled(vc[bt]))

    assert_kept(fn, make_case(Spec()).args(), "match", "repeated tiled")


def test_unsupported_head_dim_names_the_kernel():
    spec = Spec(dequant="to_mul")
    args = make_case(spec, head_dim=96).args()
    assert_kept(attention(spec), args, "head_dim",
                "head_dim 96 not in {64, 128, 256} for paged_attention_int8 on cpu")


def test_key_and_value_through_different_tables():
    def fn(q, kc, vc, bt, *rest):
        k = kc[bt].flatten(1, 2).transpose(1, 2)
        v = vc[bt.flip(0)].flatten(1, 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    assert_kept(fn, make_case(Spec()).args(), "match", "different indices")


def test_cache_written_between_gather_and_attention():
    def fn(q, kc, vc, bt, *rest):
        k = kc[bt].flatten(1, 2).transpose(1, 2)
        v = vc[bt].flatten(1, 2).transpose(1, 2)
        kc.mul_(0.5)  # the op would read the halved cache, SDPA reads the gathered copy
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    capture, report, _ = _compile(fn, make_case(Spec()).args())
    failed = report.sites[0].first_failure
    assert failed.name == "cache writes" and "l_kc_" in failed.reason
    assert capture.count(*PAGED) == 0


def test_off_by_one_mask_is_a_bias_not_seq_lens():
    """``j <= len`` looks like a length mask but is not: it must stay attn_bias."""
    capture, report, err = compile_and_compare(Spec(mask="offbyone"))
    node = next(n for gm in capture.graphs for n in gm.graph.nodes if n.target in PAGED)
    assert node.args[8] is not None  # attn_bias
    assert node.args[4].target is torch.full  # seq_lens = every gathered key, not l_sl_
    assert "not a length mask" in next(c for c in report.sites[0].checks
                                       if c.name == "mask").reason
    assert err < TOL[torch.float32]


def test_query_that_needs_a_gradient_is_not_fused():
    """The ops have no backward; under no_grad the same site is fused."""
    spec = Spec()
    fn = attention(spec)
    args = list(make_case(spec).args())
    args[0] = args[0].clone().requires_grad_()
    assert_kept(fn, args, "autograd", "l_q_ require grad")
    with torch.no_grad():
        capture, report, _ = _compile(fn, args)
    assert report.num_rewritten == 1 and capture.count(*PAGED) == 1


def test_scales_through_another_table_or_misaligned():
    """A dequant scale must be gathered with the block table of its data, token by token."""

    def other_table(q, kc, vc, bt, sl, ks, vs, *rest):
        k = (kc[bt].float() * ks[bt.flip(0)].unsqueeze(-1)).flatten(1, 2).transpose(1, 2)
        v = (vc[bt].float() * vs[bt].unsqueeze(-1)).flatten(1, 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def misaligned(q, kc, vc, bt, sl, ks, vs, *rest):
        scale = ks[bt].transpose(1, 2).unsqueeze(-1)  # block and slot swapped (4 x 4)
        k = (kc[bt].float() * scale).flatten(1, 2).transpose(1, 2)
        v = (vc[bt].float() * vs[bt].unsqueeze(-1)).flatten(1, 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    args = make_case(Spec(dequant="to_mul"), blocks=4, block_size=4).args()
    assert_kept(other_table, args, "match", "key scale is gathered with another index")
    assert_kept(misaligned, args, "match", "does not line up")


def test_cache_with_strided_head_dim_fails_the_stride_check():
    spec = Spec(mask="none")
    case = make_case(spec)
    wide = torch.randn(*case.kc.shape[:3], 2 * case.kc.shape[3])
    args = list(case.args())
    args[1] = wide[..., ::2]  # every other element: innermost stride 2
    assert_kept(attention(spec), args, "cache strides", "innermost dim must be contiguous")


def test_unknown_attention_arguments_are_reported():
    """A future SDPA keyword (say a logit soft-cap) is not silently dropped."""
    spec = Spec()
    _, report, _ = _compile(attention(spec), make_case(spec).args())
    assert report.num_rewritten == 1
    torch._dynamo.reset()
    graphs = []

    def add_softcap(gm, example_inputs):
        runnable = copy_module(gm)
        sdpa = next(n for n in gm.graph.nodes if n.target is SDPA)
        sdpa.kwargs = {**sdpa.kwargs, "softcap": 30.0}
        report, swaps = rewrite_graph(gm, [PAGED_SDPA])
        graphs.append((report, swaps, gm.code))
        return runnable.forward

    torch.compile(attention(spec), backend=add_softcap)(*make_case(spec).args())
    report, swaps, code = graphs[0]
    failed = report.sites[0].first_failure
    assert (failed.name, failed.reason) == ("arguments", "unsupported SDPA arguments ['softcap']")
    assert swaps == [] and "softcap = 30.0" in code


def test_device_without_a_kernel():
    """Where only the slow reference serves the op (no kernel registered for the device), the
    site stays as written."""
    spec = Spec()
    with without_backends("cpu"):
        assert_kept(attention(spec), make_case(spec).args(), "kernel",
                    "no pagedfuse paged_attention kernel for cpu: only the slow reference "
                    "would run")

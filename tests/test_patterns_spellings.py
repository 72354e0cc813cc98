"""Every spelling the matcher accepts: one SDPA in, one pagedfuse op out, same numbers."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from helpers.capture import Capture
from helpers.programs import (
    INT8_TOL,
    PAGED,
    SDPA,
    TOL,
    Spec,
    compile_and_compare,
    make_case,
)

import pagedfuse
from pagedfuse.numerics import max_rel_err as rel_err

SPELLINGS = {
    # gather forms
    "getitem": Spec(),
    "getitem_slices": Spec(gather="getitem_slices"),
    "index_select_flat": Spec(gather="index_select"),
    "torch_gather_flat": Spec(gather="torch_gather"),
    "take_along_dim_flat": Spec(gather="take_along_dim"),
    "torch_take_flat": Spec(gather="take"),
    # cache layouts and the views that bring K/V to [B, H, L, D]
    "hnd_cache": Spec(layout="HND"),
    "permute_reshape": Spec(view="permute"),
    # GQA forms
    "repeat_interleave": Spec(gqa="repeat_interleave"),
    "repeat_kv": Spec(gqa="repeat_kv"),
    "mha": Spec(gqa="mha", mask="none"),
    # mask forms
    "no_mask": Spec(mask="none"),
    "where_additive": Spec(mask="where"),
    "masked_fill_additive": Spec(mask="masked_fill"),
    "causal_prefill": Spec(mask="causal"),
    # scale forms
    "float_scale": Spec(scale="float"),
    "item_scale": Spec(scale="item"),
    # dtypes
    "bf16": Spec(dtype=torch.bfloat16, gqa="repeat_kv"),
}

INT8_SPELLINGS = {
    "to_mul": Spec(dequant="to_mul"),
    "implicit_promotion": Spec(dequant="promote"),
    "scale_times_data": Spec(dequant="scale_first"),
    "float_then_to_bf16": Spec(dequant="float_then_to", dtype=torch.bfloat16),
    "hnd_int8": Spec(dequant="to_mul", layout="HND", gqa="repeat_kv"),
    "float_value_cache": Spec(dequant="to_mul_fp_value", dtype=torch.bfloat16),
    "flat_slots_int8": Spec(dequant="to_mul", gather="index_select", mask="where"),
    "take_along_dim_int8": Spec(dequant="to_mul", gather="take_along_dim"),
    "torch_take_int8": Spec(dequant="to_mul", gather="take"),
}


@pytest.mark.parametrize("spec", SPELLINGS.values(), ids=SPELLINGS.keys())
def test_float_spelling_is_rewritten(spec):
    capture, report, err = compile_and_compare(spec)
    assert capture.count(SDPA) == 0
    assert capture.count(torch.ops.pagedfuse.paged_attention.default) == 1
    assert report.num_sites == report.num_rewritten == 1
    assert report.sites[0].replacement == "pagedfuse.paged_attention"
    assert err < TOL[spec.dtype]


@pytest.mark.parametrize("spec", INT8_SPELLINGS.values(), ids=INT8_SPELLINGS.keys())
def test_int8_dequant_spelling_is_rewritten(spec):
    capture, report, err = compile_and_compare(spec)
    assert capture.count(SDPA) == 0
    assert capture.count(torch.ops.pagedfuse.paged_attention_int8.default) == 1
    assert report.sites[0].replacement == "pagedfuse.paged_attention_int8"
    assert err < INT8_TOL


def _op_node(capture):
    return next(n for gm in capture.graphs for n in gm.graph.nodes if n.target in PAGED)


def test_length_mask_becomes_seq_lens_not_a_bias():
    capture, report, _ = compile_and_compare(Spec(mask="where"))
    node = _op_node(capture)
    seq_lens = node.args[4]  # the user's lengths, clamped to the gathered keys as the mask is
    assert seq_lens.target == "clamp" and seq_lens.args == (seq_lens.args[0], 0, 12)
    assert seq_lens.args[0].name == "l_sl_"
    assert node.args[8] is None  # no attn_bias
    mask_check = next(c for c in report.sites[0].checks if c.name == "mask")
    assert "length mask" in mask_check.reason


def test_alibi_bias_is_passed_through_as_attn_bias():
    capture, report, err = compile_and_compare(Spec(mask="alibi"))
    node = _op_node(capture)
    assert node.args[8] is not None and node.args[4].op != "placeholder"
    assert "attn_bias" in next(c for c in report.sites[0].checks if c.name == "mask").reason
    assert err < TOL[torch.float32]


def test_causal_prefill_uses_the_op_causal_flag():
    capture, _, _ = compile_and_compare(Spec(mask="causal"))
    assert _op_node(capture).args[7] is True


def test_top_left_causal_with_fewer_queries_becomes_a_bool_bias():
    """SDPA's is_causal is top-left aligned; with 3 queries over 12 keys the op's bottom-right
    causal would differ, so the rewrite hands the op the top-left mask as attn_bias."""

    def fn(q, kc, vc, bt, *rest):
        k = kc[bt].flatten(1, 2).transpose(1, 2)
        v = vc[bt].flatten(1, 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    case = make_case(Spec(), q_len=3)
    capture = Capture()
    got = torch.compile(fn, backend=pagedfuse.backend(inner=capture))(*case.args())
    node = _op_node(capture)
    assert node.args[7] is False and node.args[8].target == "tril"
    assert rel_err(got, fn(*case.args())) < TOL[torch.float32]
    assert "top-left" in next(c for c in pagedfuse.last_report().sites[0].checks
                              if c.name == "causal").reason


def test_scale_that_changes_per_call_stays_a_graph_value():
    """A float argument that changes between calls becomes a dynamic graph input (Dynamo's
    automatic dynamic); the op takes that value instead of a baked-in constant."""

    def fn(q, kc, vc, bt, scale: float):
        k = kc[bt].flatten(1, 2).transpose(1, 2)
        v = vc[bt].flatten(1, 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    torch._dynamo.reset()
    case = make_case(Spec())
    capture = Capture()
    compiled = torch.compile(fn, backend=pagedfuse.backend(inner=capture))
    for scale in (0.3, 0.2, 0.1):
        args = (case.q, case.kc, case.vc, case.bt, scale)
        assert rel_err(compiled(*args), fn(*args)) < TOL[torch.float32]
    assert capture.count(SDPA) == 0 and capture.count(*PAGED) == len(capture.graphs)
    last_scale = [n for n in capture.graphs[-1].graph.nodes if n.target in PAGED][0].args[6]
    assert isinstance(last_scale, torch.fx.Node)


def test_hnd_cache_is_passed_as_a_transposed_view_not_copied():
    capture, _, _ = compile_and_compare(Spec(layout="HND"))
    key_cache = _op_node(capture).args[1]
    assert key_cache.target == "transpose" and key_cache.args[1:] == (1, 2)
    assert key_cache.args[0].op == "placeholder"


@pytest.mark.parametrize("spelling", ["index_copy_", "setitem"])
def test_flat_slot_cache_written_then_read_in_one_graph(spelling):
    """Hugging Face continuous batching (5.x: index_copy_/index_select, 4.57: setitem/getitem):
    a block_size-1 slot cache, batch 1, a host-built additive mask; the write stays first."""
    hq, hkv, d, slots, q_len, keys = 8, 2, 64, 40, 3, 11

    def step(q, k_new, v_new, k_cache, v_cache, write_index, read_index, mask):
        if spelling == "setitem":
            k_cache[write_index, :, :] = k_new
            v_cache[write_index, :, :] = v_new
            k, v = k_cache[read_index, :, :], v_cache[read_index, :, :]
        else:
            k_cache.index_copy_(0, write_index, k_new)
            v_cache.index_copy_(0, write_index, v_new)
            k = torch.index_select(k_cache, 0, read_index)
            v = torch.index_select(v_cache, 0, read_index)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        k = k[:, :, None].expand(1, hkv, hq // hkv, keys, d).reshape(1, hq, keys, d)
        v = v[:, :, None].expand(1, hkv, hq // hkv, keys, d).reshape(1, hq, keys, d)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2)

    g = torch.Generator().manual_seed(3)
    read_index = torch.randperm(slots, generator=g)[:keys]
    mask = torch.zeros(1, 1, q_len, keys)
    mask[..., 0, 5:] = float("-inf")  # two packed requests: block-diagonal, causal tails
    mask[..., 1, 7:] = torch.finfo(torch.float32).min
    args = [torch.randn(1, hq, q_len, d, generator=g), torch.randn(q_len, hkv, d, generator=g),
            torch.randn(q_len, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g),
            torch.randn(slots, hkv, d, generator=g), read_index[-q_len:], read_index, mask]
    eager_args = [a.clone() for a in args]
    want = step(*eager_args)
    torch._dynamo.reset()
    capture = Capture()
    got = torch.compile(step, backend=pagedfuse.backend(inner=capture))(*args)
    assert capture.count(SDPA) == 0 and capture.count(*PAGED) == 1
    order = list(capture.graphs[0].graph.nodes)
    writes = [n for n in order if n.target in ("index_copy_", operator.setitem)]
    assert len(writes) == 2 and max(map(order.index, writes)) < order.index(_op_node(capture))
    key_cache = _op_node(capture).args[1]
    assert key_cache.target == "unsqueeze" and key_cache.args[1] == 1  # a view, not a copy
    assert key_cache.args[0].name == "l_k_cache_"
    assert rel_err(got, want) < TOL[torch.float32]
    assert torch.equal(args[3], eager_args[3]) and torch.equal(args[4], eager_args[4])


def test_dequant_after_the_layout_ops_with_repeat_interleave():
    """Scales may be multiplied in at [B, H, L, D] (after the views), not only on pages."""

    def fn(q, kc, vc, bt, sl, ks, vs, *rest):
        def dequant(cache, scales):
            data = cache[bt].flatten(1, 2).transpose(1, 2).to(torch.float32)
            return data * scales[bt].flatten(1, 2).transpose(1, 2)[..., None]

        k, v = dequant(kc, ks), dequant(vc, vs)
        mask = torch.arange(k.shape[2])[None, :] < sl.unsqueeze(1)
        return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1),
                                              v.repeat_interleave(4, 1),
                                              attn_mask=mask[:, None, None, :])

    torch._dynamo.reset()
    case = make_case(Spec(dequant="to_mul"))
    capture = Capture()
    got = torch.compile(fn, backend=pagedfuse.backend(inner=capture))(*case.args())
    assert capture.count(SDPA) == 0
    assert capture.count(torch.ops.pagedfuse.paged_attention_int8.default) == 1
    assert _op_node(capture).args[5].name == "l_bt_"
    assert rel_err(got, fn(*case.args())) < INT8_TOL

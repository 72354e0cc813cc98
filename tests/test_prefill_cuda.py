"""Tests of the prefill kernels (pagedfuse/ops/triton_prefill.py) against the float64
reference, outputs NaN-poisoned before every call.

GPU cases are a hand-picked list, each a kernel specialisation that compiles, covering
varlen batches (q_len 1, 4, 17, 128, 2048; histories 0, 1, 1000, 8192), head_dim
64/128/256, GQA 1/4/6/8, pages 1/16/256, NHD and HND, bf16 and fp16, INT8 K and K+V with
both P·V modes, float and bool biases, and CUDA graph replay. The host-side rules (which
calls the kernel takes, plan checks, the default plan) run without a GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from helpers.prefill import case_call
from test_cuda_kernels import make_case, reference, rel_err, replayed

from pagedfuse.ops import prefill_plan as pp

cuda = pytest.mark.cuda
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
INT8_P_TOL = 3e-2  # P quantized to int8 per row: about 1/254 of a row's largest weight


def _varlen(q_lens: list[int], histories: list[int], **spec) -> dict:
    return make_case(batch=len(q_lens), q_lens=q_lens,
                     seq_lens=[q + h for q, h in zip(q_lens, histories, strict=True)],
                     causal=spec.pop("causal", True), **spec)


def run_prefill(case: dict, plan: pp.PrefillPlan | None = None, hinted: bool = True,
                min_query_len: int = 0) -> torch.Tensor:
    """prefill_into on a NaN-poisoned output; ``hinted``: pass the max length hints."""
    from pagedfuse.ops.triton_prefill import prefill_into

    q_lens = case["query_start_loc"].diff()
    hints = dict(max_seq_len=int(case["seq_lens"].max()), max_query_len=int(q_lens.max())) \
        if hinted else {}
    out = torch.full_like(case["query"], float("nan"))
    prefill_into(case_call(case, **hints), out, plan, min_query_len=min_query_len)
    return out


CASES = {
    # (q_len, history) pairs from the lists, one mixed batch per geometry
    "llama3-varlen-page16": dict(q_lens=[1, 4, 17, 128, 2048], histories=[1000, 0, 1, 8192, 0],
                                 hq=32, hkv=8, d=128),
    "qwen35-gqa6-hnd-page256": dict(q_lens=[17, 300, 4], histories=[1000, 0, 8192], hq=24,
                                    hkv=4, d=256, page=256, hnd=True),
    "tinyllama-gqa8-page1-fp16": dict(q_lens=[4, 128, 1], histories=[1, 1000, 0], hq=32,
                                      hkv=4, d=64, page=1, dtype=torch.float16),
    "mha-noncausal-int64": dict(q_lens=[64, 5], histories=[0, 100], hq=8, hkv=8, d=128,
                                causal=False, index=torch.int64),
}


@cuda
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_matches_reference(name):
    spec = dict(CASES[name])
    case = _varlen(spec.pop("q_lens"), spec.pop("histories"), **spec)
    ref = reference(case)
    assert rel_err(run_prefill(case), ref) < TOL[case["query"].dtype]


@cuda
def test_without_hints_every_tile_of_the_token_bound_is_masked():
    """No max_query_len: the grid covers num_tokens query rows per sequence, most exit."""
    case = _varlen([3, 70, 9], [5, 0, 300], hq=16, hkv=4, d=64)
    assert rel_err(run_prefill(case, hinted=False), reference(case)) < 2e-2


@cuda
@pytest.mark.parametrize(("kv_int8", "pv"), [("k", "half"), ("kv", "half"), ("kv", "int8")])
def test_int8_matches_reference(kv_int8, pv):
    case = _varlen([17, 256, 1], [1000, 1, 40], hq=24, hkv=4, d=128, kv_int8=kv_int8)
    plan = dataclasses.replace(pp.default_plan(case_call(case, max_query_len=256)), pv=pv)
    err = rel_err(run_prefill(case, plan), reference(case))
    assert err < (INT8_P_TOL if pv == "int8" else 2e-2)


@cuda
@pytest.mark.parametrize("d", [64, 256])
def test_int8_head_dims(d):
    case = _varlen([40, 130], [0, 500], hq=32, hkv=8, d=d, kv_int8="kv", page=16)
    assert rel_err(run_prefill(case), reference(case)) < 2e-2


@cuda
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_attn_bias(kind):
    q_lens, hist = [20, 7], [50, 0]
    rows, cols = max(q_lens), max(q + h for q, h in zip(q_lens, hist, strict=True))
    gen = torch.Generator().manual_seed(1)
    bias = (torch.randn(2, 16, rows, cols, generator=gen) if kind == "float"
            else torch.rand(1, rows, cols, generator=gen) > 0.3).cuda()
    case = _varlen(q_lens, hist, hq=16, hkv=4, d=128, bias=bias)
    assert rel_err(run_prefill(case), reference(case)) < 2e-2


@cuda
def test_min_query_len_leaves_decode_rows_for_another_kernel():
    case = _varlen([1, 33, 1, 5], [700, 10, 0, 90], hq=16, hkv=4, d=128)
    out = run_prefill(case, min_query_len=2)
    starts = case["query_start_loc"].tolist()
    decode_rows = [starts[0], starts[2]]
    assert torch.isnan(out[decode_rows]).all()
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[decode_rows] = False
    assert rel_err(out[keep.cuda()], reference(case)[keep]) < 2e-2


@cuda
def test_cuda_graph_replays():
    """100 replays give identical outputs; new query values and lengths (device tensors)
    are seen by the next replay: nothing was baked in at capture."""
    from pagedfuse.ops.triton_prefill import prefill_into

    case = _varlen([200, 3, 64], [300, 900, 0], hq=32, hkv=8, d=128, kv_int8="kv")
    call = case_call(case, max_seq_len=1200, max_query_len=256)
    out = torch.full_like(case["query"], float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prefill_into(call, out)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prefill_into(call, out)
    out.fill_(float("nan"))
    outs = replayed(graph, out, 100)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert rel_err(outs[0], reference(case)) < 2e-2
    case["query"].copy_(torch.randn_like(case["query"]))
    case["seq_lens"].copy_(torch.tensor([450, 800, 64]))  # shorter histories, same queries
    graph.replay()
    assert rel_err(out, reference(case)) < 2e-2


def _shape_case(**spec) -> dict:
    return make_case(device="cpu", **spec)


def test_which_calls_the_prefill_kernel_takes():
    prefill = _shape_case(batch=2, hq=8, hkv=2, d=128, q_lens=[5, 3])
    reason = pp.prefill_unsupported(case_call(prefill))
    if importlib.util.find_spec("triton") is None:
        assert reason == "Triton is not installed"
        return
    assert (reason is None) if pp.INTERPRET else "device cpu" in reason
    if pp.INTERPRET:
        return
    gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in prefill.items()
           if k != "unquantized"} if torch.cuda.is_available() else None
    if gpu is None:
        pytest.skip("the rest needs CUDA tensors")
    assert pp.prefill_unsupported(case_call(gpu)) is None
    assert "decode call" in pp.prefill_unsupported(case_call(gpu, max_query_len=1))
    fp32 = dict(gpu, query=gpu["query"].float(), key_cache=gpu["key_cache"].float(),
                value_cache=gpu["value_cache"].float())
    assert "bf16 or fp16" in pp.prefill_unsupported(case_call(fp32))


def test_plan_checks_name_the_plan():
    call = case_call(_shape_case(batch=1, hq=24, hkv=4, d=128, q_lens=[5]))
    with pytest.raises(ValueError, match="plan: pack 4 must be a power of two dividing"):
        pp.check_plan(call, pp.PrefillPlan(pack=4))
    with pytest.raises(ValueError, match="plan: block_n 48"):
        pp.check_plan(call, pp.PrefillPlan(block_n=48))
    with pytest.raises(ValueError, match="plan: pv 'fp4'"):
        pp.check_plan(call, pp.PrefillPlan(pv="fp4"))


@pytest.mark.parametrize(("kind", "group", "q_bound", "pack", "block_m", "warps"), [
    ("float", 4, 8192, 1, 128, 8),  # long prompts: one head, 128 tokens per tile
    ("float", 4, 64, 2, 128, 8),  # a 64-token chunk shares its rows with a second head
    ("float", 6, 64, 2, 128, 8),  # GQA 6: packs of 2 (a power of two dividing the group)
    ("float", 8, 4, 8, 64, 4),  # short queries: the whole group, rows padded to 64
    ("float", 1, 4, 1, 64, 4),
    ("int8_kv", 4, 8192, 1, 64, 4),  # INT8 K+V, head_dim 128: 64-row tiles, 2 CTAs per SM
])
def test_default_plan_packs_heads_to_fill_a_tile(kind, group, q_bound, pack, block_m, warps):
    plan = pp._default_plan(128, group, q_bound, kind)
    assert (plan.pack, plan.block_m, plan.num_warps) == (pack, block_m, warps)

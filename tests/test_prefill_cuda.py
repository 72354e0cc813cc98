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
import math

import pytest
import torch
from helpers.cases import Case, make_case, poison_kv
from helpers.cuda_cases import replayed
from helpers.prefill import VARLEN_CASES, named_varlen_case, structured_biases, varlen_case

from pagedfuse.numerics import rel_err
from pagedfuse.ops import prefill_plan as pp

cuda = pytest.mark.cuda
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
INT8_P_TOL = 3e-2  # P quantized to int8 per row: about 1/254 of a row's largest weight


def run_prefill(case: Case, plan: pp.PrefillPlan | None = None, hinted: bool = True,
                min_query_len: int = 0) -> torch.Tensor:
    """prefill_into on a NaN-poisoned output; ``hinted``: pass the max length hints."""
    from pagedfuse.ops.triton_prefill import prefill_into

    call = case.call(case.longest, case.longest_query) if hinted else case.call()
    out = torch.full_like(case.query, float("nan"))
    prefill_into(call, out, plan, min_query_len=min_query_len)
    return out


@cuda
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_prefill_matches_reference(name):
    case = named_varlen_case(name)
    assert rel_err(run_prefill(case), case.reference()) < TOL[case.query.dtype]


@cuda
def test_without_hints_every_tile_of_the_token_bound_is_masked():
    """No max_query_len: the grid covers num_tokens query rows per sequence, most exit."""
    case = varlen_case([3, 70, 9], [5, 0, 300], num_q_heads=16, num_kv_heads=4)
    assert rel_err(run_prefill(case, hinted=False), case.reference()) < 2e-2


@cuda
@pytest.mark.parametrize(("kind", "pv"), [("int8_k", "half"), ("int8_kv", "half"),
                                        ("int8_kv", "int8")])
def test_int8_matches_reference(kind, pv):
    case = varlen_case([17, 256, 1], [1000, 1, 40], num_q_heads=24, num_kv_heads=4, head_dim=128,
                   kind=kind)
    plan = dataclasses.replace(pp.default_plan(case.call(max_query_len=256)), pv=pv)
    err = rel_err(run_prefill(case, plan), case.reference())
    assert err < (INT8_P_TOL if pv == "int8" else 2e-2)


@cuda
@pytest.mark.parametrize("d", [64, 256])
def test_int8_head_dims(d):
    case = varlen_case([40, 130], [0, 500], num_q_heads=32, num_kv_heads=8, head_dim=d,
                   kind="int8_kv")
    assert rel_err(run_prefill(case), case.reference()) < 2e-2


@cuda
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_attn_bias(kind):
    q_lens, hist = [20, 7], [50, 0]
    rows, cols = max(q_lens), max(q + h for q, h in zip(q_lens, hist, strict=True))
    gen = torch.Generator().manual_seed(1)
    bias = (torch.randn(2, 16, rows, cols, generator=gen) if kind == "float"
            else torch.rand(1, rows, cols, generator=gen) > 0.3).cuda()
    case = varlen_case(q_lens, hist, num_q_heads=16, num_kv_heads=4, head_dim=128).with_(
        attn_bias=bias)
    assert rel_err(run_prefill(case), case.reference()) < 2e-2


BIAS_BATCHES = {"varlen": ([20, 7, 70], [50, 0, 30], 16), "packed-page1": ([96], [64], 1)}


@cuda
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batch", list(BIAS_BATCHES))
@pytest.mark.parametrize("name", list(structured_biases([2], [0], 2)))
def test_biases_that_hide_key_tiles(name, batch, causal):
    """The tiles a bias hides from every row are skipped and the ones it leaves at 0 run
    unmasked (bias spans): exact on the masks serving stacks build, on rows that see no
    key and on NaN biases; with the default launches and with 16x16 tiles in 3 key splits."""
    q_lens, hist, page = BIAS_BATCHES[batch]
    bias = structured_biases(q_lens, hist, 16)[name]
    bias = bias.to(torch.bfloat16) if bias.is_floating_point() else bias
    case = varlen_case(q_lens, hist, num_q_heads=16, num_kv_heads=4, head_dim=128,
                       block_size=page, causal=causal).with_(attn_bias=bias.cuda())
    ref = case.reference()
    for plan in (None, pp.PrefillPlan(block_m=16, block_n=16, num_warps=4, splits=3)):
        out = run_prefill(case, plan)
        assert torch.equal(out.isnan().cpu(), ref.isnan()), (plan, "NaN rows differ")
        seen = ~ref.isnan()
        assert rel_err(out.cpu()[seen], ref[seen]) < TOL[torch.bfloat16], plan


@cuda
@pytest.mark.parametrize("which", ["k", "v"])
def test_key_tiles_a_bias_hides_are_not_read(which):
    """Bias spans' stated difference from eager SDPA: a NaN in K or V at a key the bias hides
    from every row, in a key tile no row sees, does not reach the output (the reference adds
    -inf to the NaN score, or multiplies the NaN value by weight 0, and gives NaN); the
    output equals the reference of the cache without it."""
    case = varlen_case([40], [260], num_q_heads=16, num_kv_heads=4, head_dim=128,
                       num_blocks=40)
    table = case.block_table.clone()  # distinct blocks: the poisoned slot is key 5's alone
    table[0, :19] = torch.randperm(40, generator=torch.Generator().manual_seed(2))[:19].to(table)
    bias = torch.zeros(40, 300)
    bias[:, :200] = -math.inf
    case = case.with_(attn_bias=bias.to(torch.bfloat16).cuda(), block_table=table)
    clean = case.reference()
    block = int(case.block_table[0, 0]) % case.key_cache.shape[0]
    poison_kv(case, which, block, 5, math.nan)
    assert case.reference().isnan().any()
    for plan in (None, pp.PrefillPlan(block_m=16, block_n=16, num_warps=4, splits=3)):
        out = run_prefill(case, plan)
        assert not out.isnan().any(), plan
        assert rel_err(out.cpu(), clean) < TOL[torch.bfloat16], plan


@cuda
@pytest.mark.parametrize("shape", [(1, 1, 300, 2500), (2, 3, 5, 40), (1, 1, 7, 1)])
def test_bias_spans_read_the_bias(shape):
    """bias_spans against a torch reading of the same bias: first visible key, one past the
    last (NO_END where the last column is visible or none is), all-zero flag."""
    from pagedfuse.ops import cuda as cuda_ops
    from pagedfuse.ops import triton_prefill as tp

    hidden, no_end = tp.HIDDEN.value, tp.NO_END.value
    gen = torch.Generator().manual_seed(5)
    bias = torch.where(torch.rand(shape, generator=gen) < 0.6, -math.inf, 0.0)
    bias[..., 0, :] = -math.inf  # a row with no visible key
    if shape[-1] > 4:
        bias[..., 1, :] = 0.0
        bias[..., 2, 1:4] = torch.tensor([0.0, 0.5, 0.0])
        bias[..., 2, 4:] = -1e31
    for b in (bias, bias > hidden):
        spans, _ = tp.bias_spans(cuda_ops.bias_args(b.cuda(), b.cuda())[0])
        seen = b if b.dtype == torch.bool else b > hidden
        cols = torch.arange(shape[-1])
        any_seen = seen.any(-1)
        lo = torch.where(seen, cols, no_end).amin(-1)
        last = torch.where(seen, cols + 1, 0).amax(-1)
        hi = torch.where(any_seen & (last < shape[-1]), last, no_end)
        inside = (cols >= lo[..., None]) & (cols < last[..., None])
        value = torch.zeros_like(bias) if b.dtype == torch.bool else bias
        zero = any_seen & ~(inside & ~(seen & (value == 0))).any(-1)
        expect = torch.stack([torch.where(any_seen, lo, 0), hi, zero.int()], -1).int()
        assert torch.equal(spans.cpu(), expect), b.dtype


@cuda
def test_min_query_len_leaves_decode_rows_for_another_kernel():
    case = varlen_case([1, 33, 1, 5], [700, 10, 0, 90], num_q_heads=16, num_kv_heads=4,
                   head_dim=128)
    out = run_prefill(case, min_query_len=2)
    starts = case.query_start_loc.tolist()
    decode_rows = [starts[0], starts[2]]
    assert torch.isnan(out[decode_rows]).all()
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    keep[decode_rows] = False
    assert rel_err(out[keep.cuda()], case.reference()[keep]) < 2e-2


@cuda
def test_cuda_graph_replays():
    """100 replays give identical outputs; new query values and lengths (device tensors)
    are seen by the next replay: nothing was baked in at capture."""
    from pagedfuse.ops.triton_prefill import prefill_into

    case = varlen_case([200, 3, 64], [300, 900, 0], num_q_heads=32, num_kv_heads=8, head_dim=128,
                   kind="int8_kv")
    call = case.call(max_seq_len=1200, max_query_len=256)
    out = torch.full_like(case.query, float("nan"))
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
    assert rel_err(outs[0], case.reference()) < 2e-2
    case.query.copy_(torch.randn_like(case.query))
    case.seq_lens.copy_(torch.tensor([450, 800, 64]))  # shorter histories, same queries
    graph.replay()
    assert rel_err(out, case.reference()) < 2e-2


def test_which_calls_the_prefill_kernel_takes():
    prefill = make_case(seq_lens=[40, 30], q_lens=[5, 3], head_dim=128, dtype=torch.bfloat16)
    reason = pp.prefill_unsupported(prefill.call())
    if importlib.util.find_spec("triton") is None:
        assert reason == "Triton is not installed"
        return
    assert (reason is None) if pp.INTERPRET else "device cpu" in reason
    if pp.INTERPRET:
        return
    if not torch.cuda.is_available():
        pytest.skip("the rest needs CUDA tensors")
    gpu = prefill.to("cuda")
    assert pp.prefill_unsupported(gpu.call()) is None
    assert "decode call" in pp.prefill_unsupported(gpu.call(max_query_len=1))
    fp32 = gpu.with_(query=gpu.query.float(), key_cache=gpu.key_cache.float(),
                     value_cache=gpu.value_cache.float())
    assert "bf16 or fp16" in pp.prefill_unsupported(fp32.call())


def test_plan_checks_name_the_plan():
    call = make_case(seq_lens=[20], q_lens=[5], num_q_heads=24, num_kv_heads=4,
                     head_dim=128).call()
    with pytest.raises(ValueError, match="plan: pack 4 must divide the GQA group 6"):
        pp.check_plan(call, pp.PrefillPlan(pack=4))
    pp.check_plan(call, pp.PrefillPlan(block_m=64, pack=6))  # 10 tokens, 4 spare rows
    with pytest.raises(ValueError, match="plan: splits 2 must be >= 1, and 1 beside"):
        pp.check_plan(call, pp.PrefillPlan(splits=2), min_query_len=2)
    with pytest.raises(ValueError, match="plan: block_n 48"):
        pp.check_plan(call, pp.PrefillPlan(block_n=48))
    with pytest.raises(ValueError, match="plan: pv 'fp4'"):
        pp.check_plan(call, pp.PrefillPlan(pv="fp4"))


@pytest.mark.parametrize(("kind", "group", "q_bound", "pack", "block_m", "warps"), [
    ("float", 4, 8192, 1, 128, 8),  # long prompts: one head, 128 tokens per tile
    ("float", 4, 64, 2, 128, 8),  # a 64-token chunk shares its rows with a second head
    ("float", 6, 64, 2, 128, 8),  # GQA 6: packs of 2 (the largest divisor that fits)
    ("float", 6, 17, 6, 128, 8),  # ... 6 heads x 17 tokens in 128 rows
    ("float", 6, 4, 6, 64, 4),  # short queries: the whole group (any size), 64 rows
    ("float", 8, 4, 8, 64, 4),
    ("float", 1, 4, 1, 64, 4),
    ("int8_kv", 4, 8192, 1, 64, 4),  # INT8 K+V, head_dim 128: 64-row tiles, 2 CTAs per SM
])
def test_default_plan_packs_heads_to_fill_a_tile(kind, group, q_bound, pack, block_m, warps):
    plan = pp._default_plan(128, group, q_bound, kind)
    assert (plan.pack, plan.block_m, plan.num_warps) == (pack, block_m, warps)


@pytest.mark.parametrize(("batch", "q_bound", "context", "launches", "splits"), [
    (64, 4, 8192, [(0, 0)], 1),  # q_len 4 at B=64: one packed launch fills the GPU
    (2, 4, 8192, [(0, 0)], 8),  # two sequences: keys split 8 ways
    (64, 64, 8192, [(0, 16), (17, 0)], 1),  # no length hint: short sequences apart
    (2, 64, 8192, [(0, 16), (17, 0)], 1),  # ... and unsplit: a merge would touch every row
    (1, 512, 8192, [(0, 0)], 1),  # one sequence: its query length is the bound
])
def test_default_launches(batch, q_bound, context, launches, splits):
    plans = pp._default_plans(128, 4, q_bound, "float", batch, 32, context, 132, True)
    assert [(p.min_q, p.max_q) for p in plans] == launches
    assert plans[0].splits == splits
    no_split = pp._default_plans(128, 4, q_bound, "float", batch, 32, context, 132, False)
    assert all(p.splits == 1 for p in no_split)


@cuda
@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
@pytest.mark.parametrize("geo", [(32, 8, 128), (24, 4, 256)])
def test_varlen_without_hints_takes_two_launches(kind, geo):
    """q_len 1, 4, 17 and 128 in one batch with no length hints: the short sequences go to
    the packed launch (GQA 6 packs all 6 heads), the rest to the tiled one."""
    hq, hkv, d = geo
    case = varlen_case([1, 4, 17, 128, 1], [1000, 8192, 0, 1, 3], num_q_heads=hq, num_kv_heads=hkv,
                   head_dim=d, kind=kind)
    assert len(pp.default_plans(case.call())) == 2
    assert rel_err(run_prefill(case, hinted=False), case.reference()) < 2e-2


@cuda
@pytest.mark.parametrize("kind", ["float", "int8_kv"])
def test_key_splits_merge_to_the_reference(kind):
    """Short queries over long histories with the keys split (the default for a small
    batch) and with a split count that does not divide the key tiles."""
    case = varlen_case([4, 2, 1], [5000, 0, 8192], num_q_heads=24, num_kv_heads=4, head_dim=128,
                   kind=kind)
    call = case.call(case.longest, case.longest_query)
    assert pp.default_plans(call)[0].splits > 1
    assert rel_err(run_prefill(case), case.reference()) < 2e-2
    plan = dataclasses.replace(pp.default_plan(call), splits=3)
    assert rel_err(run_prefill(case, plan), case.reference()) < 2e-2


@pytest.mark.parametrize(("kind", "group", "q_bound", "block_n", "stages"), [
    ("float", 8, 4, 64, 3),  # 32 packed rows: the short-query tiles
    ("float", 4, 64, 128, 2),  # 128 packed rows: the long-query tiles
    ("int8_kv", 4, 4, 128, 2),  # short
    ("int8_kv", 4, 8192, 64, 2),  # long, though its tiles hold 64 rows like the short ones
])
def test_short_queries_take_their_own_tiles(kind, group, q_bound, block_n, stages):
    plan = pp._default_plan(128, group, q_bound, kind)
    assert (plan.block_n, plan.num_stages) == (block_n, stages)

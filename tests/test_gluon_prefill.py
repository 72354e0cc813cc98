"""The ``gluon_prefill`` backend (INT8 K prefill in Gluon for sm_90, pagedfuse/ops/
gluon_prefill.py), both pipelines: "ws" (warp-specialized, TMA) and "cp" (cp.async).

On the CPU: which calls it declines and why, which caches the TMA boxes cannot load (and
that the default plan then takes "cp", or the call is declined where "cp" does not run its
kind), the launch plans of every cache kind and head dim, their checks and register budget,
which INT8 K+V calls take a dequantized copy of their pages and its size, the copy itself
under Triton's interpreter, and that the backend module imports without Triton. On an sm_90
GPU (marked ``cuda``):
varlen INT8 K batches (q_len 1, 4, 17, 128, 2048 and others, histories 0, 1, 1000 and
others, causal or not, pages of 1, 16, 32 and 256, NHD and HND, GQA 4 and 8, head_dim 128)
for each pipeline and tile shape; bf16/fp16 K and V and INT8 K+V at head_dim 64, 128 and
256 and INT8 K at 64 and 256 on the "ws" kernel; two CTAs per SM of short queries'
one-warpgroup tiles and of 128-row tiles at head_dim 64; two 16-bit KV heads as one
(kv_pairs) and the output by TMA (o_tma), each also against the launch without it; long
INT8 K+V queries on the dequantized copy at 64, 128 and 256; all against the float64
reference into NaN-poisoned outputs, directly, through the op with PAGEDFUSE_BACKEND and
through the shared conformance runner; and 100 CUDA graph replays per kind.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from helpers.cases import make_case, quantized
from helpers.conformance import GridCase, run_case
from helpers.cuda_cases import replayed
from helpers.prefill import paged_call

from pagedfuse import numerics
from pagedfuse.ops.backends import all_backends, reason, unregister_backend

NAME = "gluon_prefill"


@pytest.fixture(scope="module")
def gb():
    """The backend module; registered only for this module where the package did not
    register it (no Triton here), so that no other test sees a CUDA backend appear."""
    was_registered = NAME in {b.name for b in all_backends()}
    from pagedfuse.ops.backends import gluon_prefill

    yield gluon_prefill
    if not was_registered:
        unregister_backend(NAME)


def _int8k(q_lens, histories, **spec):
    """A causal INT8 K (bf16 V) batch of head_dim 128: these query lengths after these
    histories."""
    return make_case(seq_lens=[q + h for q, h in zip(q_lens, histories, strict=True)],
                     q_lens=q_lens, **{"num_q_heads": 16, "num_kv_heads": 4, "head_dim": 128,
                                       "dtype": torch.bfloat16, "kind": "int8_k",
                                       "causal": True, **spec})


@pytest.mark.parametrize(("spec", "why"), [
    (dict(bias="float", bias_shape="per_batch"), "attn_bias: not in the gluon_prefill kernel"),
    # pages the TMA boxes cannot load, in a kind or head_dim the cp pipeline does not run
    (dict(kind="float", block_size=1), "page size 1: the TMA boxes need a multiple of 8 keys"),
    (dict(kind="int8_kv", block_size=24), "page size 24: the TMA boxes need"),
    (dict(head_dim=64, block_size=1), "page size 1: the TMA boxes need"),
])
def test_calls_it_does_not_implement_are_declined(gb, spec, why):
    call = _int8k([5, 3], [7, 20], **spec).call()
    got = gb.call_unsupported(call)
    assert got.startswith(why), got
    if "page size" in why:
        kind, dim = spec.get("kind", "int8_k"), spec.get("head_dim", 128)
        assert got.endswith(f"the cp pipeline runs INT8 K with a 16-bit V at head_dim 128 "
                            f"only, not {kind} at {dim}")


def test_other_head_dims_are_declined(gb):
    """(The op refuses head_dim 96 on the CPU before any backend sees it: the record is
    built directly.)"""
    q = torch.randn(8, 4, 96).to(torch.bfloat16)
    kv = torch.randn(4, 16, 2, 96).to(torch.bfloat16)
    call = paged_call(q, kv, kv, torch.arange(4, dtype=torch.int32)[None], torch.tensor([40]),
                      torch.tensor([0, 8]), 0.1, True)
    assert gb.call_unsupported(call) == ("head_dim 96: the gluon_prefill kernel is built for "
                                         "[64, 128, 256]")


@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_every_kind_and_head_dim_takes_the_ws_kernel(gb, kind, head_dim):
    """One kernel for every cache kind: the default plan is "ws" with the kind's tiles (the
    fastest measured: four buffers of 64 keys for 16-bit K/V at head_dim 128, two of 64 in
    separate K and V rings at 256), served for both ops."""
    call = _int8k([300, 2], [10, 10], kind=kind, head_dim=head_dim).call(
        max_seq_len=gb.TWO_CTA_KEYS + 1)  # longer contexts: one CTA per SM
    assert gb.call_unsupported(call) is None
    plan = gb.default_plan(call)
    assert (plan.pipeline, plan.block_m, plan.pack) == ("ws", 128, 1)
    want = {(64, "float"): (128, 4), (64, "int8_k"): (128, 4), (64, "int8_kv"): (128, 4),
            (128, "float"): (64, 4), (128, "int8_k"): (128, 4), (128, "int8_kv"): (128, 3),
            (256, "float"): (64, 2), (256, "int8_k"): (64, 3), (256, "int8_kv"): (64, 3)}
    assert (plan.block_n, plan.stages) == want[head_dim, kind]
    assert plan.kv_rings == plan.v_loader == ((head_dim, kind) == (256, "float"))
    assert plan.q_tma == plan.sum_mma == (kind != "int8_kv")
    assert plan.lazy_max == (head_dim == 256 and kind != "int8_kv")
    assert plan.own_tiles == ((head_dim, kind) != (128, "int8_kv"))
    assert head_dim in gb.BACKEND.head_dims[call.op]


def test_the_cp_pipeline_is_int8_k_at_128_only(gb):
    for spec in (dict(kind="float"), dict(kind="int8_kv"), dict(head_dim=256)):
        call = _int8k([5, 3], [7, 20], **spec).call()
        with pytest.raises(ValueError, match=r"plan: the cp pipeline runs INT8 K with a "
                                             r"16-bit V at head_dim 128 only, not"):
            gb.make_plan(call, pipeline="cp")
    assert gb.make_plan(_int8k([5, 3], [7, 20]).call(), pipeline="cp").pipeline == "cp"


def test_supports_names_the_device_and_the_missing_options_first(gb):
    case = _int8k([5, 3], [7, 20])
    assert gb.supports(case.call()) == ("device cpu: Gluon kernels run on CUDA only (no "
                                        "interpreter)")
    assert gb.call_unsupported(case.call()) is None
    windowed = case.with_(window_left=16).call()
    assert gb.supports(windowed) == "window_left: not in the gluon_prefill kernel yet"
    assert reason(gb.BACKEND, case.call()).startswith("runs on cuda")


@pytest.mark.parametrize(("q_lens", "group", "plan"), [
    ([300, 2], 4, (128, 1)),  # long queries: 128 tokens of one head
    ([4, 4], 4, (64, 4)),  # short ones pack the group: 16 rows, one warpgroup
    ([16, 3], 8, (128, 8)),  # 8 heads x 16 tokens
    ([40, 9], 4, (128, 2)),  # 2 x 40 fits 128 rows, 4 x 40 does not
])
def test_default_plan(gb, q_lens, group, plan):
    case = _int8k(q_lens, [10, 10], num_q_heads=4 * group, num_kv_heads=4)
    got = gb.default_plan(case.call(max_query_len=max(q_lens)))
    assert (got.block_m, got.pack, got.pipeline) == (*plan, "ws")
    assert got.num_warps == 4 and got.tokens == got.block_m // got.pack
    cp = gb.make_plan(case.call(max_query_len=max(q_lens)), pipeline="cp")
    assert cp.num_warps == cp.block_m // 16


@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
def test_16_bit_v_caches_store_their_output_by_tma(gb, kind):
    """o_tma by default where a buffer of the output's type can hold a consumer's rows: the
    16-bit query's, or with INT8 K a 16-bit V cache's; INT8 V's buffers are int8."""
    call = _int8k([300, 2], [10, 10], kind=kind).call(max_query_len=300)
    assert gb.default_plan(call).o_tma == (kind != "int8_kv")


@pytest.mark.parametrize(("q_lens", "hint", "launches"), [
    ([300, 2], None, ((64, 4, 1, 0, 16), (128, 1, 3, 17, 0))),  # a packed launch, then the rest
    ([300, 300], 300, ((128, 1, 3, 0, 0),)),  # the sizes prove the lengths equal
    ([300], None, ((128, 1, 3, 0, 0),)),  # one sequence
    ([4, 4, 3], 4, ((64, 4, 1, 0, 0),)),  # every tile is already the packed one
])
def test_queries_that_may_differ_get_a_packed_launch_first(gb, q_lens, hint, launches):
    """default_plans: (block_m, pack, query tiles of the grid, min_q, max_q) per launch."""
    call = _int8k(q_lens, [10] * len(q_lens), kind="float", num_q_heads=16,
                  num_kv_heads=4).call(max_query_len=hint)
    plans = gb.default_plans(call)
    got = tuple((p.block_m, p.pack, -(-min(call.query_bound, p.max_q or call.query_bound)
                                       // p.tokens), p.min_q, p.max_q) for p in plans)
    assert got == launches
    for p in plans:
        gb.check_plan(call, p)


def test_default_plans_are_checked_once_per_signature(gb):
    """prefill_into's launches without a plan: default_plans through check_plan, kept per
    call signature and hint (the same tuple again), apart for another hint."""
    case = _int8k([300, 2], [10, 10], kind="float")
    call = case.call()
    plans = gb.checked_default_plans(call)
    assert plans == gb.default_plans(call) and len(plans) == 2  # packed launch first
    assert gb.checked_default_plans(call) is plans
    hinted = case.call(max_query_len=300)
    assert gb.checked_default_plans(hinted) == gb.default_plans(hinted)
    assert gb.checked_default_plans(hinted) is not plans


def _tiles_with_rows(q_lens, plan, tiles, min_query_len: int) -> int:
    """The query tiles of a launch that have rows: those of the sequences it serves."""
    shortest = max(plan.min_q, min_query_len)
    return sum(min(-(-q // plan.tokens), tiles.per_sequence) for q in q_lens
               if q >= shortest and (plan.max_q == 0 or q <= plan.max_q))


@pytest.mark.parametrize("min_query_len", [0, 2])
@pytest.mark.parametrize("kind", ["float", "int8_kv"])
def test_the_tile_list_holds_every_tile_with_rows(gb, kind, min_query_len):
    """tile_grid's list bound, on random batches (empty queries too): never below the tiles
    that have rows, a list only where it is shorter than a tile per (tile, sequence), and
    none where every query is equally long; the list by default with a 16-bit V only."""
    gen = torch.Generator().manual_seed(5)
    listed = 0
    for trial in range(120):
        batch = int(torch.randint(1, 40, (1,), generator=gen))
        top = [1, 4, 17, 300][trial % 4]
        q_lens = torch.randint(0, top + 1, (batch,), generator=gen).tolist()
        if sum(q_lens) == 0:
            continue
        hint = max(q_lens) if trial % 3 else None
        call = _int8k(q_lens, [5] * batch, kind=kind).call(max_query_len=hint)
        for plan in gb.default_plans(call):
            plan = dataclasses.replace(plan, tile_list=True)  # INT8 V's default: False
            tiles = gb.tile_grid(call, plan, min_query_len)
            full = batch * tiles.per_sequence
            assert _tiles_with_rows(q_lens, plan, tiles, min_query_len) <= tiles.length <= full
            assert tiles.listed == (tiles.length < full)
            listed += tiles.listed
            off = gb.tile_grid(call, dataclasses.replace(plan, tile_list=False), min_query_len)
            assert (off.listed, off.length) == (False, full)
    assert listed > 40, listed  # the bound is below the grid's often enough to matter
    assert gb.default_plan(call).tile_list == (kind != "int8_kv")  # measured per kind
    equal = _int8k([64] * 6, [5] * 6, kind=kind).call(max_query_len=64)
    plan = dataclasses.replace(gb.default_plan(equal), tile_list=True)
    assert not gb.tile_grid(call=equal, plan=plan).listed
    # decode rows beside two 512-token chunks: 69 tiles per head instead of 62 x 4
    mixed = _int8k([1] * 60 + [512, 512], [100] * 62, kind=kind).call(max_query_len=512)
    plan = dataclasses.replace(gb.default_plan(mixed), tile_list=True)
    assert gb.tile_grid(mixed, plan, 2) == gb.TileGrid(4, 69, True)


@pytest.mark.parametrize(("q_lens", "spec", "hint", "why"), [
    ([2048], {}, None, None),  # one sequence: its query is the longest
    ([512, 512], {}, 512, None),  # 1024 tokens = 2 x 512: every query is 512 long
    ([300, 200], dict(kind="int8_kv"), None, "500 tokens in 2 sequences of up to 500: "
                                             "the query lengths may differ, where it "
                                             "measured slower"),  # no hint
    ([512, 512], dict(kind="int8_kv"), None, None),  # the dequantized copy: INT8 K's rule
    ([300, 100], dict(kind="int8_kv"), 300, "400 tokens in 2 sequences of up to 300"),
    ([512, 100], dict(kind="int8_kv"), 512, None),  # 306 a sequence: the copy, INT8 K's rule
    ([512, 512], {}, None, None),  # INT8 K at 128: as fast with lengths that may differ
    # queries that may differ: two launches (default_plans), where they measured faster
    ([4, 3, 1], dict(kind="float", head_dim=256, num_q_heads=24), None, None),
    ([512, 100], dict(kind="float", head_dim=256), 512, None),
    ([4, 3, 1], dict(kind="float"), None, None),
    ([70, 64, 1], dict(kind="int8_kv"), None, "135 tokens in 3 sequences of up to 135"),
    ([256, 256], {}, 256, None),  # INT8 K at 128 from q_len 2
    ([32], dict(head_dim=64), None, None),  # INT8 K at 64 from q_len 2
    ([4, 4], dict(kind="float"), 4, None),
    ([200], dict(kind="int8_kv", head_dim=64), None, "int8_kv at head_dim 64: "
                                                     "triton_prefill measured as fast or "
                                                     "faster"),
    ([300], dict(kind="int8_kv", head_dim=64), None, None),  # the copy: INT8 K at 64
    ([2048], dict(kind="int8_kv", head_dim=64), None, None),  # the copy: INT8 K at 64
    ([8, 8], dict(kind="int8_kv", head_dim=64), 8, None),  # ... but for short queries
    ([9, 9], dict(kind="int8_kv", head_dim=64), 9, "int8_kv at head_dim 64: triton_prefill"),
    ([512], dict(head_dim=64), None, None),
    ([2], dict(kind="float", head_dim=64), None, None),
    ([512], dict(kind="float", head_dim=64), None, None),
    ([64], dict(kind="int8_kv", head_dim=256), None, None),
    ([4, 4], dict(kind="int8_kv", head_dim=256, num_q_heads=24), 4, None),  # from q_len 2
    ([4, 4], dict(head_dim=256, num_q_heads=24), 4, None),  # INT8 K at 256 from q_len 2
    ([4, 4], dict(kind="int8_kv"), 4, None),  # INT8 K+V at 128 from q_len 2
    ([512], dict(kind="float", head_dim=256), None, None),
])
def test_the_ops_choice_takes_it_where_it_measured_faster(gb, q_lens, spec, hint, why):
    """FASTER by cache kind and head_dim; queries the sizes do not prove equally long
    only where its launches for them measured faster (UNEQUAL_FASTER)."""
    call = _int8k(q_lens, [100] * len(q_lens), **spec).call(max_query_len=hint)
    got = gb.defers(call)
    assert got is None if why is None else got.startswith(why), got


def test_one_warpgroup_tiles_stop_at_head_dim_128(gb):
    """A decode call's 6 heads fit 64 rows, but at head_dim 256 one consumer's registers do
    not hold the accumulator: 128 rows there."""
    for head_dim, rows in ((128, 64), (256, 128)):
        case = _int8k([1, 1], [10, 10], num_q_heads=24, num_kv_heads=4, head_dim=head_dim)
        plan = gb.default_plan(case.call(max_query_len=1))
        assert (plan.block_m, plan.pack) == (rows, 6)


@pytest.mark.parametrize(("spec", "ws"), [
    (dict(), True),  # NHD, page 16: a page of a head is a [16, D] box at (row, head * D)
    (dict(layout="HND"), True),  # its page is 16 consecutive rows of a [*, D] view
    (dict(block_size=256), True),  # one 128-key box from inside the page
    (dict(block_size=32), True),
    (dict(block_size=1), False),  # one box per key
    (dict(block_size=24), False),  # 128-key tiles would split a page
    (dict(head_dim=64), True),  # 64-byte int8 rows: a 64-byte swizzle, one box wide
    (dict(head_dim=64, kind="float"), True),
])
def test_the_default_plan_takes_tma_where_the_pages_allow_it(gb, spec, ws):
    call = _int8k([130, 3], [7, 300], **spec).call()
    why = gb.tma_unsupported(call, 128)
    assert (why is None) == ws, why
    assert gb.default_plan(call).pipeline == ("ws" if ws else "cp")
    if not ws:
        assert why.startswith(f"page size {spec['block_size']}: the TMA boxes need")
        with pytest.raises(ValueError, match=r"plan: pipeline 'ws': page size"):
            gb.make_plan(call, pipeline="ws")


def test_caches_a_tma_view_cannot_address_are_named(gb):
    """Blocks padded by 16 bytes start between rows of the token-stride view; K and V pages
    interleaved in one tensor ([blocks, 2, page, H, D]) do not."""
    case = _int8k([5, 3], [7, 20])
    k = case.key_cache
    nb, page, h, d = k.shape
    padded = torch.zeros(nb, page * h * d + 16, dtype=k.dtype).as_strided(
        k.shape, (page * h * d + 16, h * d, d, 1))
    padded.copy_(k)
    why = gb.tma_unsupported(case.with_(key_cache=padded).call(), 128)
    assert why.startswith(f"key_cache: strides ({page * h * d + 16}, {h * d}, {d}, 1)")
    assert "a block stride that is a multiple of the token stride" in why
    assert gb.default_plan(case.with_(key_cache=padded).call()).pipeline == "cp"
    pair = torch.stack([k, k], dim=1)[:, 0]
    assert gb.tma_unsupported(case.with_(key_cache=pair).call(), 128) is None


@pytest.mark.parametrize("block_m", [64, 128])
def test_ws_register_budget_fits_the_register_file(gb, block_m):
    """Every warpgroup of a "ws" CTA gets maxnreg registers per thread at launch; setmaxnreg
    moves them from the producer's warpgroup to the consumers, within that total and the
    SM's 64K."""
    plan = gb.GluonPlan(block_m=block_m)
    consumers = block_m // 64
    total = plan.maxnreg * 128 * (consumers + 1)
    need = 128 * (consumers * gb.CONSUMER_REGS + gb.PRODUCER_REGS)
    assert need <= total <= 65536 and plan.maxnreg % 8 == 0
    two = gb.GluonPlan(block_m=block_m, ctas_per_sm=2)  # each within half the file
    assert 2 * two.maxnreg * 128 * (consumers + 1) <= 65536 and two.maxnreg % 8 == 0
    if block_m == 64:  # its consumer above the producer
        assert gb.PRODUCER_REGS < two.maxnreg <= plan.maxnreg
        assert two.worker_regs == (gb.CONSUMER_REGS, gb.PRODUCER_REGS)  # (no consumer 1)
    else:  # consumer 1 and the producer's warpgroup by setmaxnreg, consumer 0 the rest
        consumer, producer = two.worker_regs
        rest = two.maxnreg * (consumers + 1) - consumer - producer
        assert producer == gb.MIN_REGS and consumer % 8 == 0 and rest % 8 == 0
        assert abs(rest - consumer) <= 8 and consumer > two.maxnreg


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(block_m=32), "plan: block_m 32 not in (64, 128)"),
    (dict(max_q=-1), "plan: min_q 0 and max_q -1 must be >= 0"),
    (dict(block_n=256), "plan: block_n 256 not in (32, 64, 128)"),
    (dict(pack=3), "plan: pack 3 must divide the GQA group 4"),
    (dict(stages=1), "plan: stages 1 must be >= 2 for pipeline 'ws'"),
    (dict(pipeline="cp", stages=2), "plan: stages 2 must be >= 3 for pipeline 'cp'"),
    (dict(pipeline="tma"), "plan: pipeline 'tma' not in ('ws', 'cp')"),
    (dict(pipeline="cp", kv_rings=True), "plan: kv_rings: the 'cp' pipeline has one ring"),
    (dict(v_loader=True), "plan: v_loader needs kv_rings"),
    (dict(pipeline="cp", sum_mma=True), "plan: sum_mma is for the 'ws' pipeline, not 'cp'"),
    (dict(pipeline="cp", lazy_max=True), "plan: lazy_max is for the 'ws' pipeline"),
    (dict(pipeline="cp", own_tiles=True), "plan: own_tiles is for the 'ws' pipeline"),
    (dict(pipeline="cp", o_tma=True), "plan: o_tma is for the 'ws' pipeline"),
    (dict(ctas_per_sm=3), "plan: ctas_per_sm 3 not in (1, 2)"),
    (dict(block_m=128, ctas_per_sm=2), "plan: ctas_per_sm 2 with block_m 128 runs head_dim "
                                       "64 only, not 128"),
    (dict(block_m=128, ctas_per_sm=2, block_n=128, head_dim=64),
     "plan: ctas_per_sm 2 with block_m 128 takes block_n up to 64, not 128"),
    (dict(pipeline="cp", ctas_per_sm=2), "plan: ctas_per_sm 2 is for the 'ws' pipeline"),
    (dict(sum_mma=True, kind="int8_kv"), "plan: sum_mma needs a 16-bit V cache"),
    (dict(lazy_max=True, kind="int8_kv"), "plan: lazy_max needs a 16-bit V cache"),
    (dict(block_m=64, head_dim=256), "plan: block_m 64 with pipeline 'ws' runs head_dim up "
                                     "to 128, not 256"),
    (dict(wg1_widens=True, block_m=128, ctas_per_sm=1),
     "plan: wg1_widens needs an INT8 V cache and the 'ws' pipeline's second warpgroup "
     "(block_m 128), not int8_k on 'ws' with block_m 128"),
    (dict(wg1_widens=True, kind="int8_kv"),
     "plan: wg1_widens needs an INT8 V cache and the 'ws' pipeline's second warpgroup "
     "(block_m 128), not int8_kv on 'ws' with block_m 64"),
])
def test_bad_plans_are_refused_by_name(gb, overrides, message):
    plan = {k: v for k, v in overrides.items() if k not in ("head_dim", "kind")}
    call = _int8k([5, 3], [7, 20], head_dim=overrides.get("head_dim", 128),
                  kind=overrides.get("kind", "int8_k")).call()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gb.make_plan(call, **plan)


@pytest.mark.parametrize(("spec", "message"), [
    (dict(kind="int8_k"), "plan: kv_pairs: int8_k caches: each KV head has scales of its own"),
    (dict(kind="int8_k", pipeline="cp"), "plan: kv_pairs is for the 'ws' pipeline, not 'cp'"),
    (dict(num_q_heads=12, num_kv_heads=3),
     "plan: kv_pairs: 3 KV heads of head_dim 128: kv_pairs needs an even count"),
    (dict(head_dim=256, num_q_heads=8), "plan: kv_pairs: 4 KV heads of head_dim 256: kv_pairs "
                                        "needs an even count and twice the head_dim in"),
    (dict(layout="HND"), "plan: kv_pairs: key_cache: strides"),
])
def test_two_kv_heads_as_one_are_refused_by_name(gb, spec, message):
    """kv_pairs views two KV heads as one of twice the head_dim: 16-bit caches (an INT8
    cache's scales are per head), an even count of heads of half a built head_dim, side
    by side in each token's row, on the "ws" pipeline."""
    spec = {"kind": "float", **spec}
    pipeline = spec.pop("pipeline", None)
    call = _int8k([4, 3], [7, 20], **spec).call(max_query_len=4)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        gb.make_plan(call, kv_pairs=True, **({"pipeline": pipeline} if pipeline else {}))


@pytest.mark.parametrize(("spec", "q_len", "batch", "pairs"), [
    (dict(), 4, 8, True),  # 8 heads x 4 tokens: 32 rows of 64, both KV heads' 64 paired
    (dict(), 2, 8, True),
    (dict(), 4, 3, True),  # 12 unpaired CTAs: two waves of 8 SMs (the interpreter's count)
    (dict(), 4, 2, False),  # 8 unpaired CTAs fill one wave; 4 paired would leave SMs idle
    (dict(), 8, 8, False),  # 64 rows already
    (dict(kind="int8_k"), 4, 8, False),  # a scale per KV head
    (dict(head_dim=128), 4, 8, False),  # measured at head_dim 64 only
    (dict(layout="HND"), 4, 8, False),  # a token's heads are not side by side
])
def test_short_16_bit_queries_at_64_run_two_kv_heads_as_one(gb, spec, q_len, batch, pairs):
    spec = {"kind": "float", "head_dim": 64, **spec}
    case = _int8k([q_len] * batch, [100, 7] * (batch // 2) + [9] * (batch % 2),
                  num_q_heads=32, num_kv_heads=4, **spec)
    assert gb.sm_count(case.query.device) == 8
    plan = gb.default_plan(case.call(max_query_len=q_len))
    assert plan.kv_pairs == pairs
    if pairs:  # one consumer's rows hold both groups' heads
        assert (plan.block_m, plan.pack, plan.tokens) == (64, 16, 64 // 16)


def _query_view(layout: str, tokens: int = 40, heads: int = 8, dim: int = 128):
    """A bf16 query [tokens, heads, dim] with the strides of ``layout``."""
    if layout == "contiguous":
        return torch.zeros(tokens, heads, dim, dtype=torch.bfloat16)
    if layout == "every-other-head":  # strides, not a copy
        return torch.zeros(tokens, 2 * heads, dim, dtype=torch.bfloat16)[:, ::2]
    if layout == "head-major":  # a head's rows are whole rows of the token-stride view
        return torch.zeros(heads, tokens, dim, dtype=torch.bfloat16).transpose(0, 1)
    if layout == "one-token-stride-0":  # (validation only checks dims longer than 1)
        return torch.zeros(heads, dim, dtype=torch.bfloat16).as_strided((1, heads, dim),
                                                                         (0, dim, 1))
    # a token stride of 8 * 128 + 1 values: not 16-byte aligned
    return torch.zeros(tokens, heads * dim + 1, dtype=torch.bfloat16)[:, :-1].view(
        tokens, heads, dim)


@pytest.mark.parametrize(("layout", "plan", "tma"), [
    ("contiguous", {}, True), ("every-other-head", {}, True), ("head-major", {}, True),
    ("odd-token-stride", {}, False), ("one-token-stride-0", {}, False),
    ("contiguous", dict(pack=2), False),
    ("contiguous", dict(q_tma=False), False)])
def test_the_query_is_loaded_by_tma_where_a_view_holds_its_tiles(gb, layout, plan, tma):
    """The "ws" kernel's query TMA view: where the plan asks for it, a tile's rows are
    consecutive tokens of one head (pack 1) and the strides make a 2D view; else its
    consumers load it."""
    pytest.importorskip("triton.experimental.gluon")
    from pagedfuse.ops import gluon_prefill as gp

    q = _query_view(layout)
    got = gp._q_descriptor(q, gb.GluonPlan(**plan))
    assert (got is not None) == tma
    if tma:  # boxes of one consumer's 64 rows by one 128-byte span
        assert list(got.block_shape) == [64, 64] and got.strides[0] == q.stride(0)


def test_the_backend_imports_without_triton():
    """The module the package imports wherever Triton is installed must not need Gluon
    (older Triton) and must say so, not fail, where Triton itself is missing."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from pagedfuse.ops.backends import gluon_prefill as gb\n"
            "assert not gb._gluon_installed()\n"
            "assert 'pagedfuse.ops.gluon_prefill' not in sys.modules\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize(("q_lens", "spec", "budget", "taken"), [
    ([600, 500], dict(kind="int8_kv"), None, True),  # 550 tokens a sequence on average
    ([300, 220], dict(kind="int8_kv"), None, True),  # 260
    ([300, 200], dict(kind="int8_kv"), None, False),  # 250
    ([600, 500], dict(kind="int8_kv"), "0", False),  # no copy allowed
    ([600, 500], dict(kind="int8_kv"), "2", False),  # a copy of 2.13 MiB
    ([600, 500], dict(kind="int8_kv"), "3", True),
    ([600, 500], dict(kind="int8_k"), None, False),  # V already 16-bit
    ([600, 500], dict(kind="float"), None, False),
])
def test_long_int8_kv_queries_take_a_dequantized_copy(gb, q_lens, spec, budget, taken,
                                                       monkeypatch):
    """dequantizes_v: INT8 K+V only, queries of DEQUANT_V_FROM tokens a sequence on
    average, a copy within PAGEDFUSE_DEQUANT_SCRATCH_MB; the op's choice then judges the call
    as the INT8 K kernel it runs."""
    assert gb.DEQUANT_V_FROM == 256
    if budget is not None:
        monkeypatch.setenv("PAGEDFUSE_DEQUANT_SCRATCH_MB", budget)
    call = _int8k(q_lens, [100, 100], **spec).call(max_query_len=max(q_lens))
    assert gb.dequantizes_v(call) is taken
    assert gb.kernel_kind(call) == ("int8_k" if taken else call.kind)


@pytest.mark.parametrize("raw", ["lots", "-1", "1.5", ""])
def test_a_budget_that_is_not_a_whole_number_is_refused_by_name(gb, raw, monkeypatch):
    monkeypatch.setenv("PAGEDFUSE_DEQUANT_SCRATCH_MB", raw)
    call = _int8k([600, 500], [100, 100], kind="int8_kv").call(max_query_len=600)
    with pytest.raises(ValueError, match="PAGEDFUSE_DEQUANT_SCRATCH_MB: a whole number"):
        gb.dequantizes_v(call)


def test_the_copy_is_sized_by_the_table_or_the_hint(gb):
    """compact_pages: the table's width, or the pages the max_seq_len hint allows;
    compact_bytes: int8 K rows, their float32 scales and V rows in the query's dtype, for
    every sequence or a number of slots."""
    case = _int8k([600, 500], [100, 1000], kind="int8_kv", spare_blocks=7)  # 1500 keys
    call = case.call()
    assert gb.compact_pages(call) == call.geometry.max_blocks == 94 + 7
    hinted = case.call(max_seq_len=1500)
    assert gb.compact_pages(hinted) == 94
    row = 128 * (1 + 2) + 4  # head_dim 128: int8 K, bf16 V, a float32 scale
    assert gb.compact_bytes(hinted) == 2 * 94 * 16 * 4 * row
    assert gb.compact_bytes(hinted, 1) == 94 * 16 * 4 * row


@pytest.mark.parametrize(("q_lens", "kind", "budget", "slots"), [
    ([1] * 60 + [600, 520], "int8_kv", None, 4),  # 1180 tokens: 4 sequences of 256 or more
    ([1] * 60 + [300, 100], "int8_kv", None, 1),  # 460: one may have 256 (the copy ranks)
    ([1] * 60 + [150, 40], "int8_kv", None, 0),  # 250: none
    ([1] * 60 + [600, 520], "int8_k", None, 0),
    ([1] * 60 + [600, 520], "int8_kv", "0", 0),
])
def test_a_mixed_batchs_long_chunks_take_a_copy_of_their_own(gb, q_lens, kind, budget, slots,
                                                            monkeypatch):
    """long_query_slots (run_longer's copy): at most num_tokens // DEQUANT_V_FROM sequences,
    while the average query is short (no copy of every sequence)."""
    if budget is not None:
        monkeypatch.setenv("PAGEDFUSE_DEQUANT_SCRATCH_MB", budget)
    call = _int8k(q_lens, [100] * len(q_lens), kind=kind).call(max_query_len=max(q_lens))
    assert gb.long_query_slots(call) == slots
    assert not gb.dequantizes_v(call)


# The copy on CPU tensors under Triton's interpreter (a subprocess: the interpreter is chosen
# when Triton kernels are defined): every page a sequence's keys reach, from strided caches,
# ids past the cache clamped as the kernels clamp them, V in the query's dtype; and the
# float64 reference of the copy equals that of the call.
_COPY_SCRIPT = """
import math, torch
from helpers.cases import make_case
from pagedfuse.ops.backends import gluon_prefill as gb
from pagedfuse.ops.reference import paged_attention_reference
from pagedfuse.ops.triton_pages import dequantize_v
seed = int(torch.randint(1 << 30, ()))
for spec in (dict(layout="HND", block_size=16, dtype=torch.float32),
             dict(block_size=1, dtype=torch.bfloat16, index_dtype=torch.int64),
             dict(block_size=16, dtype=torch.float16, num_blocks=3)):
    case = make_case(seq_lens=[37, 0, 16, 5], q_lens=[4, 0, 16, 5], kind="int8_kv",
                     num_q_heads=4, num_kv_heads=2, head_dim=64, causal=True, seed=seed,
                     spare_blocks=2, **spec)
    call = case.call()
    width = gb.compact_pages(call)
    got = dequantize_v(call, width, 4)
    g, n = call.geometry, call.geometry.block_size
    assert got.kind == "int8_k" and got.value_cache.dtype == case.query.dtype
    assert got.geometry.num_blocks == g.batch * width and got.geometry.max_blocks == width
    assert torch.equal(got.block_table, torch.arange(g.batch * width).view(g.batch, width).int())
    ranked = dequantize_v(call, width, 2, min_query_len=5)  # sequences 2 and 3, slots 0 and 1
    assert torch.equal(ranked.block_table[:2], torch.zeros(2, width, dtype=torch.int32))
    assert torch.equal(ranked.block_table[2:], got.block_table[:2])
    spare = dequantize_v(call, width, 3, min_query_len=5)  # a slot no sequence fills
    assert torch.equal(spare.block_table, ranked.block_table)
    for b, length in enumerate(case.seq_lens.tolist()):
        for j in range(math.ceil(length / n)):
            blk = min(max(int(case.block_table[b, j]), 0), g.num_blocks - 1)
            row = b * width + j
            if b >= 2:
                assert torch.equal(ranked.value_cache[row - 2 * width], got.value_cache[row])
                assert torch.equal(ranked.key_cache[row - 2 * width], case.key_cache[blk])
            assert torch.equal(got.key_cache[row], case.key_cache[blk]), (spec, b, j)
            assert torch.equal(got.key_scale[row], case.key_scale[blk]), (spec, b, j)
            want_v = (case.value_cache[blk].float() * case.value_scale[blk][..., None])
            # rounded to nearest even as on the GPU, or cut as the interpreter casts to bf16
            near = want_v.to(case.query.dtype)
            cut = (want_v.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
            v = got.value_cache[row]
            ok = (v == near) | ((v == cut) if v.dtype == torch.bfloat16 else False)
            assert bool(ok.all()), (spec, b, j)
    ref = lambda c: paged_attention_reference(
        c.query, c.key_cache, c.value_cache, c.block_table, c.seq_lens, c.query_start_loc,
        c.scale, c.causal, None, c.key_scale, c.value_scale, compute_dtype=torch.float64)
    if case.query.dtype == torch.float32:  # V exact in the copy: the same attention
        torch.testing.assert_close(ref(got), ref(call), rtol=1e-6, atol=1e-6)
print("copied")
"""


def test_the_dequantized_copy_in_the_interpreter():
    pytest.importorskip("triton")
    import os
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _COPY_SCRIPT], capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0 and "copied" in run.stdout, run.stderr[-3000:]


# ---- on an sm_90 GPU -------------------------------------------------------------------

def _gpu_ready(gb) -> str | None:
    if not torch.cuda.is_available():
        return "no GPU"
    return gb.supports(_int8k([5, 3], [7, 20], device="cuda").call())


CASES = {
    "gqa4-varlen": dict(q_lens=[1, 4, 17, 128, 2048], histories=[1000, 0, 1, 1000, 0]),
    "gqa8-varlen": dict(q_lens=[300, 2, 33, 129, 17], histories=[1000, 2000, 0, 17, 1],
                        num_q_heads=32, num_kv_heads=4),
    "gqa4-noncausal": dict(q_lens=[64, 5, 200, 1], histories=[0, 100, 300, 1000],
                           causal=False),
    "gqa4-fp16-noncausal": dict(q_lens=[64, 5, 200], histories=[0, 100, 300],
                                dtype=torch.float16, causal=False),
    "gqa8-hnd-int64": dict(q_lens=[7, 150], histories=[500, 3], num_q_heads=16,
                           num_kv_heads=2, layout="HND", index_dtype=torch.int64),
    "page256": dict(q_lens=[300, 4, 17], histories=[1000, 1, 0], block_size=256),
    "page32": dict(q_lens=[129, 1, 40], histories=[0, 1000, 1], block_size=32),
    "page1": dict(q_lens=[33, 4, 17], histories=[100, 0, 1], block_size=1),
}
PIPELINES = ("ws", "cp")
# other tile shapes, on one case (each plan is its own compile): one consumer warpgroup
# (ws) or 4 warps (cp), and 64-key tiles
VARIANTS = {"ws": (dict(block_m=64), dict(block_n=64, stages=4),
                   dict(block_n=64, stages=2, kv_rings=True)),
            "cp": (dict(block_m=64), dict(block_n=64, stages=4))}


def _gpu_case(name: str):
    spec = dict(CASES[name])
    case = _int8k(spec.pop("q_lens"), spec.pop("histories"), device="cuda", **spec)
    return case, dict(max_seq_len=case.longest, max_query_len=case.longest_query)


@pytest.mark.cuda
@pytest.mark.parametrize("pipeline", PIPELINES)
@pytest.mark.parametrize("name", list(CASES))
def test_varlen_batches_match_the_reference(gb, name, pipeline, monkeypatch):
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case, hints = _gpu_case(name)
    call = case.call(**hints)
    assert reason(gb.BACKEND, call) is None
    if pipeline == "ws" and (why := gb.tma_unsupported(call, 128)):
        assert gb.default_plan(call).pipeline == "cp"
        pytest.skip(why)
    want = case.reference()
    tol = numerics.kernel_tolerance(case.query.dtype, "int8_k")
    plan = gb.make_plan(call, pipeline=pipeline)
    got = case.run_backend(gb.BACKEND, plan, **hints)  # into a NaN-filled output
    assert numerics.rel_err(got, want) <= tol, plan
    if plan == gb.default_plan(call):
        monkeypatch.setenv("PAGEDFUSE_BACKEND", NAME)
        assert numerics.rel_err(case.run_op(**hints), want) <= tol


# the other cache kinds and head dims (INT8 K at 128: CASES): one "ws" compile each
KIND_CASES = {
    f"{kind}-d{d}": dict(kind=kind, head_dim=d, q_lens=[1, 4, 17, 300],
                         histories=[1000, 0, 1, 200], num_q_heads=24 if d == 256 else 16)
    for kind in ("float", "int8_k", "int8_kv") for d in (64, 128, 256)
    if (kind, d) != ("int8_k", 128)
} | {
    "float-fp16-noncausal": dict(kind="float", dtype=torch.float16, causal=False,
                                 q_lens=[64, 5, 200], histories=[0, 100, 300]),
    "float-hnd-page256": dict(kind="float", layout="HND", block_size=256, q_lens=[130, 3],
                              histories=[7, 300]),
    "int8_kv-gqa8-packed": dict(kind="int8_kv", q_lens=[4, 2, 3], histories=[500, 40, 0],
                                num_q_heads=32, num_kv_heads=4),  # 8 heads x 4 tokens
    "int8_kv-fp16-page32": dict(kind="int8_kv", dtype=torch.float16, block_size=32,
                                q_lens=[129, 1, 40], histories=[0, 1000, 1]),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(KIND_CASES))
def test_every_cache_kind_matches_the_reference(gb, name, monkeypatch):
    """bf16/fp16 K and V (the float op), INT8 K and INT8 K+V, head_dim 64/128/256, on the
    "ws" kernel's default plan, directly into NaN and through the op."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    spec = dict(KIND_CASES[name])
    case = _int8k(spec.pop("q_lens"), spec.pop("histories"), device="cuda", **spec)
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    call = case.call(**hints)
    assert reason(gb.BACKEND, call) is None
    assert gb.default_plan(call).pipeline == "ws"
    want = case.reference()
    tol = numerics.kernel_tolerance(case.query.dtype, call.kind)
    got = case.run_backend(gb.BACKEND, None, **hints)
    assert numerics.rel_err(got, want) <= tol
    monkeypatch.setenv("PAGEDFUSE_BACKEND", NAME)
    assert numerics.rel_err(case.run_op(**hints), want) <= tol


@pytest.mark.cuda
@pytest.mark.parametrize("v_loader", [False, True])
@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_separate_k_and_v_rings_match_the_reference(gb, kind, block_size, v_loader):
    """K and V buffers released apart (kv_rings), two of each, in every cache kind, loaded
    by one warp or by two (v_loader): the scales travel on their own cache's barrier, and
    the tile past a sequence's last key (cp.async, zero-filled) is signalled on each."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case = _int8k([1, 4, 17, 300], [1000, 0, 1, 200], device="cuda", seed=3, kind=kind,
                  block_size=block_size)
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    plan = gb.make_plan(case.call(**hints), block_n=64, stages=2, kv_rings=True,
                        v_loader=v_loader)
    got = case.run_backend(gb.BACKEND, plan, **hints)
    tol = numerics.kernel_tolerance(case.query.dtype, case.call().kind)
    assert numerics.rel_err(got, case.reference()) <= tol


@pytest.mark.cuda
@pytest.mark.parametrize("kv_rings", [False, True])
@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
def test_consumers_that_stop_at_their_own_tiles_change_nothing(gb, kind, kv_rings):
    """own_tiles: below the diagonal consumer 0 stops a 64-key tile before consumer 1, and a
    consumer whose rows all lie past the query (a 130-token query's second tile) stops after
    one, handing 17 tiles back unread through two buffers: bit-identical to every consumer
    reading every tile, and to the reference, in every cache kind with and without K and V
    rings."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case = _int8k([130, 64, 1, 300], [1000, 0, 5, 37], device="cuda", seed=7, kind=kind)
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    outs = [case.run_backend(gb.BACKEND, gb.make_plan(case.call(**hints), block_n=64, stages=2,
                                                      kv_rings=kv_rings, own_tiles=own),
                             **hints) for own in (False, True)]
    assert torch.equal(outs[0], outs[1])  # (NaN-filled first: every row written)
    tol = numerics.kernel_tolerance(case.query.dtype, case.call().kind)
    assert numerics.rel_err(outs[1], case.reference()) <= tol


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_output_by_tma_changes_nothing(gb, head_dim, dtype):
    """o_tma: a consumer whose 64 rows are all in the query stores them by TMA boxes from a
    buffer no one reads any more (a 16-bit query's own; with INT8 K one of V's, chosen by the
    CTA's key tiles, so the sequences' lengths vary them), any other by its threads' own
    stores (a query's last tile, rows past a short query): bit-identical to every row stored
    by its threads, into NaN, and within the reference's tolerance, at the default buffers
    and, with INT8 K, at 3 and 4 of 64 and 128 keys and one consumer; INT8 V (int8 buffers)
    and two consumers over 2 buffers keep their threads' stores (no output view)."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    from pagedfuse.ops import gluon_prefill as gp  # the kernel module: Gluon

    for kind in ("float", "int8_k", "int8_kv"):
        case = _int8k([130, 64, 1, 300, 17], [1000, 0, 5, 37, 1], device="cuda", seed=17,
                      kind=kind, head_dim=head_dim, dtype=dtype,
                      num_q_heads=24 if head_dim == 256 else 16)
        hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
        call = case.call(**hints)
        tiles = [{}]
        if kind == "int8_k":
            tiles += [dict(block_n=n, stages=st, ctas_per_sm=1) for n in (64, 128)
                      for st in (3, 4) if head_dim < 256 or n == 64]
            tiles += [dict(stages=2, ctas_per_sm=1)]
            tiles += [dict(block_m=64, ctas_per_sm=1)] if head_dim < 256 else []
        q = gp.quantize_int8(call.query) if call.int8_k else (call.query, None)
        for tile in tiles:
            plans = [gb.make_plan(call, o_tma=on, **tile) for on in (False, True)]
            launch = gp.launch_args(call, torch.empty_like(call.query), plans[1], *q)
            by_tma = kind != "int8_kv" and not (plans[1].block_m == 128
                                                 and plans[1].stages < 3 and call.int8_k)
            assert (launch.args[3] is not None) == by_tma, (kind, tile)  # o_desc
            outs = [case.run_backend(gb.BACKEND, plan, **hints) for plan in plans]
            assert torch.equal(outs[0], outs[1]), (kind, tile)
            tol = numerics.kernel_tolerance(case.query.dtype, call.kind)
            assert numerics.rel_err(outs[1], case.reference()) <= tol, (kind, tile)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
def test_two_ctas_of_128_rows_match_the_reference(gb, kind):
    """Long queries' 128-row tiles at two CTAs per SM (head_dim 64): the default plan over
    short contexts where the kind has one (TWO_CTA_TILES) and 32 and 64 keys per tile, rows'
    sums on either core, histories of 0 to 1000 keys."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case = _int8k([130, 64, 1, 300, 17], [1000, 0, 5, 37, 1], device="cuda", seed=21,
                  kind=kind, head_dim=64)
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    call = case.call(**hints)
    sums = (False,) if kind == "int8_kv" else (False, True)
    plans = [gb.make_plan(call, ctas_per_sm=2, block_n=n, stages=st, sum_mma=s)
             for n, st in ((64, 3), (32, 4), (64, 2)) for s in sums]
    if kind in gb.TWO_CTA_TILES:
        plans.append(gb.default_plan(call))
        assert plans[-1].ctas_per_sm == 2
    tol = numerics.kernel_tolerance(case.query.dtype, case.call().kind)
    want = case.reference()
    for plan in plans:
        got = case.run_backend(gb.BACKEND, plan, **hints)
        assert numerics.rel_err(got, want) <= tol, plan


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_two_ctas_per_sm_match_the_reference(gb, kind, head_dim):
    """Short queries' one-warpgroup tiles at half the register file (ctas_per_sm 2), in
    every cache kind: the default plan (SHORT_INT8_TILES with an INT8 K cache) and two and
    three buffers of 64 keys."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case = _int8k([4, 2, 4, 1, 3], [1000, 0, 37, 5, 300], device="cuda", seed=9, kind=kind,
                  head_dim=head_dim)
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    tol = numerics.kernel_tolerance(case.query.dtype, case.call().kind)
    want = case.reference()
    call = case.call(**hints)
    plans = [gb.default_plan(call)] + [gb.make_plan(call, block_n=64, stages=stages,
                                                    ctas_per_sm=2) for stages in (2, 3)]
    for plan in plans:
        assert plan.block_m == 64
        got = case.run_backend(gb.BACKEND, plan, **hints)
        assert numerics.rel_err(got, want) <= tol, plan


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 8, 16), (64, 4, 256),
                                                               (128, 4, 16)])
def test_two_kv_heads_as_one_match_the_reference(gb, dtype, head_dim, group, block_size):
    """kv_pairs: each two KV heads' tiles as one head of twice the head_dim, each query row
    in its own half of the columns, into NaN: at head_dim 64 one consumer's rows (the tiles
    of the paired default) and 128 rows of both groups' heads, at 128 a pair of 256 (the
    16-bit tiles there); against the reference and the same launch without pairs."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case = _int8k([4, 2, 4, 1, 3], [1000, 0, 37, 5, 300], device="cuda", seed=13, kind="float",
                  head_dim=head_dim, dtype=dtype, block_size=block_size,
                  num_q_heads=4 * group, num_kv_heads=4)
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    call = case.call(**hints)
    tol = numerics.kernel_tolerance(case.query.dtype, call.kind)
    want = case.reference()
    pair = dict(kv_pairs=True, pack=2 * group)
    if head_dim == 64:
        plans = [gb.make_plan(call, **pair, block_m=block_m, block_n=64, stages=4)
                 for block_m in (64, 128)]
    else:
        plans = [gb.make_plan(call, **pair, block_m=128, block_n=64, stages=2, kv_rings=True,
                              v_loader=True)]
    for plan in plans:
        got = case.run_backend(gb.BACKEND, plan, **hints)
        assert numerics.rel_err(got, want) <= tol, plan
        alone = case.run_backend(gb.BACKEND, dataclasses.replace(
            plan, kv_pairs=False, pack=math.gcd(plan.pack, group)), **hints)
        assert numerics.rel_err(got, alone.float()) <= tol, plan


@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_short_contexts_at_head_dim_64_take_two_ctas_per_sm(gb, kind, head_dim):
    """Long queries over at most TWO_CTA_KEYS keys a sequence (the hint, else the table's
    capacity) whose rows read at most TWO_CTA_MEAN_KEYS keys on average (the context less
    half the queries): at head_dim 64 with 16-bit K/V or INT8 K, 128-row tiles at two CTAs
    per SM with TWO_CTA_TILES; one CTA over longer contexts, at head_dim 128 and with INT8
    V, and for 16-bit K/V whose rows read more than 1536 keys on average."""
    case = _int8k([300, 2], [10, 10], kind=kind, head_dim=head_dim)
    keys = gb.TWO_CTA_KEYS
    # (max_seq_len, max_query_len, mean keys, two CTAs with 16-bit K/V, with INT8 K)
    for seq, query, mean, two_float, two_int8_k in (
            (2048, 2048, 1024, True, True),  # eight 2K prompts
            (2048, 64, 2016, False, True),  # q_len 64 over 2K keys
            (keys, keys, 2048, False, True),
            (keys, 64, 4064, False, True),
            (keys + 1, keys + 1, 2049, False, False)):  # past TWO_CTA_KEYS
        call = case.call(max_seq_len=seq, max_query_len=query)
        assert gb.mean_keys(call) == mean
        plan = gb.default_plan(call)
        two = head_dim == 64 and {"float": two_float, "int8_k": two_int8_k}.get(kind, False)
        assert (plan.block_m, plan.ctas_per_sm) == (128, 2 if two else 1), (seq, query)
        if two:
            assert (plan.block_n, plan.stages, plan.sum_mma) == gb.TWO_CTA_TILES[kind]
            gb.check_plan(call, plan)
    unhinted = gb.default_plan(case.call())  # the table's capacity: a short context
    two = head_dim == 64 and kind in gb.TWO_CTA_TILES
    assert unhinted.ctas_per_sm == (2 if two else 1)


def test_mean_keys_reads_the_whole_context_where_queries_do_not_end_it(gb):
    """Not causal (every row reads every key): the mean is the context."""
    case = _int8k([300, 2], [10, 10], kind="float", head_dim=64)
    causal = case.call(max_seq_len=2048, max_query_len=2048)
    assert gb.mean_keys(causal) == 1024
    assert gb.mean_keys(causal._replace(causal=False)) == 2048


@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_short_int8_tiles_take_two_ctas_per_sm(gb, kind, head_dim):
    """A q_len 4 call's default plan: with an INT8 K cache at head_dim 64 and 128 (one
    warpgroup of 64 rows) SHORT_INT8_TILES' tiles at two CTAs per SM; 16-bit K/V and head_dim
    256 (128 rows) keep one."""
    call = _int8k([4, 4], [100, 100], kind=kind, head_dim=head_dim).call(max_query_len=4)
    plan = gb.default_plan(call)
    short = gb.SHORT_INT8_TILES.get((call.kind, head_dim))
    assert (plan.block_m == 64) == (head_dim <= gb.MAX_HEAD_DIM_64_ROWS)
    assert plan.ctas_per_sm == (2 if short else 1)
    if short:
        assert (plan.block_n, plan.stages) == short and plan.maxnreg == 128


@pytest.mark.parametrize(("kind", "head_dim", "q_len", "widens"), [
    ("int8_kv", 256, 4, True), ("int8_kv", 256, 8, True), ("int8_kv", 256, 17, False),
    ("int8_kv", 128, 4, False), ("int8_k", 256, 4, False), ("float", 256, 4, False)])
def test_short_int8_v_queries_at_256_widen_in_the_second_warpgroup(gb, kind, head_dim,
                                                                   q_len, widens):
    """Where one consumer's 64 rows hold a GQA group's short query but one consumer cannot
    run head_dim 256 alone, the second warpgroup widens INT8 V (wg1_widens) and a tile holds
    64 rows, with WG1_WIDENS_STAGES buffers; longer queries, other head dims and 16-bit V keep
    two consumers."""
    call = _int8k([q_len, 2], [100, 100], kind=kind, head_dim=head_dim,
                  num_q_heads=24 if head_dim == 256 else 16).call(max_query_len=q_len)
    plan = gb.default_plan(call)
    assert plan.wg1_widens == widens
    if widens:
        assert (plan.block_m, plan.rows, plan.tokens) == (128, 64, 64 // plan.pack)
        assert plan.stages == gb.WG1_WIDENS_STAGES


def _keys_scaled_per_page(case, top: float, seed: int):
    """``case`` (on the CPU) with each page's keys times its own factor, log-uniform in [1,
    top]: along a row's keys its maximum score jumps by more than LAZY_LOG2 at some tiles
    and creeps up by less at others."""
    gen = torch.Generator().manual_seed(seed)
    factor = torch.exp(torch.rand(case.key_float.shape[0], generator=gen) * math.log(top))
    key_float = case.key_float * factor[:, None, None, None]
    key, key_scale = key_float.to(case.value_cache.dtype), None
    if case.key_scale is not None:
        key, key_scale = quantized(key_float)
    return dataclasses.replace(case, key_cache=key, key_scale=key_scale, key_float=key_float)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_second_warpgroup_widening_matches_the_reference(gb, head_dim):
    """wg1_widens: consumer 1's warps widen INT8 V for consumer 0's 64 rows: short queries
    packed over a GQA group and a 40-token one (several 64-row tiles), histories from 0 to
    1000, one ring and K and V rings, two to four buffers."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case = _int8k([4, 2, 4, 1, 3, 40], [1000, 0, 37, 5, 300, 100], device="cuda", seed=17,
                  kind="int8_kv", head_dim=head_dim, num_q_heads=24 if head_dim == 256 else 16)
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    call = case.call(**hints)
    widens = dict(block_m=128, wg1_widens=True, ctas_per_sm=1)
    variants = [dict(), dict(block_n=64, stages=2, kv_rings=True), dict(block_n=64, stages=4)]
    tol = numerics.kernel_tolerance(case.query.dtype, call.kind)
    want = case.reference()
    for variant in variants:
        plan = gb.make_plan(call, **(widens | variant))
        got = case.run_backend(gb.BACKEND, plan, **hints)
        assert numerics.rel_err(got, want) <= tol, plan


@pytest.mark.cuda
@pytest.mark.parametrize("flags", [
    dict(sum_mma=False, lazy_max=False), dict(sum_mma=True, lazy_max=False),
    dict(sum_mma=False, lazy_max=True), dict(sum_mma=True, lazy_max=True)])
@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
def test_softmax_variants_match_the_reference(gb, kind, flags):
    """The rows' sums on the tensor cores (sum_mma) and maxima that move only past LAZY_LOG2
    (lazy_max), apart and together, with keys whose scores jump and creep along the rows
    (pages scaled by up to 24x), in 64- and 128-key tiles."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    if (flags["sum_mma"] or flags["lazy_max"]) and kind == "int8_kv":
        pytest.skip("sum_mma and lazy_max need a 16-bit V")
    case = _int8k([1, 4, 17, 700], [1000, 0, 1, 300], kind=kind, seed=11,
                  num_blocks=200)
    case = _keys_scaled_per_page(case, 24.0, seed=12).to("cuda")
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    want = case.reference()
    tol = numerics.kernel_tolerance(case.query.dtype, case.call().kind)
    for block_n in (64, 128):
        plan = gb.make_plan(case.call(**hints), block_n=block_n, stages=2, **flags)
        got = case.run_backend(gb.BACKEND, plan, **hints)
        assert numerics.rel_err(got, want) <= tol, plan


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["every-other-head", "head-major"])
def test_query_views_the_tma_loads_match_the_reference(gb, layout):
    """Long queries (one head per tile: the query by TMA) in a strided and a head-major
    query: the head's offset in the view is columns in the strided one, rows in the
    head-major one."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    from pagedfuse.ops import gluon_prefill as gp

    case = _int8k([300, 129, 5], [0, 200, 1000], device="cuda", kind="float", seed=5,
                  strided_query=layout == "every-other-head")
    if layout == "head-major":
        case = dataclasses.replace(case, query=case.query.transpose(0, 1).contiguous()
                                   .transpose(0, 1))
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    plan = gb.make_plan(case.call(**hints))
    assert gp._q_descriptor(case.query, plan) is not None
    got = case.run_backend(gb.BACKEND, plan, **hints)
    tol = numerics.kernel_tolerance(case.query.dtype, case.call().kind)
    assert numerics.rel_err(got, case.reference()) <= tol


@pytest.mark.cuda
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_other_tile_shapes_match_the_reference(gb, pipeline):
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case, hints = _gpu_case("gqa4-varlen")
    want = case.reference()
    tol = numerics.kernel_tolerance(case.query.dtype, "int8_k")
    for variant in VARIANTS[pipeline]:
        plan = gb.make_plan(case.call(**hints), pipeline=pipeline, **variant)
        got = case.run_backend(gb.BACKEND, plan, **hints)
        assert numerics.rel_err(got, want) <= tol, plan


@pytest.mark.cuda
@pytest.mark.parametrize(("pipeline", "kind"), [("ws", "int8_k"), ("cp", "int8_k"),
                                                ("ws", "float"), ("ws", "int8_kv")])
def test_cuda_graph_replays(gb, pipeline, kind):
    """100 replays of a captured launch give the eager output, and a replay reads new
    inputs: no host synchronisation, and the TMA descriptors captured as parameters stay
    valid."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case = _int8k([300, 4, 17, 1], [1000, 1, 0, 200], device="cuda", seed=2, kind=kind)
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    call = case.call(**hints)
    plan = gb.make_plan(call, pipeline=pipeline)
    out = torch.full_like(case.query, float("nan"))
    run = lambda: gb.run(call, out, plan)  # noqa: E731
    run()
    eager = out.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    outs = replayed(graph, out, 100)
    assert all(torch.equal(o, eager) for o in outs)
    case.query.copy_(torch.randn_like(case.query))
    graph.replay()
    tol = numerics.kernel_tolerance(case.query.dtype, kind)
    assert numerics.rel_err(out, case.reference()) <= tol


@pytest.mark.cuda
@pytest.mark.parametrize(("head_dim", "spec"), [
    (64, {}), (128, {}), (256, dict(num_q_heads=24)),
    (128, dict(layout="HND", dtype=torch.float16, block_size=32)),
])
def test_long_int8_kv_queries_run_on_the_dequantized_copy(gb, head_dim, spec, monkeypatch):
    """Queries long enough for dequantizes_v: the copy and the INT8 K kernel against the
    float64 reference (into NaN, and through the op), as close as the kernel that widens V
    itself (a budget of 0); captured in a CUDA graph, 100 replays give the eager output and
    a replay reads a changed V cache (the copy is in the graph)."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case = _int8k([1100, 600, 1], [0, 1000, 300], device="cuda", seed=11, kind="int8_kv",
                  head_dim=head_dim, **spec)
    hints = dict(max_seq_len=case.longest, max_query_len=case.longest_query)
    call = case.call(**hints)
    assert gb.dequantizes_v(call)
    want = case.reference()
    tol = numerics.kernel_tolerance(case.query.dtype, "int8_kv")
    got = case.run_backend(gb.BACKEND, None, **hints)
    assert numerics.rel_err(got, want) <= tol
    with monkeypatch.context() as m:
        m.setenv("PAGEDFUSE_DEQUANT_SCRATCH_MB", "0")
        widened = case.run_backend(gb.BACKEND, None, **hints)
    assert numerics.rel_err(widened, want) <= tol
    monkeypatch.setenv("PAGEDFUSE_BACKEND", NAME)
    assert numerics.rel_err(case.run_op(**hints), want) <= tol
    out = torch.full_like(case.query, float("nan"))
    gb.run(call, out)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gb.run(call, out)
    assert all(torch.equal(o, eager) for o in replayed(graph, out, 100))
    case.value_cache.copy_(torch.randint_like(case.value_cache, -127, 128))
    graph.replay()
    assert numerics.rel_err(out, case.reference()) <= tol


@pytest.mark.cuda
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_rows_without_keys_are_zero_and_no_hint_is_needed(gb, pipeline):
    """5 tokens over 3 keys (under causal the first two read none), 2 tokens over no key,
    70 over 110: zeros where the reference has them, no length hints."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case = _int8k([5, 2, 70], [-2, -2, 40], device="cuda", seed=1)
    plan = gb.make_plan(case.call(), pipeline=pipeline)
    got = case.run_backend(gb.BACKEND, plan).cpu().double()
    want = case.reference()
    dead = [0, 1, 5, 6]
    assert not want[dead].any() and not got[dead].any()
    assert numerics.rel_err(got, want) <= numerics.kernel_tolerance(torch.bfloat16, "int8_k")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
def test_queries_that_may_differ_take_a_packed_launch_and_the_main_one(gb, kind, monkeypatch):
    """No length hints: the sequences of up to 16 tokens (the packed tile's) in one launch,
    the longer in another, each writing only its own rows; run_longer leaves the one-token
    sequences' rows as they were; and the op's choice where UNEQUAL_FASTER says."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    case = _int8k([1, 4, 16, 17, 130], [1000, 0, 40, 1, 200], kind=kind, device="cuda",
                  seed=3)
    call = case.call()
    short, main = gb.default_plans(call)
    assert (short.max_q, main.min_q) == (16, 17)
    want = case.reference()
    tol = numerics.kernel_tolerance(case.query.dtype, call.kind)
    assert numerics.rel_err(case.run_backend(gb.BACKEND), want) <= tol
    out = torch.full_like(case.query, float("nan"))
    gb.run_longer(call, out)
    assert out[0].isnan().all()  # the one-token sequence's row: not this kernel's
    assert numerics.rel_err(out[1:].cpu().double(), want[1:]) <= tol
    assert (gb.defers(call) is None) == ((call.kind, 128) in gb.UNEQUAL_FASTER)
    if kind == "float":
        monkeypatch.setenv("PAGEDFUSE_BACKEND", NAME)
        assert numerics.rel_err(case.run_op(), want) <= tol


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
def test_tile_lists_over_many_sequences_match_the_reference(gb, kind):
    """300 sequences, so that the kernel's search of its tile list takes three steps
    (LIST_CHUNK 128), with empty queries and one-token ones among them and the longest
    last: the default launches with and without the length hint, over a tile list and
    over a tile per (tile, sequence), bit for bit alike, and run_longer."""
    if why := _gpu_ready(gb):
        pytest.skip(why)
    q_lens = ([0, 1, 3, 2, 17, 1, 40] * 43)[:299] + [300]
    histories = ([0, 1000, 5, 1] * 75)[:300]
    case = _int8k(q_lens, histories, kind=kind, device="cuda", seed=4)
    want = case.reference()
    tol = numerics.kernel_tolerance(case.query.dtype, kind)
    for hint in (300, None):
        call = case.call(max_query_len=hint)
        outs = {}
        for listed in (True, False):
            plans = [dataclasses.replace(p, tile_list=listed) for p in gb.default_plans(call)]
            assert gb.tile_grid(call, plans[-1]).listed == listed
            outs[listed] = torch.full_like(case.query, float("nan"))
            for plan in plans:
                gb.run(call, outs[listed], plan)
        assert numerics.rel_err(outs[True], want) <= tol, hint
        assert torch.equal(outs[True], outs[False]), hint
        got = case.run_backend(gb.BACKEND, None, max_query_len=hint)  # the default launches
        assert torch.equal(got, outs[True]), hint
    out = torch.full_like(case.query, float("nan"))
    gb.run_longer(case.call(max_query_len=300), out)  # over a list with a 16-bit V
    ones = torch.tensor([q == 1 for q in q_lens]).repeat_interleave(torch.tensor(q_lens))
    assert out[ones.cuda()].isnan().all()  # the one-token sequences' rows: not its
    assert numerics.rel_err(out[~ones.cuda()].cpu().double(), want[~ones]) <= tol


GRID = [
    GridCase("gluon-int8k-bf16-gqa4-causal", dict(seq_lens=(300, 70, 1000), q_lens=(300, 7, 2),
                                                  num_q_heads=8, head_dim=128, dtype=torch.bfloat16,
                                                  kind="int8_k", causal=True), "exact"),
    GridCase("gluon-int8k-f16-gqa8-noncausal", dict(seq_lens=(40, 53), q_lens=(6, 9),
                                                    num_q_heads=16, head_dim=128,
                                                    dtype=torch.float16, kind="int8_k")),
    GridCase("gluon-bf16-gqa4-causal-d256", dict(seq_lens=(300, 70), q_lens=(300, 7),
                                                 num_q_heads=8, head_dim=256,
                                                 dtype=torch.bfloat16, causal=True), "exact"),
    GridCase("gluon-int8kv-f16-gqa8-noncausal-d64", dict(seq_lens=(40, 53), q_lens=(6, 9),
                                                         num_q_heads=16, head_dim=64,
                                                         dtype=torch.float16,
                                                         kind="int8_kv")),
]


@pytest.mark.cuda
@pytest.mark.parametrize("grid_case", GRID, ids=[c.name for c in GRID])
def test_through_the_conformance_runner(gb, grid_case, monkeypatch):
    if why := _gpu_ready(gb):
        pytest.skip(why)
    assert run_case(gb.BACKEND, grid_case, "cuda", monkeypatch) is None

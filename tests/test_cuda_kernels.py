"""GPU tests of the CUDA backends (backends/triton.py: the Triton kernel; backends/cuda_decode.py:
the CUDA C++ decode of csrc/cuda) beyond the shared conformance grid: their launch plans
(split counts, KV heads per CTA, the balanced grid, programmatic dependent launch), which
backend the op picks, and CUDA graphs, against the float64 reference.

Each case is one kernel specialisation (every new constexpr combination compiles), so the
lists are hand-picked to cover each axis rather than a product. Outputs are NaN-poisoned
before every direct backend call.
"""

from __future__ import annotations

import pytest
import torch
from helpers.cases import KINDS, Case, quantized
from helpers.cuda_cases import gpu_case, lengths, replayed, run

from pagedfuse import numerics
from pagedfuse.ops import cuda_native
from pagedfuse.ops.backends import choose, get_backend, reason
from pagedfuse.ops.reference import quantize_int8_reference

pytest.importorskip("triton")
from pagedfuse.ops import cuda  # noqa: E402  (needs Triton)
from pagedfuse.ops.backends import cuda_decode, triton  # noqa: E402

pytestmark = pytest.mark.cuda

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32


def tol(case: Case) -> float:
    return numerics.kernel_tolerance(case.query.dtype, case.call().kind)


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(
        out.cpu().double().flatten(), ref.double().flatten(), dim=0))


FLOAT_CASES = {
    "d64-gqa1-page16-b1": dict(seq_lens=lengths(1), num_q_heads=8, num_kv_heads=8),
    "d128-gqa4-hnd-int64-b8": dict(seq_lens=lengths(8), num_q_heads=32, num_kv_heads=8,
                                   head_dim=128, layout="HND", index_dtype=torch.int64),
    "d256-gqa6-b3": dict(seq_lens=lengths(3), num_q_heads=24, num_kv_heads=4, head_dim=256),
    "d128-gqa5-page1-fp16": dict(seq_lens=lengths(4, 1), num_q_heads=10, head_dim=128,
                                 block_size=1, dtype=f16),
    "d64-gqa8-page256-hnd-b64": dict(seq_lens=lengths(64, 256), num_q_heads=32,
                                     num_kv_heads=4, block_size=256, layout="HND"),
    "d128-gqa4-fp32": dict(seq_lens=lengths(2), head_dim=128, dtype=f32),
    "d256-gqa8-long-splits": dict(seq_lens=(5000, 2777), num_q_heads=16, head_dim=256),
}


@pytest.mark.parametrize("name", list(FLOAT_CASES))
def test_decode_matches_reference(name):
    case = gpu_case(**FLOAT_CASES[name])
    ref = case.reference()
    assert numerics.rel_err(run(case), ref) < tol(case)
    hinted = run(case, max_seq_len=case.longest, max_query_len=1)
    assert numerics.rel_err(hinted, ref) < tol(case)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_count_does_not_change_the_result(splits):
    case = gpu_case(seq_lens=(900, 17, 3000), num_q_heads=16, num_kv_heads=4, head_dim=128)
    out = run(case, "triton", splits=splits)
    assert numerics.rel_err(out, case.reference()) < 2e-2


@pytest.mark.parametrize(("geo", "batch", "length", "int8", "chosen"), [
    ((4, 256), 64, 8192, False, 4),  # qwen35: 1 split under-fills the H200, 4 was 3-5% faster
    ((4, 64), 64, 8192, False, 4),  # tinyllama: 2 splits measured 8-11% slower than 4
    ((8, 128), 64, 8192, False, 1),  # llama3_8b: grid full at 1 split (4: 11-13% slower)
    ((4, 256), 64, 1536, False, 1),  # short context: 4 splits measured 7% slower
    ((4, 256), 8, 8192, False, 8),
    ((8, 128), 1, 32768, False, 64),
    ((4, 256), 64, 8192, True, 1),  # INT8: 4 splits measured 2-5% slower than 1
    ((4, 64), 64, 8192, True, 2),  # INT8 K: 4 splits measured 30% slower than 2
])
def test_split_heuristic_matches_the_h200_sweep(geo, batch, length, int8, chosen):
    hkv, d = geo
    config = triton.launch_config(int8)
    assert cuda.num_kv_splits(batch, hkv, d, length, 132, config) == chosen


@pytest.mark.parametrize(("geo", "batch", "resident", "chosen"), [
    ((4, 256), 8, 2, 8),  # qwen35, loads to registers: 8 splits measured best (B=8)
    ((8, 128), 8, 3, 4),  # llama3_8b, 2-tile pipeline: 4 (6 within 1%, 8 23% slower)
    ((4, 64), 8, 5, 16),  # tinyllama, 2-tile pipeline: 16 best
    ((8, 128), 64, 3, 3),  # B=64: 512 programs on 396 slots; 3 splits best (1: 31% slower)
    ((4, 256), 64, 2, 1),  # 256 programs, one wave
    ((4, 256), 1, 2, 64),  # B=1, L=8192: capped by the 64 key tiles
])
def test_native_split_rule_fills_one_wave(geo, batch, resident, chosen):
    hkv, d = geo
    config = cuda.LaunchConfig(128, 4, 0, resident=resident)
    assert cuda.num_kv_splits(batch, hkv, d, 8192, 132, config) == chosen


@pytest.mark.parametrize(("programs", "slots", "chosen"), [
    (512, 396, 3),  # 1 split: 2 waves, the second 29% full; 3 splits: 4 waves, 97%
    (512, 264, 1),  # 2 waves, 97% full
    (640, 264, 2),  # 1 split: 81%; 2: 97%
    (256, 264, 1),  # one wave
])
def test_wave_splits_avoid_a_mostly_idle_last_wave(programs, slots, chosen):
    assert cuda.wave_splits(programs, slots) == chosen


@pytest.mark.parametrize(("programs", "slots", "pow2", "chosen"), [
    (64, 396, True, 4),  # llama3_8b B=8 at 3 CTAs per SM: bf16
    (64, 396, False, 6),  # INT8 K: 6 measured 1.7-2.9% faster than 4
    (32, 396, False, 12),  # tinyllama B=8
    (32, 264, False, 8),  # qwen35 B=8: 8 either way
    (4, 264, False, 64),  # qwen35 B=1: not 66, which the combine would pad to 128
    (8, 396, False, 48),  # llama3_8b B=1
])
def test_one_wave_split_count(programs, slots, pow2, chosen):
    assert cuda.wave_splits(programs, slots, pow2=pow2) == chosen


@pytest.mark.parametrize(("kind", "pow2"), [("int8_k", False), ("int8_kv", True),
                                            ("half", True)])
def test_only_int8_k_leaves_powers_of_two_for_its_wave(kind, pow2):
    config = cuda_decode.native_config(kind, 128, 8, 8, torch.device("cuda"))
    assert config.pow2_wave is pow2


PREFILL_CASES = {
    "causal-varlen": dict(q_lens=(5, 1, 17), causal=True),
    "noncausal-varlen-gqa6": dict(q_lens=(3, 9), num_q_heads=12),
    "causal-bool-bias-broadcast": dict(q_lens=(4, 7), causal=True, bias="bool",
                                       bias_shape="per_batch"),
    "float-bias-3d": dict(q_lens=(6, 2), bias="float", bias_shape="3d"),
}


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_multi_token_queries_match_reference(name):
    spec = PREFILL_CASES[name]
    case = gpu_case(seq_lens=[40 + 13 * i for i in range(len(spec["q_lens"]))], head_dim=128,
                    **spec)
    if spec.get("bias") == "bool":
        case.attn_bias[0, 0, 0] = False  # a row with every key masked must give zeros
    ref = case.reference()
    for hints in ({}, dict(max_seq_len=case.longest, max_query_len=case.longest_query)):
        out = run(case, **hints)
        assert numerics.rel_err(out, ref) < tol(case)
    if spec.get("bias") == "bool":
        assert torch.equal(out[0, 0:2].cpu(), torch.zeros_like(out[0, 0:2].cpu()))


INT8_CASES = {
    "k-only-d128-gqa4": dict(seq_lens=lengths(4), num_q_heads=16, num_kv_heads=4,
                             head_dim=128, kind="int8_k"),
    "kv-d64-gqa8-page1": dict(seq_lens=lengths(4, 1), num_q_heads=32, num_kv_heads=4,
                              block_size=1, kind="int8_kv"),
    "kv-d256-gqa6-hnd-long": dict(seq_lens=(3000, 1234), num_q_heads=24, num_kv_heads=4,
                                  head_dim=256, layout="HND", kind="int8_kv"),
    "kv-d128-causal-varlen": dict(seq_lens=lengths(2), q_lens=(6, 3), head_dim=128,
                                  kind="int8_kv", causal=True),
    "k-only-fp16-d64-gqa1": dict(seq_lens=lengths(3), num_q_heads=4, num_kv_heads=4,
                                 kind="int8_k", dtype=f16),
}


@pytest.mark.parametrize("backend", [None, "triton"], ids=["default", "triton"])
@pytest.mark.parametrize("name", list(INT8_CASES))
def test_int8_matches_reference(name, backend):
    case = gpu_case(**INT8_CASES[name])
    out = run(case, backend)
    # Against the exact-integer reference: K-only differs by the bf16 rounding of P; K+V also
    # by quantizing P per row (the int8 P·V).
    assert numerics.rel_err(out, case.reference()) < tol(case)
    assert cosine(out, case.reference(unquantized=True)) > 0.995


# The CUDA C++ decode, for each cache kind (INT8 K+V, INT8 K + 16-bit V, 16-bit K+V): every
# head_dim, GQA 1/4/5/6/8, pages 1/16/256, NHD and HND, int32/int64 indices (mixed too),
# bf16/fp16, B 1 to 64, lengths off the page and the warp tiles, split counts that leave
# some splits and warps without keys, and the balanced grid (splits 0: on these small cases
# the split rule gives it many CTAs per sequence, so most items are cut into pieces).
NATIVE_CASES = {
    "d128-gqa4-b8": dict(seq_lens=lengths(8), num_q_heads=32, num_kv_heads=8, head_dim=128),
    "d64-gqa8-page1": dict(seq_lens=lengths(4, 1), num_q_heads=32, num_kv_heads=4,
                           block_size=1),
    "d256-gqa6-hnd-long": dict(seq_lens=(3000, 1234), num_q_heads=24, num_kv_heads=4,
                               head_dim=256, layout="HND"),
    "d128-gqa5-page256-int64-fp16": dict(seq_lens=lengths(3, 256), num_q_heads=10,
                                         head_dim=128, block_size=256,
                                         index_dtype=torch.int64, dtype=f16),
    "d64-gqa1-b64": dict(seq_lens=lengths(64), num_q_heads=4, num_kv_heads=4),
    "d256-gqa8-b1-short": dict(seq_lens=(7,), num_q_heads=16, head_dim=256),
    "d128-gqa4-lengths": dict(seq_lens=(1, 15, 16, 17, 31, 33, 129), head_dim=128),
}
NATIVE_KINDS = cuda_native.CALL_KINDS


@pytest.mark.parametrize("kind", list(NATIVE_KINDS))
@pytest.mark.parametrize("splits", [None, cuda_decode.BALANCED, 1, 3, 16])
@pytest.mark.parametrize("name", list(NATIVE_CASES))
def test_native_decode_matches_reference(name, splits, kind):
    case = gpu_case(kind=NATIVE_KINDS[kind], **NATIVE_CASES[name])
    plan = {} if splits is None else dict(splits=splits)
    out = run(case, "cuda_decode", max_query_len=1, **plan)
    assert numerics.rel_err(out, case.reference()) < tol(case)
    assert cosine(out, case.reference(unquantized=True)) > 0.995


@pytest.mark.parametrize(("kind", "d"), [
    (kind, d) for kind in cuda_native.KINDS for d in cuda_native.HEAD_DIMS])
def test_native_decode_every_heads_per_cta(kind, d):
    """Every variant the Python table declares is built by the C++ launcher, fits on an SM,
    and is right with every count of KV heads per CTA the launcher builds, in the split grid
    and the balanced one (8 KV heads, a group of 3, sequences that end mid-tile)."""
    device = torch.device("cuda")
    variant = cuda_native.decode_variant(device, kind, d)
    assert variant.resident >= 1 and variant.balanced_resident >= 1
    assert variant.warps % variant.heads == 0
    case = gpu_case(seq_lens=(700, 45, 301), num_q_heads=24, num_kv_heads=8, head_dim=d,
                    kind=NATIVE_KINDS[kind])
    for heads in cuda_native.HEADS_PER_CTA:
        config = cuda_decode.native_config(kind, d, 8, 3, device, heads=heads)
        for splits in (2, cuda_decode.BALANCED):
            out = run(case, "cuda_decode", max_query_len=1, config=config, splits=splits)
            assert numerics.rel_err(out, case.reference()) < tol(case), (heads, splits)


def test_native_decode_rejects_heads_per_cta_that_do_not_divide():
    case = gpu_case(num_q_heads=12, num_kv_heads=6, head_dim=128, kind="int8_kv")
    config = cuda_decode.native_config("int8_kv", 128, 6, 3, torch.device("cuda"), heads=4)
    with pytest.raises(ValueError, match="heads=4: KV heads per CTA must be one of .* and "
                       "divide the 6 KV heads"):
        run(case, "cuda_decode", max_query_len=1, config=config)


def _rising_keys(case: Case, rate: float) -> Case:
    """Adds rate * p * (the group's mean query direction) to the key at position p of each
    sequence of a CPU case (requantized where K is int8): the scores climb along the
    sequence, so the running max moves again and again after the first tile (the kernel's
    lazy rescale)."""
    k_float = case.key_float.clone()
    page, hkv = k_float.shape[1], k_float.shape[2]
    query, table = case.query.float().cpu(), case.block_table.cpu().long()
    for b, n in enumerate(case.seq_lens.tolist()):
        direction = query[b].view(hkv, -1, query.shape[-1]).mean(1)
        direction = direction / direction.norm(dim=-1, keepdim=True)
        pos = torch.arange(n)
        k_float[table[b, pos // page], pos % page] += rate * pos[:, None, None] * direction
    if case.key_scale is None:
        return case.with_(key_cache=k_float.to(case.query.dtype), key_float=k_float)
    key, k_scale = quantized(k_float)
    return case.with_(key_cache=key, key_scale=k_scale, key_float=k_float)


@pytest.mark.parametrize("kind", list(NATIVE_KINDS))
@pytest.mark.parametrize("splits", [cuda_decode.BALANCED, 1, 3])
def test_native_decode_rising_scores(splits, kind):
    case = gpu_case(seq_lens=(900, 613), head_dim=128, kind=NATIVE_KINDS[kind])
    case = _rising_keys(case.to("cpu"), rate=0.1).to("cuda")
    out = run(case, "cuda_decode", max_query_len=1, splits=splits)
    assert numerics.rel_err(out, case.reference()) < tol(case)


def test_native_decode_mixed_index_dtypes():
    case = gpu_case(seq_lens=lengths(3), kind="int8_kv")
    case = case.with_(seq_lens=case.seq_lens.long())  # table and starts stay int32
    out = run(case, "cuda_decode", max_query_len=1)
    assert numerics.rel_err(out, case.reference()) < tol(case)


def test_native_half_decode_copies_a_query_it_cannot_read_in_place():
    """The 16-bit kind reads the query itself, so rows must be head-contiguous and 16-byte
    aligned; a strided query is copied first (and the result is the same)."""
    case = gpu_case(seq_lens=(300, 45, 129), head_dim=128, strided_query=True)
    assert not cuda_native.aligned_rows(case.query)
    out = run(case, "cuda_decode", max_query_len=1)
    assert numerics.rel_err(out, case.reference()) < tol(case)


def test_native_decode_is_built_and_chosen(monkeypatch):
    """On a GPU machine setup.py builds the CUDA C++ library and a decode call of each kind
    qualifies for it; calls that cannot take it say why (they run another kernel: with more
    than 8 query tokens, the mixed batch's decode rows and prefill kernel)."""
    assert cuda_native.decode_available(torch.device("cuda")), \
        "pagedfuse._cuda_kernels is not built (pip install -e . with nvcc on PATH)"
    decode = get_backend("cuda_decode")

    def why(max_query_len=1, **spec) -> str | None:
        call = gpu_case(**spec).call(max_query_len=max_query_len, capability=False)
        return reason(decode, call)

    assert why(kind="int8_kv") is None
    assert why(kind="int8_k") is None  # INT8 K + bf16 V
    assert why() is None  # bf16 K and V
    assert why(9, kind="int8_kv") == "more than 8 query tokens per sequence"
    assert why(bias="float", bias_shape="3d") == "attn_bias"
    assert why(dtype=f32) == "query dtype torch.float32 (bfloat16 or float16 only)"
    assert why(num_q_heads=32, num_kv_heads=2) == "16 query heads per KV head (at most 8)"
    assert why(head_dim=96) == "head_dim 96 not in {64, 128, 256}"
    case = gpu_case(seq_lens=(50, 70), q_lens=(20, 1), kind="int8_kv")
    assert choose(case.call()).name == "mixed_batch"
    monkeypatch.setenv("PAGEDFUSE_BACKEND", "cuda_decode")
    with pytest.raises(ValueError, match="cuda_decode cannot run this call: more than 8 "
                                         "query tokens per sequence"):
        case.run_op()


# Short queries on the CUDA C++ decode: 2 to 8 query tokens per sequence as the MMAs'
# columns (cuda_native.Columns), varlen with one-token sequences among them, histories of 0,
# 1 and ~1000 keys past the query, every head_dim, GQA 1/4/6/8, pages 1/16/256, a window
# and a soft cap, bottom-right causal and not causal. Each runs with the plan's columns (one
# n-tile where they fit, else two or column groups) and with one n-tile per warp and as many
# column groups as that takes, each with every count of KV heads per CTA built for it, over 1
# and 3 splits.
SHORT_CASES = {
    "d128-gqa4-q4": dict(seq_lens=(1004, 5, 4, 70), q_lens=(4, 4, 4, 1), num_q_heads=32,
                         num_kv_heads=8, head_dim=128),
    "d64-gqa8-page1-varlen": dict(seq_lens=(8, 3, 1001, 40), q_lens=(8, 2, 5, 1),
                                  num_q_heads=32, num_kv_heads=4, block_size=1),
    "d256-gqa6-hnd": dict(seq_lens=(1003, 9), q_lens=(3, 4), num_q_heads=24, num_kv_heads=4,
                          head_dim=256, layout="HND"),
    "d128-gqa1-page256-fp16": dict(seq_lens=(520, 2), q_lens=(8, 2), num_q_heads=4,
                                   num_kv_heads=4, head_dim=128, block_size=256, dtype=f16),
    "d64-gqa4-window-softcap": dict(seq_lens=(300, 61, 7), q_lens=(6, 3, 7), num_q_heads=16,
                                    num_kv_heads=4, window_left=40, softcap=30.0),
    "d128-gqa4-not-causal": dict(seq_lens=(500, 6), q_lens=(4, 3), num_q_heads=16,
                                 num_kv_heads=4, head_dim=128, causal=False),
}


def _one_tile_columns(call) -> cuda_native.Columns:
    """One n-tile per warp, and a column group per 8 columns."""
    return cuda_native.columns_for(call.query_bound, call.geometry.group, 1)


@pytest.mark.parametrize("kind", list(NATIVE_KINDS))
@pytest.mark.parametrize("name", list(SHORT_CASES))
def test_native_decode_serves_short_queries(name, kind):
    case = gpu_case(**{"causal": True, **SHORT_CASES[name]}, kind=NATIVE_KINDS[kind])
    ref = case.reference()
    call = case.call(case.longest, case.longest_query)
    plan = cuda_decode.make_plan(call)
    assert plan.columns.max_query == case.longest_query
    tiled = {plan.columns, _one_tile_columns(call)}
    g, device = call.geometry, call.device
    for columns in tiled:
        variant = cuda_native.decode_variant(device, kind, g.head_dim, columns.tiles)
        for heads in cuda_native.heads_counts(variant, g.num_kv_heads):
            config = cuda_decode.native_config(kind, g.head_dim, g.num_kv_heads, g.batch,
                                               device, heads=heads, tiles=columns.tiles)
            for splits in (1, 3):
                out = run(case, "cuda_decode", case.longest, case.longest_query, splits=splits,
                          columns=columns, config=config)
                assert numerics.rel_err(out, ref) < tol(case), (columns, heads, splits)


def test_short_queries_reject_more_heads_per_cta_than_built():
    """A short-query kernel's KV heads per CTA stop at its Traits' count (1 at head_dim 64):
    asking for more is a ValueError naming heads, not a launch error."""
    case = gpu_case(seq_lens=(90, 40), q_lens=(2, 2), num_q_heads=16, num_kv_heads=4,
                    causal=True)
    call = case.call(max_query_len=2)
    columns = cuda_decode.make_plan(call).columns
    assert cuda_native.decode_variant(call.device, "half", 64, columns.tiles).heads == 1
    config = cuda_decode.native_config("half", 64, 4, 2, call.device, heads=2,
                                       tiles=columns.tiles)
    with pytest.raises(ValueError, match="heads=2: the short-query kernels at head_dim 64 "
                       "serve at most 1 KV heads per CTA"):
        run(case, "cuda_decode", max_query_len=2, config=config)


def test_short_queries_take_the_columns_built():
    """tinyllama's group of 8: q_len 2 in two n-tiles, which the op takes, q_len 4 in two
    groups of two, which it leaves to the prefill kernels; qwen35's 6 at 256: 24 columns in
    three column groups of one n-tile."""
    device = torch.device("cuda")
    assert cuda_native.decode_variant(device, "int8_kv", 64).max_column_tiles == 2
    assert cuda_native.decode_variant(device, "half", 256).max_column_tiles == 1
    for q_len, columns, taken in ((2, (2, 2, 1), True), (4, (4, 2, 2), False)):
        tiny = gpu_case(seq_lens=(90,) * 2, q_lens=(q_len,) * 2, num_q_heads=32,
                        num_kv_heads=4, causal=True, kind="int8_kv").call(max_query_len=q_len)
        assert cuda_decode.make_plan(tiny).columns == cuda_native.Columns(*columns)
        assert (choose(tiny).name == "cuda_decode") is taken
    qwen = gpu_case(seq_lens=(90,) * 2, q_lens=(4, 4), num_q_heads=24, num_kv_heads=4,
                    head_dim=256, causal=True).call(max_query_len=4)
    assert cuda_decode.make_plan(qwen).columns == cuda_native.Columns(4, 1, 3)
    assert cuda_decode.defers(qwen).startswith("4 query tokens x 6 query heads take 3 column")


def test_short_queries_replay_in_a_cuda_graph():
    """The op's own choice (two n-tiles, one group): 100 replays equal the eager call, and a
    new query is seen."""
    case = gpu_case(seq_lens=(2000, 300, 17), q_lens=(2, 2, 2), num_q_heads=32,
                    num_kv_heads=4, causal=True, kind="int8_kv")
    assert choose(case.call(max_query_len=2)).name == "cuda_decode"
    eager = case.run_op(max_query_len=2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = case.run_op(max_query_len=2)
    assert all(torch.equal(o, eager) for o in replayed(graph, captured, 100))
    case.query.copy_(torch.randn_like(case.query))
    graph.replay()
    assert numerics.rel_err(captured, case.reference()) < tol(case)


def _record_launches(monkeypatch, what) -> list:
    """Calls of cuda_native.decode_into from here on, each recorded as what(kwargs)."""
    launches = []
    launch = cuda_native.decode_into
    monkeypatch.setattr(cuda_native, "decode_into",
                        lambda *args, **kw: launches.append(what(kw)) or launch(*args, **kw))
    return launches


@pytest.mark.parametrize("kind", list(NATIVE_KINDS))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_default_path_takes_the_native_decode(kind, d, monkeypatch):
    """A q_len 1 call with no choice made takes the CUDA C++ decode, once, and is right."""
    launches = _record_launches(monkeypatch, lambda kw: 1)
    case = gpu_case(seq_lens=lengths(2), head_dim=d, kind=NATIVE_KINDS[kind])
    out = case.run_op(max_query_len=1)
    assert len(launches) == 1
    assert numerics.rel_err(out, case.reference()) < tol(case)


@pytest.mark.parametrize("kind", list(NATIVE_KINDS))
@pytest.mark.parametrize("splits", [cuda_decode.BALANCED, 1, 3])
def test_dependent_launch_changes_no_bit(kind, splits, monkeypatch):
    """Programmatic dependent launch (sm_90) equals the plain launch bit for bit, with a new
    query on every call: a decode that read the query before quantize_int8 had written it,
    or a combine that read before the decode had finished, would show here."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    launches = _record_launches(monkeypatch, lambda kw: kw["pdl"])
    case = gpu_case(seq_lens=(3000, 10, 700, 1500), num_q_heads=32, num_kv_heads=8,
                    head_dim=128, kind=NATIVE_KINDS[kind])
    for _ in range(20):
        case.query.normal_()
        outs = []
        for pdl in ("1", "0"):
            monkeypatch.setenv("PAGEDFUSE_PDL", pdl)
            outs.append(run(case, "cuda_decode", max_query_len=1, splits=splits))
        assert torch.equal(*outs)
    assert numerics.rel_err(outs[0], case.reference()) < tol(case)
    first = cuda_native.PDL_WAIT_FIRST if kind == "half" else cuda_native.PDL_AFTER_QUANTIZE
    assert launches == [first, cuda_native.PDL_OFF] * 20


def _balanced_counts() -> torch.Tensor:
    """The balanced grid's arrival counts of the current stream."""
    stream = torch.cuda.current_stream().cuda_stream
    return cuda_native._counters[torch.cuda.current_device(), stream]


@pytest.mark.parametrize("kind", list(NATIVE_KINDS))
def test_balanced_grid_merges_in_a_fixed_order_and_leaves_its_counts_at_zero(kind):
    """Sequence 1 has no query token (its items have no steps), sequence 3 is one page; the
    others are cut into pieces across CTAs. Every call gives the same bits whichever CTA
    merged, and leaves every count at zero for the next launch."""
    case = gpu_case(seq_lens=(3000, 10, 700, 16, 1500), q_lens=(1, 0, 1, 1, 1),
                    num_q_heads=32, num_kv_heads=8, head_dim=128, kind=NATIVE_KINDS[kind])
    outs = [run(case, "cuda_decode", max_query_len=1, splits=cuda_decode.BALANCED)
            for _ in range(10)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert numerics.rel_err(outs[0], case.reference()) < tol(case)
    assert not _balanced_counts().any()


def test_balanced_grid_replays_in_a_cuda_graph():
    """A graph captured on a stream with no counts yet records their zeroing; its replays
    equal the eager call bit for bit, see new inputs, and leave the counts at zero; an eager
    call on that stream afterwards zeroes them first."""
    case = gpu_case(seq_lens=(3000, 10, 700, 1500), num_q_heads=32, num_kv_heads=8,
                    head_dim=128, kind="int8_kv")
    call = lambda: run(case, "cuda_decode", max_query_len=1,  # noqa: E731
                       splits=cuda_decode.BALANCED)
    eager = call()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = call()
    outs = replayed(graph, captured, 20)
    assert all(torch.equal(o, eager) for o in outs)
    case.query.copy_(torch.randn_like(case.query))
    graph.replay()
    assert numerics.rel_err(captured, case.reference()) < tol(case)
    with torch.cuda.stream(stream):
        assert torch.equal(call(), captured)
        torch.cuda.synchronize()
        assert not _balanced_counts().any()


@pytest.mark.parametrize("kind", list(NATIVE_KINDS))
def test_balanced_grid_with_more_ctas_than_steps(kind):
    """600 CTAs per head group for 23-84 key steps: most CTAs have no share, and sequence
    0's item is cut into a piece per CTA that one CTA merges."""
    case = gpu_case(seq_lens=(3000, 10, 700, 16, 1500), num_q_heads=32, num_kv_heads=8,
                    head_dim=128, kind=NATIVE_KINDS[kind])
    call = case.call(max_query_len=1)
    plan = cuda_decode.make_plan(call, splits=cuda_decode.BALANCED)
    plan = plan._replace(ctas=600 * 8 // plan.config.heads)
    out = case.run_backend(get_backend("cuda_decode"), plan, max_query_len=1)
    assert numerics.rel_err(out, case.reference()) < tol(case)
    assert not _balanced_counts().any()


@pytest.mark.parametrize(("batch", "balanced_resident", "ctas"), [
    (64, 1, 128),  # one CTA per (sequence, head group): each share is one whole item
    (8, 1, 128),   # 8 splits per item fill the 132 SMs' one wave
    (8, 2, 256),   # the same at two CTAs per SM
    (512, 1, 1024),  # more items than slots: one CTA each, over several waves
])
def test_balanced_grid_takes_the_split_grids_cta_count(batch, balanced_resident, ctas):
    """With equal lengths each CTA's share is then one split's chunk (llama3_8b's INT8 K+V
    variant: 8 KV heads, 4 per CTA, 64 keys per CTA step)."""
    variant = cuda_native.Variant(resident=1, warps=8, tile=32, heads=4,
                                  balanced_resident=balanced_resident)
    config = cuda.LaunchConfig(64, 8, 1, resident=4, heads=4)
    assert cuda_decode.balanced_ctas(config, variant, batch, 8, 128, 8192, 132) == ctas


def test_pagedfuse_balanced_makes_the_default_path_take_the_balanced_grid(monkeypatch):
    grids = _record_launches(monkeypatch, lambda kw: kw["ctas"])
    case = gpu_case(seq_lens=(3000, 10, 700, 16, 1500), num_q_heads=32, num_kv_heads=8,
                    head_dim=128, kind="int8_kv")
    split = case.run_op(max_query_len=1)
    monkeypatch.setenv("PAGEDFUSE_BALANCED", "1")
    balanced = case.run_op(max_query_len=1)
    assert grids[0] == 0 and grids[1] > 0
    assert numerics.rel_err(balanced, case.reference()) < tol(case)
    assert numerics.rel_err(balanced, split) < 1e-2


def test_balanced_grid_is_the_plans_choice_up_to_its_batch_limit():
    device = torch.device("cuda")
    config = cuda_decode.native_config("int8_kv", 128, 8, 64, device, balanced=True)
    plan = lambda batch, config: cuda_decode.launch_plan(  # noqa: E731
        "int8_kv", 8, 128, batch, 8192, device, config, None, False)
    assert plan(64, config).splits == cuda_decode.BALANCED
    assert plan(cuda_native.BALANCED_MAX_BATCH + 1, config).splits >= 1
    assert plan(64, config._replace(balanced=False)).splits >= 1
    call = gpu_case(head_dim=128).call(max_query_len=1)
    with pytest.raises(ValueError, match="splits=0: the Triton kernel takes 1 or more"):
        triton.make_plan(call, splits=cuda_decode.BALANCED)


def test_ops_route_to_the_cuda_kernels():
    for kind in KINDS:
        case = gpu_case(seq_lens=lengths(2), kind=kind)
        out = case.run_op()
        assert out.is_cuda and numerics.rel_err(out, case.reference()) < tol(case)


def test_quantize_int8_is_bit_exact():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(33, 7, 128, generator=gen) * 4
    x[0, 0] = 0.0  # all-zero row: scale 0, zeros out
    x[1, 0, :4] = torch.tensor([127.0, 0.5, 2.5, -1.5])  # scale 1: exact ties round to even
    for dtype in (torch.float32, torch.bfloat16):
        q, s = torch.ops.pagedfuse.quantize_int8(x.to(dtype).cuda())
        q_ref, s_ref = quantize_int8_reference(x.to(dtype))
        assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)


@pytest.mark.parametrize("backend", ["cuda_decode", "triton"])
@pytest.mark.parametrize("kind", KINDS)
def test_out_of_range_block_ids_are_clamped(kind, backend):
    """Unchecked bad ids must not read outside the cache (compute-sanitizer checks the
    reads in gpu_check.sh; here: no fault, every element written)."""
    case = gpu_case(seq_lens=lengths(2), kind=kind)
    case.block_table[0, 0] = 10**6
    case.block_table[1, 0] = -5
    out = run(case, backend, max_query_len=1)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_replays_are_identical(kind):
    case = gpu_case(seq_lens=(3000, 10, 700, 1500), num_q_heads=32, num_kv_heads=8,
                    head_dim=128, kind=kind)
    call = lambda: case.run_op(max_seq_len=3000, max_query_len=1)  # noqa: E731
    eager = call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    outs = replayed(graph, captured, 100)
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0], eager)
    case.query.copy_(torch.randn_like(case.query))  # replays must see new inputs
    graph.replay()
    assert numerics.rel_err(captured, case.reference()) < tol(case)

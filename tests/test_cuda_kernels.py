"""GPU tests of the CUDA kernels (pagedfuse/ops/cuda.py: Triton, and the CUDA C++ decode
of csrc/cuda) against the float64 reference.

Each case is one kernel specialisation (every new constexpr combination compiles), so the
grid is a hand-picked list that covers each axis (head_dim, GQA ratio, page size, layout,
dtype, index dtype, batch, q_len > 1, causal, attn_bias, split-KV) rather than a product.
Outputs are NaN-poisoned before every call.
"""

from __future__ import annotations

import math

import numerics
import pytest
import torch

from pagedfuse.ops import cuda_native
from pagedfuse.ops.reference import paged_attention_reference, quantize_int8_reference

pytestmark = pytest.mark.cuda

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def _cache(shape, hnd: bool, gen: torch.Generator) -> torch.Tensor:
    """Fresh normal data [nb, bs, Hkv, D] (an HND storage passed as its transposed view)."""
    nb, bs, hkv, d = shape
    x = torch.randn((nb, hkv, bs, d) if hnd else shape, generator=gen)
    return x.transpose(1, 2) if hnd else x


def _quantized(x: torch.Tensor, hnd: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-head int8 of a float cache view; scales laid out like the cache."""
    if hnd:
        q, s = quantize_int8_reference(x.transpose(1, 2))
        return q.transpose(1, 2), s.transpose(1, 2)
    return quantize_int8_reference(x)


def make_case(batch=2, hq=8, hkv=2, d=64, page=16, dtype=torch.bfloat16, hnd=False,
              q_lens=None, seq_lens=None, kv_int8: str | None = None, index=torch.int32,
              causal=False, bias=None, seed=0, device="cuda") -> dict:
    """Inputs for one call, with random block permutations and the unquantized caches."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = q_lens or [1] * batch
    if seq_lens is None:
        seq_lens = torch.randint(1, 4 * page + 40, (batch,), generator=gen).tolist()
    seq_lens = [max(s, q) for s, q in zip(seq_lens, q_lens, strict=True)]
    max_blocks = max(math.ceil(s / page) for s in seq_lens) + 1
    num_blocks = batch * max_blocks + 3
    table = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks]
    shape = (num_blocks, page, hkv, d)
    k_float, v_float = _cache(shape, hnd, gen), _cache(shape, hnd, gen)
    key, value, k_scale, v_scale = k_float.to(dtype), v_float.to(dtype), None, None
    if kv_int8:
        key, k_scale = _quantized(k_float, hnd)
    if kv_int8 == "kv":
        value, v_scale = _quantized(v_float, hnd)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    args = dict(
        query=torch.randn(starts[-1], hq, d, generator=gen).to(dtype),
        key_cache=key, value_cache=value, key_scale=k_scale, value_scale=v_scale,
        block_table=table.reshape(batch, max_blocks).to(index),
        seq_lens=torch.tensor(seq_lens, dtype=index),
        query_start_loc=torch.tensor(starts, dtype=index),
        scale=1.0 / math.sqrt(d), causal=causal, attn_bias=bias,
    )
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    moved["unquantized"] = (k_float, v_float)
    return moved


def run_kernel(case: dict, max_seq_len=None, max_query_len=None, splits=None,
               native=None, config=None) -> torch.Tensor:
    """paged_attention_into on a NaN-poisoned output (``native``, ``config``: see
    paged_attention_into)."""
    from pagedfuse.ops import cuda

    out = torch.full_like(case["query"], float("nan"))
    cuda.paged_attention_into(
        out, case["query"], case["key_cache"], case["value_cache"], case["key_scale"],
        case["value_scale"], case["block_table"], case["seq_lens"], case["query_start_loc"],
        case["scale"], case["causal"], case["attn_bias"], max_seq_len, max_query_len,
        config=config, splits=splits, native=native)
    return out


def reference(case: dict, unquantized: bool = False) -> torch.Tensor:
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    key, value, k_scale, v_scale = (cpu["key_cache"], cpu["value_cache"], cpu["key_scale"],
                                    cpu["value_scale"])
    if unquantized:
        key, value = (x.to(cpu["query"].dtype) for x in cpu["unquantized"])
        k_scale = v_scale = None
    return paged_attention_reference(
        cpu["query"], key, value, cpu["block_table"], cpu["seq_lens"],
        cpu["query_start_loc"], cpu["scale"], cpu["causal"], cpu["attn_bias"], k_scale,
        v_scale, compute_dtype=torch.float64)


def replayed(graph: torch.cuda.CUDAGraph, out: torch.Tensor, n: int) -> list[torch.Tensor]:
    """A copy of the captured output ``out`` after each of ``n`` replays of ``graph``."""
    outs = []
    for _ in range(n):
        graph.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    return outs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "an output element was not written"
    return numerics.rel_err(out, ref)


def cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(
        out.cpu().double().flatten(), ref.double().flatten(), dim=0))


FLOAT_CASES = {
    "d64-gqa1-page16-b1": dict(batch=1, hq=8, hkv=8, d=64),
    "d128-gqa4-hnd-int64-b8": dict(batch=8, hq=32, hkv=8, d=128, hnd=True, index=torch.int64),
    "d256-gqa6-b3": dict(batch=3, hq=24, hkv=4, d=256),
    "d128-gqa5-page1-fp16": dict(batch=4, hq=10, hkv=2, d=128, page=1, dtype=torch.float16),
    "d64-gqa8-page256-hnd-b64": dict(batch=64, hq=32, hkv=4, d=64, page=256, hnd=True),
    "d128-gqa4-fp32": dict(batch=2, hq=8, hkv=2, d=128, dtype=torch.float32),
    "d256-gqa8-long-splits": dict(batch=2, hq=16, hkv=2, d=256, seq_lens=[5000, 2777]),
}


@pytest.mark.parametrize("name", list(FLOAT_CASES))
def test_decode_matches_reference(name):
    case = make_case(**FLOAT_CASES[name])
    ref = reference(case)
    assert rel_err(run_kernel(case), ref) < TOL[case["query"].dtype]
    longest = int(case["seq_lens"].max())
    hinted = run_kernel(case, max_seq_len=longest, max_query_len=1)
    assert rel_err(hinted, ref) < TOL[case["query"].dtype]


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_count_does_not_change_the_result(splits):
    case = make_case(batch=3, hq=16, hkv=4, d=128, seq_lens=[900, 17, 3000])
    assert rel_err(run_kernel(case, splits=splits), reference(case)) < 2e-2


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
    from pagedfuse.ops import cuda

    hkv, d = geo
    assert cuda.num_kv_splits(batch, hkv, d, length, 132, cuda.launch_config(int8)) == chosen


@pytest.mark.parametrize(("geo", "batch", "resident", "chosen"), [
    ((4, 256), 8, 2, 8),  # qwen35, loads to registers: 8 splits measured best (B=8)
    ((8, 128), 8, 3, 4),  # llama3_8b, 2-tile pipeline: 4 (6 within 1%, 8 23% slower)
    ((4, 64), 8, 5, 16),  # tinyllama, 2-tile pipeline: 16 best
    ((8, 128), 64, 3, 3),  # B=64: 512 programs on 396 slots; 3 splits best (1: 31% slower)
    ((4, 256), 64, 2, 1),  # 256 programs, one wave
    ((4, 256), 1, 2, 64),  # B=1, L=8192: capped by the 64 key tiles
])
def test_native_split_rule_fills_one_wave(geo, batch, resident, chosen):
    from pagedfuse.ops import cuda

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
    from pagedfuse.ops import cuda

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
    from pagedfuse.ops import cuda

    assert cuda.wave_splits(programs, slots, pow2=pow2) == chosen


@pytest.mark.parametrize(("kind", "pow2"), [("int8_k", False), ("int8_kv", True),
                                            ("half", True)])
def test_only_int8_k_leaves_powers_of_two_for_its_wave(kind, pow2):
    from pagedfuse.ops import cuda

    assert cuda.native_config(kind, 128, 8, 8, torch.device("cuda")).pow2_wave is pow2


PREFILL_CASES = {
    "causal-varlen": dict(q_lens=[5, 1, 17], causal=True),
    "noncausal-varlen-gqa6": dict(q_lens=[3, 9], hq=12, hkv=2),
    "causal-bool-bias-broadcast": dict(q_lens=[4, 7], causal=True, bias="bool"),
    "float-bias-3d": dict(q_lens=[6, 2], bias="float"),
}


def _bias(kind: str, batch: int, hq: int, q_lens: list[int], seq_lens: list[int]):
    gen = torch.Generator().manual_seed(1)
    rows, cols = max(q_lens), max(seq_lens)
    if kind == "bool":
        mask = torch.rand(batch, 1, rows, cols, generator=gen) > 0.3
        mask[0, 0, 0] = False  # a row with every key masked must give zeros
        return mask.cuda()
    return torch.randn(hq, rows, cols, generator=gen).cuda()  # 3-d: broadcast over batch


@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_multi_token_queries_match_reference(name):
    spec = {"batch": len(PREFILL_CASES[name]["q_lens"]), "hq": 8, "hkv": 2, "d": 128,
            **PREFILL_CASES[name]}
    seq_lens = [40 + 13 * i for i in range(spec["batch"])]
    if "bias" in spec:
        spec["bias"] = _bias(spec["bias"], spec["batch"], spec["hq"], spec["q_lens"], seq_lens)
    case = make_case(seq_lens=seq_lens, **spec)
    ref = reference(case)
    for hints in ({}, dict(max_seq_len=max(seq_lens), max_query_len=max(spec["q_lens"]))):
        out = run_kernel(case, **hints)
        assert rel_err(out, ref) < TOL[torch.bfloat16]
    if spec.get("bias") is not None and spec["bias"].dtype == torch.bool:
        assert torch.equal(out[0, 0:2].cpu(), torch.zeros_like(out[0, 0:2].cpu()))


INT8_CASES = {
    "k-only-d128-gqa4": dict(batch=4, hq=16, hkv=4, d=128, kv_int8="k"),
    "kv-d64-gqa8-page1": dict(batch=4, hq=32, hkv=4, d=64, page=1, kv_int8="kv"),
    "kv-d256-gqa6-hnd-long": dict(batch=2, hq=24, hkv=4, d=256, hnd=True, kv_int8="kv",
                                  seq_lens=[3000, 1234]),
    "kv-d128-causal-varlen": dict(batch=2, hq=8, hkv=2, d=128, kv_int8="kv", q_lens=[6, 3],
                                  causal=True),
    "k-only-fp16-d64-gqa1": dict(batch=3, hq=4, hkv=4, d=64, kv_int8="k", dtype=torch.float16),
}


@pytest.mark.parametrize("native", [None, False], ids=["default", "triton"])
@pytest.mark.parametrize("name", list(INT8_CASES))
def test_int8_matches_reference(name, native):
    case = make_case(**INT8_CASES[name])
    out = run_kernel(case, native=native)
    # Against the exact-integer reference: K-only differs by the bf16 rounding of P; K+V also
    # by quantizing P per row (the int8 P·V).
    assert rel_err(out, reference(case)) < (2e-2 if case["value_scale"] is None else 3e-2)
    assert cosine(out, reference(case, unquantized=True)) > 0.995


# The CUDA C++ decode, for each cache kind (INT8 K+V, INT8 K + 16-bit V, 16-bit K+V): every
# head_dim, GQA 1/4/5/6/8, pages 1/16/256, NHD and HND, int32/int64 indices (mixed too),
# bf16/fp16, B 1 to 64, lengths off the page and the warp tiles, split counts that leave
# some splits and warps without keys, and the balanced grid (splits 0: on these small cases
# the split rule gives it many CTAs per sequence, so most items are cut into pieces).
NATIVE_CASES = {
    "d128-gqa4-b8": dict(batch=8, hq=32, hkv=8, d=128),
    "d64-gqa8-page1": dict(batch=4, hq=32, hkv=4, d=64, page=1),
    "d256-gqa6-hnd-long": dict(batch=2, hq=24, hkv=4, d=256, hnd=True, seq_lens=[3000, 1234]),
    "d128-gqa5-page256-int64-fp16": dict(batch=3, hq=10, hkv=2, d=128, page=256,
                                         index=torch.int64, dtype=torch.float16),
    "d64-gqa1-b64": dict(batch=64, hq=4, hkv=4, d=64),
    "d256-gqa8-b1-short": dict(batch=1, hq=16, hkv=2, d=256, seq_lens=[7]),
    "d128-gqa4-lengths": dict(batch=7, hq=8, hkv=2, d=128,
                              seq_lens=[1, 15, 16, 17, 31, 33, 129]),
}
KINDS = {"int8_kv": "kv", "int8_k": "k", "half": None}  # cuda_native kind -> make_case's


def _native_tol(case: dict) -> float:
    """INT8 K+V also quantizes P per row (the int8 P·V); the rest round P to 16 bits."""
    return 3e-2 if case["value_scale"] is not None else TOL[case["query"].dtype]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("splits", [None, 0, 1, 3, 16])
@pytest.mark.parametrize("name", list(NATIVE_CASES))
def test_native_decode_matches_reference(name, splits, kind):
    case = make_case(kv_int8=KINDS[kind], **NATIVE_CASES[name])
    out = run_kernel(case, max_query_len=1, splits=splits, native=True)
    assert rel_err(out, reference(case)) < _native_tol(case)
    assert cosine(out, reference(case, unquantized=True)) > 0.995


@pytest.mark.parametrize(("kind", "d"), [
    (kind, d) for kind in cuda_native.KINDS for d in cuda_native.HEAD_DIMS])
def test_native_decode_every_heads_per_cta(kind, d):
    """Every variant the Python table declares is built by the C++ launcher, fits on an SM,
    and is right with every count of KV heads per CTA the launcher builds, in the split grid
    and the balanced one (8 KV heads, a group of 3, sequences that end mid-tile)."""
    from pagedfuse.ops import cuda

    device = torch.device("cuda")
    variant = cuda_native.decode_variant(device, kind, d)
    assert variant.resident >= 1 and variant.balanced_resident >= 1
    assert variant.warps % variant.heads == 0
    case = make_case(batch=3, hq=24, hkv=8, d=d, kv_int8=KINDS[kind], seq_lens=[700, 45, 301])
    for heads in cuda_native.HEADS_PER_CTA:
        config = cuda.native_config(kind, d, 8, 3, device, heads=heads)
        for splits in (2, cuda.BALANCED):
            out = run_kernel(case, max_query_len=1, splits=splits, native=True, config=config)
            assert rel_err(out, reference(case)) < _native_tol(case), (heads, splits)


def test_native_decode_rejects_heads_per_cta_that_do_not_divide():
    from pagedfuse.ops import cuda

    case = make_case(batch=2, hq=12, hkv=6, d=128, kv_int8="kv")
    config = cuda.native_config("int8_kv", 128, 6, 2, torch.device("cuda"), heads=4)
    with pytest.raises(ValueError, match="heads=4: KV heads per CTA must be one of .* and "
                       "divide the 6 KV heads"):
        run_kernel(case, max_query_len=1, native=True, config=config)


def _rising_keys(case: dict, rate: float) -> None:
    """Adds rate * p * (the group's mean query direction) to the key at position p of each
    sequence (requantized where K is int8): the scores climb along the sequence, so the
    running max moves again and again after the first tile (the kernel's lazy rescale)."""
    k_float = case["unquantized"][0]
    page, hkv = k_float.shape[1], k_float.shape[2]
    query, table = case["query"].float().cpu(), case["block_table"].cpu().long()
    for b, n in enumerate(case["seq_lens"].tolist()):
        direction = query[b].view(hkv, -1, query.shape[-1]).mean(1)
        direction = direction / direction.norm(dim=-1, keepdim=True)
        pos = torch.arange(n)
        k_float[table[b, pos // page], pos % page] += rate * pos[:, None, None] * direction
    if case["key_scale"] is None:
        case["key_cache"] = k_float.to(case["query"].dtype).cuda()
    else:
        key, k_scale = quantize_int8_reference(k_float)
        case["key_cache"], case["key_scale"] = key.cuda(), k_scale.cuda()


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_native_decode_rising_scores(splits, kind):
    case = make_case(batch=2, hq=8, hkv=2, d=128, kv_int8=KINDS[kind], seq_lens=[900, 613])
    _rising_keys(case, rate=0.1)
    out = run_kernel(case, max_query_len=1, splits=splits, native=True)
    assert rel_err(out, reference(case)) < _native_tol(case)


def test_native_decode_mixed_index_dtypes():
    case = make_case(batch=3, hq=8, hkv=2, d=64, kv_int8="kv")
    case["seq_lens"] = case["seq_lens"].long()  # table and starts stay int32
    assert rel_err(run_kernel(case, max_query_len=1, native=True), reference(case)) < 3e-2


def test_native_half_decode_copies_a_query_it_cannot_read_in_place():
    """The 16-bit kind reads the query itself, so rows must be head-contiguous and 16-byte
    aligned; a strided or offset query is copied first (and the result is the same)."""
    case = make_case(batch=3, hq=8, hkv=2, d=128, seq_lens=[300, 45, 129])
    ref = reference(case)
    wide = torch.zeros(3, 8, 136, device="cuda", dtype=torch.bfloat16)
    wide[..., 1:129] = case["query"]
    case["query"] = wide[..., 1:129]  # 2-byte offset, row stride 136
    assert not cuda_native.aligned_rows(case["query"])
    assert rel_err(run_kernel(case, max_query_len=1, native=True), ref) < TOL[torch.bfloat16]


def test_native_decode_is_built_and_chosen():
    """On a GPU machine setup.py builds the CUDA C++ library and a decode call of each kind
    qualifies for it; calls that cannot take it say why (they run the Triton kernel)."""
    from pagedfuse.ops import cuda

    assert cuda_native.decode_available(torch.device("cuda")), \
        "pagedfuse._cuda_kernels is not built (pip install -e . with nvcc on PATH)"
    case = make_case(batch=2, hq=8, hkv=2, d=128, kv_int8="kv")
    q, k, v = case["query"], case["key_cache"], case["value_cache"]
    scales = case["key_scale"], case["value_scale"], case["block_table"]

    def reason(q, k, v, max_query_len=1, bias=None):
        return cuda.native_reason(q, k, v, *scales, bias, max_query_len)

    assert reason(q, k, v) is None
    assert reason(q, k, v, 4) == "more than one query token per sequence"
    assert reason(q, k, v, bias=torch.zeros(1, device="cuda")) == "attn_bias"
    assert reason(q, k, v.to(torch.bfloat16)) is None  # INT8 K + bf16 V
    assert reason(q, q.new_empty(k.shape), q.new_empty(k.shape)) is None  # bf16 K and V
    assert reason(q.float(), k, v) == "query dtype torch.float32 (bfloat16 or float16 only)"
    wide = torch.empty(1, 16, 1, 128, device="cuda", dtype=torch.int8)
    q16 = torch.empty(1, 16, 128, device="cuda", dtype=torch.bfloat16)
    assert "query heads per KV head" in reason(q16, wide, wide)
    odd = torch.empty(1, 16, 2, 136, device="cuda", dtype=torch.int8)[..., :128]
    assert reason(q, odd, odd) == "cache rows not 16-byte aligned"
    with pytest.raises(ValueError, match="more than one query token"):
        run_kernel(make_case(batch=2, q_lens=[2, 1], kv_int8="kv"), native=True)


def _record_launches(monkeypatch, what) -> list:
    """Calls of cuda_native.decode_into from here on, each recorded as what(kwargs)."""
    launches = []
    launch = cuda_native.decode_into
    monkeypatch.setattr(cuda_native, "decode_into",
                        lambda *args, **kw: launches.append(what(kw)) or launch(*args, **kw))
    return launches


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_default_path_takes_the_native_decode(kind, d, monkeypatch):
    """A q_len 1 call with no choice made takes the CUDA C++ decode, once, and is right."""
    launches = _record_launches(monkeypatch, lambda kw: 1)
    case = make_case(batch=2, hq=8, hkv=2, d=d, kv_int8=KINDS[kind])
    out = run_kernel(case, max_query_len=1)
    assert len(launches) == 1
    assert rel_err(out, reference(case)) < _native_tol(case)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("splits", [0, 1, 3])
def test_dependent_launch_changes_no_bit(kind, splits, monkeypatch):
    """Programmatic dependent launch (sm_90) equals the plain launch bit for bit, with a new
    query on every call: a decode that read the query before quantize_int8 had written it,
    or a combine that read before the decode had finished, would show here."""
    from pagedfuse.ops import cuda

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    launches = _record_launches(monkeypatch, lambda kw: kw["pdl"])
    case = make_case(batch=4, hq=32, hkv=8, d=128, seq_lens=[3000, 10, 700, 1500],
                     kv_int8=KINDS[kind])
    for _ in range(20):
        case["query"].normal_()
        outs = []
        for pdl in (True, False):
            monkeypatch.setattr(cuda, "PDL", pdl)
            outs.append(run_kernel(case, max_query_len=1, splits=splits))
        assert torch.equal(*outs)
    assert rel_err(outs[0], reference(case)) < _native_tol(case)
    first = cuda_native.PDL_WAIT_FIRST if kind == "half" else cuda_native.PDL_AFTER_QUANTIZE
    assert launches == [first, cuda_native.PDL_OFF] * 20


def _balanced_counts() -> torch.Tensor:
    """The balanced grid's arrival counts of the current stream."""
    stream = torch.cuda.current_stream().cuda_stream
    return cuda_native._counters[torch.cuda.current_device(), stream]


@pytest.mark.parametrize("kind", list(KINDS))
def test_balanced_grid_merges_in_a_fixed_order_and_leaves_its_counts_at_zero(kind):
    """Sequence 1 has no query token (its items have no steps), sequence 3 is one page; the
    others are cut into pieces across CTAs. Every call gives the same bits whichever CTA
    merged, and leaves every count at zero for the next launch."""
    case = make_case(batch=5, hq=32, hkv=8, d=128, seq_lens=[3000, 10, 700, 16, 1500],
                     kv_int8=KINDS[kind])
    case["query"] = case["query"][:4]
    case["query_start_loc"] = torch.tensor([0, 1, 1, 2, 3, 4], dtype=torch.int32,
                                           device="cuda")
    outs = [run_kernel(case, max_query_len=1, splits=0, native=True) for _ in range(10)]
    torch.cuda.synchronize()
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert rel_err(outs[0], reference(case)) < _native_tol(case)
    assert not _balanced_counts().any()


def test_balanced_grid_replays_in_a_cuda_graph():
    """A graph captured on a stream with no counts yet records their zeroing; its replays
    equal the eager call bit for bit, see new inputs, and leave the counts at zero; an eager
    call on that stream afterwards zeroes them first."""
    case = make_case(batch=4, hq=32, hkv=8, d=128, seq_lens=[3000, 10, 700, 1500],
                     kv_int8="kv")
    call = lambda: run_kernel(case, max_query_len=1, splits=0, native=True)  # noqa: E731
    eager = call()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = call()
    outs = replayed(graph, captured, 20)
    assert all(torch.equal(o, eager) for o in outs)
    case["query"].copy_(torch.randn_like(case["query"]))
    graph.replay()
    assert rel_err(captured, reference(case)) < 3e-2
    with torch.cuda.stream(stream):
        assert torch.equal(call(), captured)
        torch.cuda.synchronize()
        assert not _balanced_counts().any()


@pytest.mark.parametrize("kind", list(KINDS))
def test_balanced_grid_with_more_ctas_than_steps(monkeypatch, kind):
    """600 CTAs per head group for 23-84 key steps: most CTAs have no share, and sequence
    0's item is cut into a piece per CTA that one CTA merges."""
    from pagedfuse.ops import cuda

    monkeypatch.setattr(cuda, "balanced_ctas", lambda config, *_: 600 * 8 // config.heads)
    case = make_case(batch=5, hq=32, hkv=8, d=128, seq_lens=[3000, 10, 700, 16, 1500],
                     kv_int8=KINDS[kind])
    out = run_kernel(case, max_query_len=1, splits=0, native=True)
    assert rel_err(out, reference(case)) < _native_tol(case)
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
    from pagedfuse.ops import cuda

    variant = cuda_native.Variant(resident=1, warps=8, tile=32, heads=4,
                                  balanced_resident=balanced_resident)
    config = cuda.LaunchConfig(64, 8, 1, resident=4, heads=4)
    assert cuda.balanced_ctas(config, variant, batch, 8, 128, 8192, 132) == ctas


def test_pagedfuse_balanced_makes_the_default_path_take_the_balanced_grid(monkeypatch):
    from pagedfuse.ops import cuda

    grids = _record_launches(monkeypatch, lambda kw: kw["ctas"])
    case = make_case(batch=5, hq=32, hkv=8, d=128, seq_lens=[3000, 10, 700, 16, 1500],
                     kv_int8="kv")
    split = run_kernel(case, max_query_len=1)
    monkeypatch.setattr(cuda, "BALANCED_GRID", True)
    balanced = run_kernel(case, max_query_len=1)
    assert grids[0] == 0 and grids[1] > 0
    assert rel_err(balanced, reference(case)) < _native_tol(case)
    assert rel_err(balanced, split) < 1e-2


def test_balanced_grid_is_the_plans_choice_up_to_its_batch_limit():
    from pagedfuse.ops import cuda

    config = cuda.LaunchConfig(64, 8, 1, resident=4, heads=4, balanced=True)
    plan = lambda batch: cuda.launch_plan(  # noqa: E731
        batch, 32, 8, 128, batch, 8192, 1, 132, config)
    assert plan(64).splits == cuda.BALANCED
    assert plan(cuda_native.BALANCED_MAX_BATCH + 1).splits >= 1
    assert cuda.launch_plan(64, 32, 8, 128, 64, 8192, 1, 132,
                            config._replace(balanced=False)).splits >= 1
    with pytest.raises(ValueError, match="splits=0 .* is the CUDA C.. decode's"):
        run_kernel(make_case(batch=2, hq=8, hkv=2, d=128), splits=0, native=False)


def test_ops_route_to_the_cuda_kernels():
    case = make_case(batch=2, hq=8, hkv=2, d=64, kv_int8="kv")
    args = [case[k] for k in ("query", "key_cache", "value_cache", "key_scale", "value_scale",
                              "block_table", "seq_lens", "query_start_loc")]
    out = torch.ops.pagedfuse.paged_attention_int8(*args, case["scale"], False)
    assert out.is_cuda and rel_err(out, reference(case)) < 3e-2
    fcase = make_case(batch=2, hq=8, hkv=2, d=64)
    fout = torch.ops.pagedfuse.paged_attention(
        fcase["query"], fcase["key_cache"], fcase["value_cache"], fcase["block_table"],
        fcase["seq_lens"], fcase["query_start_loc"], fcase["scale"], False)
    assert rel_err(fout, reference(fcase)) < 2e-2


def test_quantize_int8_is_bit_exact():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(33, 7, 128, generator=gen) * 4
    x[0, 0] = 0.0  # all-zero row: scale 0, zeros out
    x[1, 0, :4] = torch.tensor([127.0, 0.5, 2.5, -1.5])  # scale 1: exact ties round to even
    for dtype in (torch.float32, torch.bfloat16):
        q, s = torch.ops.pagedfuse.quantize_int8(x.to(dtype).cuda())
        q_ref, s_ref = quantize_int8_reference(x.to(dtype))
        assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)


@pytest.mark.parametrize("native", [True, False], ids=["cuda-cpp", "triton"])
@pytest.mark.parametrize("kv_int8", [None, "k", "kv"])
def test_out_of_range_block_ids_are_clamped(kv_int8, native):
    """Unchecked bad ids must not read outside the cache (compute-sanitizer checks the
    reads in gpu_check.sh; here: no fault, every element written)."""
    case = make_case(batch=2, hq=8, hkv=2, d=64, kv_int8=kv_int8)
    case["block_table"][0, 0] = 10**6
    case["block_table"][1, 0] = -5
    out = run_kernel(case, max_query_len=1, native=native)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kv_int8", [None, "k", "kv"])
def test_cuda_graph_replays_are_identical(kv_int8):
    case = make_case(batch=4, hq=32, hkv=8, d=128, seq_lens=[3000, 10, 700, 1500],
                     kv_int8=kv_int8)
    op = (torch.ops.pagedfuse.paged_attention_int8 if kv_int8
          else torch.ops.pagedfuse.paged_attention)
    names = ["query", "key_cache", "value_cache", "key_scale", "value_scale", "block_table",
             "seq_lens", "query_start_loc"]
    if not kv_int8:
        names.remove("key_scale")
        names.remove("value_scale")

    args = [case[k] for k in names]
    call = lambda: op(*args, case["scale"], False, None, 3000, 1)
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
    case["query"].copy_(torch.randn_like(case["query"]))  # replays must see new inputs
    graph.replay()
    assert rel_err(captured, reference(case)) < 3e-2

"""The eager host path on any machine: the switches it reads on every call follow os.environ
at once; what the op caches per call signature (the metadata verdict, the backend choice, the
CUDA decode's plan and launch record, the Autograd kernel's view of a keyset) never serves
another signature, a changed switch or a changed registry; and the one launch call the CUDA
decode makes (cuda_native.decode_into) hands the library the right record, pointers and
scratch. The library is a recording stand-in here; the kernels themselves are tested on the
GPU (test_cuda_kernels.py)."""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.backends import registered
from helpers.cases import make_case
from torch.fx.experimental.proxy_tensor import make_fx

import pagedfuse.ops  # noqa: F401  (registers torch.ops.pagedfuse.*)
from pagedfuse import envs, numerics
from pagedfuse.ops import cuda_native, library, validate
from pagedfuse.ops.backends import Backend, choose, get_backend, registry
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, Geometry, PagedCall
from pagedfuse.ops.reference import quantize_int8_reference
from pagedfuse.ops.signature_cache import SignatureCache
from pagedfuse.ops.validate import build_call


def test_a_switch_follows_os_environ_at_once(monkeypatch):
    monkeypatch.delenv("PAGEDFUSE_PDL", raising=False)
    assert envs.PAGEDFUSE_PDL is True  # the default, "1"
    monkeypatch.setenv("PAGEDFUSE_PDL", "0")
    assert envs.PAGEDFUSE_PDL is False
    os.environ["PAGEDFUSE_PDL"] = "1"
    assert envs.PAGEDFUSE_PDL is True
    with envs.overridden("PAGEDFUSE_BALANCED", "1"):
        assert envs.PAGEDFUSE_BALANCED is True
    monkeypatch.setenv("PAGEDFUSE_BACKEND", "cpu")
    assert envs.PAGEDFUSE_BACKEND == "cpu" == envs.VARIABLES["PAGEDFUSE_BACKEND"].value()
    monkeypatch.delenv("PAGEDFUSE_BACKEND")
    assert envs.PAGEDFUSE_BACKEND is None
    with pytest.raises(AttributeError, match="PAGEDFUSE_NONESUCH"):
        envs.PAGEDFUSE_NONESUCH  # noqa: B018
    assert "PAGEDFUSE_PDL" in dir(envs)


class _Recorder:
    """Stands in for the library: records each fused launch's record and pointers."""

    def __init__(self):
        self.launches = []

    def pagedfuse_decode_fused(self, address, stream, *pointers):
        record = cuda_native.DecodeLaunch.from_address(address)
        self.launches.append((record, stream, pointers))
        return 0


@pytest.fixture
def recorder(monkeypatch):
    lib = _Recorder()
    monkeypatch.setattr(cuda_native, "library", lambda: lib)
    monkeypatch.setattr(cuda_native, "_index", lambda device: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1234,
                        raising=False)
    workspaces = []

    def workspace(index, stream, nbytes):
        workspaces.append((index, stream, nbytes))
        return torch.empty(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(cuda_native, "_workspace", workspace)
    lib.workspaces = workspaces
    return lib


def _call(kind: str, batch=3, hq=8, hkv=2, d=64, query=None, window=None, softcap=None):
    if query is None:
        query = torch.randn(batch, hq, d).to(torch.bfloat16)
    key = torch.randint(-127, 128, (6, 16, hkv, d), dtype=torch.int8) if kind != "half" \
        else torch.randn(6, 16, hkv, d).to(torch.bfloat16)
    value = torch.randn(6, 16, hkv, d).to(torch.bfloat16) if kind != "int8_kv" else \
        torch.randint(-127, 128, (6, 16, hkv, d), dtype=torch.int8)
    key_scale = torch.rand(6, 16, hkv) if kind != "half" else None
    value_scale = torch.rand(6, 16, hkv) if kind == "int8_kv" else None
    table = torch.randint(0, 6, (batch, 5), dtype=torch.int32)
    lens = torch.full((batch,), 70, dtype=torch.int64)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    geometry = Geometry(batch, hq, hkv, d, 6, 16, batch, 5)
    return PagedCall(INT8_OP if key_scale is not None else FLOAT_OP, query, key, value,
                     key_scale, value_scale, table, lens, starts, 0.125, True, None, None, 1,
                     geometry, window, softcap)


@pytest.mark.parametrize("kind", ["int8_kv", "int8_k", "half"])
@pytest.mark.parametrize("splits", [1, 5])
def test_one_launch_call_gets_the_record_pointers_and_scratch(recorder, kind, splits):
    call = _call(kind, window=40, softcap=30.0)
    out = torch.empty_like(call.query)
    pdl = cuda_native.PDL_AFTER_QUANTIZE if kind != "half" else cuda_native.PDL_WAIT_FIRST
    cuda_native.decode_into(call, out, splits, 2, pdl=pdl)
    cuda_native.decode_into(call, out, splits, 2, pdl=pdl)
    (first, stream, pointers), (again, _, _) = recorder.launches
    assert ctypes.addressof(first) == ctypes.addressof(again)  # built once per signature
    assert stream == 1234
    g, rows = call.geometry, 3 * 8
    quantize = kind != "half"
    assert (first.kind, first.out_dtype, first.pdl, first.head_dim, first.heads,
            first.quantize) == (cuda_native.KINDS.index(kind), 0, pdl, 64, 2, int(quantize))
    assert (first.batch, first.num_kv_heads, first.splits, first.ctas) == (3, 2, splits, 0)
    assert first.index64 == 0b010  # seq_lens alone is int64
    assert list(first.sizes) == [3, 8, 4, 6, 5, 16, 4, 40]
    k_strides = [s * call.key_cache.element_size() for s in call.key_cache.stride()[:3]]
    assert list(first.strides)[:4] == [call.query.stride(0), *k_strides]
    assert first.q_stride_h == call.query.stride(1)
    assert first.scale_log2 == pytest.approx(0.125 * math.log2(math.e))
    assert first.softcap == 30.0
    # scratch: splits' partial rows, then the int8 query and its scales, 16-byte aligned
    parts = rows * splits if splits > 1 else 0
    assert (first.part_o, first.part_lse) == (0, parts * g.head_dim * 4)
    assert first.q8 == parts * g.head_dim * 4 + -(-parts * 4 // 16) * 16
    assert first.q_scale == first.q8 + (rows * 64 if quantize else 0)
    used = first.q_scale + (rows * 4 if quantize else 0)
    assert [w[2] for w in recorder.workspaces] == ([-(-used // 16) * 16] * 2 if used else [])
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    expected = [ptr(t) for t in (call.query, call.key_cache, call.value_cache, call.key_scale,
                                 call.value_scale, call.block_table, call.seq_lens,
                                 call.query_start_loc, out)]
    assert list(pointers[:9]) == expected
    assert (pointers[9] is None) == (used == 0)
    assert pointers[10] is None  # counters: the balanced grid's only


def test_a_query_the_kernel_cannot_read_in_place_is_copied(recorder):
    wide = torch.randn(3, 8, 72).to(torch.bfloat16)[..., :64]  # heads 144 bytes apart
    call = _call("half", query=wide)
    cuda_native.decode_into(call, torch.empty(3, 8, 64, dtype=torch.bfloat16), 1, 1)
    record, _, pointers = recorder.launches[0]
    assert record.strides[0] == 8 * 64 and pointers[0] != wide.data_ptr()
    quantized = _call("int8_kv", query=wide)  # the quantize reads it with its strides
    cuda_native.decode_into(quantized, torch.empty(3, 8, 64, dtype=torch.bfloat16), 1, 1)
    record, _, pointers = recorder.launches[1]
    assert (record.strides[0], record.q_stride_h) == (8 * 72, 72)
    assert pointers[0] == wide.data_ptr()


def test_each_launch_choice_has_its_own_record(recorder):
    call = _call("int8_kv")
    out = torch.empty_like(call.query)
    for pdl in (cuda_native.PDL_OFF, cuda_native.PDL_AFTER_QUANTIZE):
        for splits in (1, 3):
            cuda_native.decode_into(call, out, splits, 1, pdl=pdl)
    assert [(r.pdl, r.splits) for r, _, _ in recorder.launches] == [(0, 1), (0, 3), (2, 1),
                                                                    (2, 3)]


# --- what the op caches per call signature, and that no cache serves a stale answer --------

def _counting(name: str, priority: int = 10**6):
    """A CPU backend that runs the reference and records each call it ran."""
    runs: list[PagedCall] = []

    def run(call: PagedCall, out: torch.Tensor, plan: object = None) -> None:
        runs.append(call)
        get_backend("reference").run(call, out, plan)

    backend = Backend(name=name, device="cpu", priority=priority,
                      head_dims={FLOAT_OP: None, INT8_OP: None}, run=run)
    return backend, runs


def test_a_cached_verdict_serves_only_its_own_signature():
    """Calls that differ from a checked one only in strides, a dtype, a scalar or an option
    get their own verdict: each bad one still fails with its own error."""
    case = make_case(seq_lens=(37, 20), head_dim=64, seed=11)
    good = case.run_op()
    assert numerics.rel_err(good, case.reference()) <= 1e-5
    t, hq, d = case.query.shape
    # same shape, innermost dim strided
    strided = torch.randn(t, hq, d, 2)[..., 0]
    with pytest.raises(ValueError, match="query: innermost dim must be contiguous"):
        case.with_(query=strided).run_op()
    with pytest.raises(TypeError, match="key_cache: dtype float64 must match query's float32"):
        case.with_(key_cache=case.key_cache.double()).run_op()
    with pytest.raises(ValueError, match="scale: must be a finite float"):
        case.with_(scale=float("inf")).run_op()
    with pytest.raises(ValueError, match="window_left: must be None or an int >= 1"):
        case.with_(window_left=0).run_op()
    assert torch.equal(case.run_op(), good)


def test_the_choice_follows_the_forced_backend_and_the_registry(monkeypatch):
    """The backend choice is cached per signature, yet PAGEDFUSE_BACKEND changed between two
    calls, a backend registered or removed after a call all take effect at the next call."""
    case = make_case(seq_lens=(30, 12), seed=12)
    first, first_runs = _counting("first")
    second, second_runs = _counting("second", priority=10**7)
    expected = case.reference()
    case.run_op()  # the cpu backend's, cached
    with registered(first):
        assert numerics.rel_err(case.run_op(), expected) <= 1e-5
        assert len(first_runs) == 1
        with registered(second):
            case.run_op()
            assert (len(first_runs), len(second_runs)) == (1, 1)
            monkeypatch.setenv("PAGEDFUSE_BACKEND", "first")
            case.run_op()
            assert (len(first_runs), len(second_runs)) == (2, 1)
            monkeypatch.setenv("PAGEDFUSE_BACKEND", "reference")
            case.run_op()
            monkeypatch.delenv("PAGEDFUSE_BACKEND")
            case.run_op()
            assert (len(first_runs), len(second_runs)) == (2, 2)
        case.run_op()
        assert len(first_runs) == 3
    case.run_op()
    assert (len(first_runs), len(second_runs)) == (3, 2)
    assert choose(case.call()).name == "cpu"


def test_the_signature_caches_are_bounded(monkeypatch):
    """Past their limit the verdict and choice caches start over rather than grow, and the
    calls after that are still checked and right."""
    monkeypatch.setattr(validate._VERDICTS, "limit", 2)
    monkeypatch.setattr(registry._CHOICES, "limit", 2)
    validate._VERDICTS.clear()
    registry._CHOICES.clear()
    for batch in (1, 2, 3, 4, 5):
        case = make_case(seq_lens=tuple(range(9, 9 + batch)), seed=batch)
        assert numerics.rel_err(case.run_op(), case.reference()) <= 1e-5
        assert len(validate._VERDICTS) <= 2 and len(registry._CHOICES) <= 2
    with pytest.raises(ValueError, match="query: innermost dim must be contiguous"):
        case.with_(query=torch.randn(*case.query.shape, 2)[..., 0]).run_op()


def test_the_autograd_kernel_still_redispatches_a_traced_call_after_an_eager_one():
    """The Autograd kernel remembers which keysets are plain: an eager call in grad mode
    first, then a trace of the same op (fake tensors in grad mode) must still reach the fake
    implementation, and an input that requires grad still gets the failing backward."""
    case = make_case(seq_lens=(21, 7), seed=13)
    eager = case.run_op()
    args = case.op_args()
    names = [n for n in args if isinstance(args[n], torch.Tensor)]

    def body(*tensors):
        traced = dict(zip(names, tensors, strict=True))
        return torch.ops.pagedfuse.paged_attention(**{**args, **traced})

    graph = make_fx(body, tracing_mode="fake")(*[args[n] for n in names])
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets == [torch.ops.pagedfuse.paged_attention.default]
    assert torch.equal(graph(*[args[n] for n in names]), eager)
    query = case.query.clone().requires_grad_()
    out = case.with_(query=query).run_op()
    with pytest.raises(RuntimeError, match="pagedfuse::paged_attention has no backward"):
        out.sum().backward()


def test_outputs_are_fresh_contiguous_and_follow_the_mode():
    """The op's outputs come from an allocator that skips the dispatcher: still a new
    contiguous tensor per call, an inference tensor under inference_mode only."""
    case = make_case(seq_lens=(19, 4), seed=14)
    strided = torch.randn(*case.query.shape[:2], 72)[..., :64]  # rows 288 bytes apart
    first, second = case.run_op(), case.with_(query=strided).run_op()
    assert first.is_contiguous() and second.is_contiguous()
    assert first.data_ptr() != case.run_op().data_ptr() != second.data_ptr()
    assert numerics.rel_err(second, case.with_(query=strided).reference()) <= 1e-5
    with torch.inference_mode():
        inside = case.run_op()
        x_int8, x_scale = torch.ops.pagedfuse.quantize_int8(case.query)
    assert inside.is_inference() and x_int8.is_inference() and x_scale.is_inference()
    assert not first.is_inference()
    assert torch.equal(inside, first)


def _built(kind: str, layout: str = "NHD") -> PagedCall:
    """_call's tensors through build_call, so the geometry is the verdict cache's (one per
    signature), with the caches in ``layout`` (HND: each head's page contiguous)."""
    c = _call(kind)
    key, value = c.key_cache, c.value_cache
    if layout == "HND":
        key, value = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (key, value))
    return build_call(c.op, c.query, key, value, c.key_scale, c.value_scale, c.block_table,
                      c.seq_lens, c.query_start_loc, c.scale, c.causal, None, None, 1)


def test_a_launch_record_per_signature(recorder):
    """The launch record is cached per call signature: the same shapes with the caches laid
    out otherwise get a record with their own strides, and each layout keeps its own."""
    out = torch.empty(3, 8, 64, dtype=torch.bfloat16)
    for layout in ("NHD", "HND", "NHD"):
        call = _built("int8_k", layout)
        cuda_native.decode_into(call, out, 1, 1)
        record = recorder.launches[-1][0]
        size = call.key_cache.element_size()
        assert list(record.strides)[1:4] == [s * size for s in call.key_cache.stride()[:3]]
    nhd, hnd, again = (r for r, _, _ in recorder.launches)
    assert ctypes.addressof(nhd) == ctypes.addressof(again) != ctypes.addressof(hnd)


@pytest.fixture
def decode_backend(monkeypatch):
    """backends.cuda_decode (it needs Triton) with the library's variant query answered
    here and PDL taken as possible, as on an sm_90 GPU."""
    cuda_decode = pytest.importorskip("pagedfuse.ops.backends.cuda_decode")
    from pagedfuse.ops import cuda

    monkeypatch.setattr(cuda_native, "decode_variant",
                        lambda device, kind, head_dim, column_tiles=0: cuda_native.Variant(
                            2, 4, 16, 4 if column_tiles == 0 else 1, 2, 4))
    monkeypatch.setattr(cuda, "pdl_capable", lambda device: True)
    return cuda_decode


def test_the_default_plan_follows_the_switches(decode_backend, monkeypatch):
    """cuda_decode caches its default plan per signature, hints and switches: turning
    PAGEDFUSE_BALANCED or PAGEDFUSE_PDL on or off between two calls changes the next plan."""
    monkeypatch.delenv("PAGEDFUSE_BALANCED", raising=False)
    monkeypatch.delenv("PAGEDFUSE_PDL", raising=False)
    call = _built("int8_kv")
    split = decode_backend.make_plan(call)
    assert split.splits >= 1 and split.ctas == 0 and split.pdl
    assert decode_backend.make_plan(call) is split
    monkeypatch.setenv("PAGEDFUSE_BALANCED", "1")
    balanced = decode_backend.make_plan(call)
    assert balanced.splits == decode_backend.BALANCED and balanced.ctas > 0
    monkeypatch.setenv("PAGEDFUSE_PDL", "0")
    assert not decode_backend.make_plan(call).pdl
    monkeypatch.delenv("PAGEDFUSE_BALANCED")
    monkeypatch.delenv("PAGEDFUSE_PDL")
    assert decode_backend.make_plan(call) is split
    assert decode_backend.make_plan(call._replace(max_seq_len=16)).splits == 1


def test_the_launch_follows_the_pdl_switch(decode_backend, recorder, monkeypatch):
    """Through the backend's run: the fused launch goes as a dependent launch, then plainly
    once PAGEDFUSE_PDL=0, then dependent again."""
    call = _built("int8_k")
    out = torch.empty_like(call.query)
    monkeypatch.delenv("PAGEDFUSE_PDL", raising=False)
    decode_backend.run(call, out)
    monkeypatch.setenv("PAGEDFUSE_PDL", "0")
    decode_backend.run(call, out)
    monkeypatch.delenv("PAGEDFUSE_PDL")
    decode_backend.run(call, out)
    assert [r.pdl for r, _, _ in recorder.launches] == [cuda_native.PDL_AFTER_QUANTIZE,
                                                        cuda_native.PDL_OFF,
                                                        cuda_native.PDL_AFTER_QUANTIZE]


@pytest.mark.parametrize("listed", [0, 10**6], ids=["torch", "python"])
def test_both_ways_of_taking_the_block_span_agree(monkeypatch, listed):
    """check_values takes the span of the block ids in use in Python for a small table and
    with torch ops for a large one: either way an id only a sequence without keys or a
    column past a sequence's blocks holds is let through, negative ids down to -num_blocks
    wrap, and an id in use outside the cache is refused with the span."""
    monkeypatch.setattr(validate, "_LISTED_BLOCKS", listed)
    c = make_case(seq_lens=(0, 9, 21), num_blocks=16, block_size=4, seed=15)
    c.block_table[0] = 10_000  # sequence 0 reads no key
    c.block_table[1, 3] = -17  # past sequence 1's three blocks
    c.block_table[2, 0] = -16  # wraps to block 0
    assert numerics.rel_err(c.run_op(), c.reference()) <= 1e-5
    for column, bad, span in ((5, 16, r"\[-16, 16\]"), (2, -17, r"\[-17, \d+\]")):
        used = c.with_(block_table=c.block_table.clone())
        used.block_table[2, column] = bad
        with pytest.raises(ValueError, match=r"block_table: entries in use span " + span):
            used.run_op()


def test_build_call_fills_every_field_of_the_record():
    """build_call makes the PagedCall without its constructor (tuple.__new__, positionally):
    every field, the options after the geometry included, holds what was passed."""
    case = make_case(kind="int8_kv", window_left=5, softcap=7.0, seed=16)
    for _ in range(2):  # the first call checks, the second takes the cached verdict
        call = case.call(max_seq_len=40, max_query_len=1)
        expected = PagedCall(INT8_OP, case.query, case.key_cache, case.value_cache,
                             case.key_scale, case.value_scale, case.block_table, case.seq_lens,
                             case.query_start_loc, case.scale, case.causal, None, 40, 1,
                             call.geometry, 5, 7.0)
        assert type(call) is PagedCall and len(call) == len(PagedCall._fields)
        assert all(a is b if isinstance(b, torch.Tensor) else a == b
                   for a, b in zip(call, expected, strict=True)), call


def _strided(index: torch.Tensor) -> torch.Tensor:
    """The same values, every other element of a buffer whose other half is huge."""
    return torch.stack((index, torch.full_like(index, 1 << 30)), dim=1)[:, 0]


def test_strided_lengths_reach_the_backends_dense():
    """Kernels index seq_lens and query_start_loc as plain arrays: a strided one (a column of
    a wider tensor) reaches them as a dense copy, on the first call and on the cached one."""
    case = make_case(seq_lens=(37, 20, 9), q_lens=(1, 3, 2), seed=17)
    lens, starts = _strided(case.seq_lens), _strided(case.query_start_loc)
    assert lens.stride() == (2,) and starts.stride() == (2,)
    strided = case.with_(seq_lens=lens, query_start_loc=starts)
    for _ in range(2):
        call = strided.call()
        assert call.seq_lens.stride() == (1,) and call.query_start_loc.stride() == (1,)
        assert torch.equal(call.seq_lens, case.seq_lens)
        assert torch.equal(call.query_start_loc, case.query_start_loc)
    dense = case.call()
    assert dense.seq_lens is case.seq_lens and dense.query_start_loc is case.query_start_loc


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["float", "int8_kv"])
def test_strided_lengths_on_the_gpu_match_the_reference(kind):
    """The op on CUDA (whichever backend it picks, decode and prefill rows) reads a strided
    seq_lens and query_start_loc by their values."""
    case = make_case(seq_lens=(37, 20, 9), q_lens=(1, 3, 2), kind=kind, seed=18,
                     dtype=torch.bfloat16, device="cuda")
    strided = case.with_(seq_lens=_strided(case.seq_lens),
                         query_start_loc=_strided(case.query_start_loc))
    assert numerics.rel_err(strided.run_op(), case.reference()) <= 2e-2


# --- the C++ host path (csrc/host/host.cpp): a repeated signature never enters Python ---------

host = pytest.mark.skipif(library.HOST is None, reason="pagedfuse._host is not built")


@pytest.fixture
def empty_table():
    """The C++ table without the signatures earlier tests left (the same shapes recur)."""
    library.HOST.clear()


def _stats_after(fn) -> tuple[object, int, int]:
    """fn's result, and the C++ table's hits and misses during it."""
    before = library.HOST.stats()
    result = fn()
    after = library.HOST.stats()
    return result, after["hits"] - before["hits"], after["misses"] - before["misses"]


def _op_into_freed_nan(case) -> torch.Tensor:
    """case.run_op() right after a NaN block of the output's size was freed, which the CPU
    allocator hands out next: an element the kernel does not write stays NaN."""
    poison = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype)
    del poison
    return case.run_op()


def _refill(case) -> None:
    """Fresh random values in the case's query and caches, in place (the same signature)."""
    case.query.copy_(torch.randn_like(case.query))
    for cache in (case.key_cache, case.value_cache):
        if cache.dtype == torch.int8:
            cache.copy_(torch.randint_like(cache, -127, 128))
        else:
            cache.copy_(torch.randn_like(cache))


@host
@pytest.mark.parametrize("kind,options", [("float", {}), ("int8_kv", {}), ("int8_k", {}),
                                          ("float", {"window_left": 9, "softcap": 20.0})])
def test_a_repeated_signature_launches_from_cpp(empty_table, kind, options):
    """The first call of a signature runs in Python and leaves its launch in the C++ table;
    the next ones are hits, and each equals the float64 reference on fresh random data."""
    case = make_case(seq_lens=(37, 20, 5), q_lens=(1, 4, 2), kind=kind, seed=21, **options)
    out, hits, misses = _stats_after(lambda: _op_into_freed_nan(case))
    assert (hits, misses) == (0, 1)
    assert numerics.rel_err(out, case.reference()) <= 1e-5
    for _ in range(3):
        _refill(case)
        out, hits, misses = _stats_after(lambda: _op_into_freed_nan(case))
        assert (hits, misses) == (1, 0)
        assert numerics.rel_err(out, case.reference()) <= 1e-5


@host
def test_a_changed_signature_is_a_miss_not_a_wrong_launch(empty_table):
    """Calls that differ from a launched one only in a stride, a dtype, a hint, the scale or
    an option miss the table: each runs in Python first, then has its own launch."""
    case = make_case(seq_lens=(29, 11), q_lens=(1, 1), seed=22)
    case.run_op()
    t, hq, d = case.query.shape
    strided = torch.randn(t, hq, d + 8)[..., :d]  # rows 288 bytes apart
    variants = {
        "stride": (case.with_(query=strided), {}),
        "dtype": (case.with_(query=case.query.bfloat16(), key_cache=case.key_cache.bfloat16(),
                             value_cache=case.value_cache.bfloat16()), {}),
        "hint": (case, {"max_seq_len": 29}),
        "scale": (case.with_(scale=case.scale * 2), {}),
        "window": (case.with_(window_left=4), {}),
    }
    for name, (variant, hints) in variants.items():
        expected = variant.reference()
        for first in (True, False):
            out, hits, misses = _stats_after(lambda v=variant, h=hints: v.run_op(**h))
            assert (hits, misses) == ((0, 1) if first else (1, 0)), name
            assert numerics.rel_err(out, expected) <= (1e-2 if name == "dtype" else 1e-5), name


@host
def test_value_checks_and_alignment_still_run_on_a_hit():
    """check_values runs on every CPU call, a hit included, and a data pointer off its
    alignment under a launched signature is sent to Python, which raises its error."""
    case = make_case(seq_lens=(40, 16), q_lens=(1, 1), num_blocks=8, seed=23)
    case.run_op()
    _, hits, _ = _stats_after(case.run_op)
    assert hits == 1
    too_long = case.seq_lens.clone()
    too_long[1] = 10_000
    with pytest.raises(ValueError, match="seq_lens: max 10000 exceeds"):
        case.with_(seq_lens=too_long).run_op()
    outside = case.block_table.clone()
    outside[0, 0] = 8
    with pytest.raises(ValueError, match=r"block_table: entries in use span"):
        case.with_(block_table=outside).run_op()
    shifted = torch.empty(case.query.numel() + 1)[1:].view(case.query.shape)  # 4 bytes off
    shifted.copy_(case.query)
    with pytest.raises(ValueError, match="query: data pointer is not 16-byte aligned"):
        case.with_(query=shifted).run_op()


@host
def test_a_forced_backend_and_a_new_backend_are_honoured_on_a_launched_signature(monkeypatch):
    """PAGEDFUSE_BACKEND joins every signature: forcing a backend without a C++ launcher after
    a signature was launched runs that backend on every call; unsetting it returns to the
    launch. A backend registered afterwards takes the next call."""
    case = make_case(seq_lens=(21, 8), seed=24)
    expected = case.reference()
    case.run_op()
    counting, runs = _counting("counting")
    with registered(counting):
        assert numerics.rel_err(case.run_op(), expected) <= 1e-5
        assert len(runs) == 1  # the top priority now
        monkeypatch.setenv("PAGEDFUSE_BACKEND", "counting")
        for _ in range(2):
            case.run_op()
        assert len(runs) == 3
        monkeypatch.setenv("PAGEDFUSE_BACKEND", "cpu")
        case.run_op()
        _, hits, _ = _stats_after(case.run_op)
        assert hits == 1 and len(runs) == 3
    monkeypatch.delenv("PAGEDFUSE_BACKEND")
    case.run_op()  # the registry has changed: a miss
    out, hits, _ = _stats_after(case.run_op)
    assert hits == 1 and len(runs) == 3
    assert numerics.rel_err(out, expected) <= 1e-5


@host
def test_quantize_int8_repeats_from_cpp_bit_for_bit():
    x = torch.randn(5, 3, 64)
    quantize = torch.ops.pagedfuse.quantize_int8
    quantize(x)
    for _ in range(2):
        x.copy_(torch.randn_like(x) * 7)
        (q, scale), hits, misses = _stats_after(lambda: quantize(x))
        assert (hits, misses) == (1, 0)
        expected_q, expected_scale = quantize_int8_reference(x)
        assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)


@host
def test_grad_mode_inputs_still_fail_at_backward_after_a_launch():
    case = make_case(seq_lens=(13, 6), seed=25)
    plain = case.run_op()
    query = case.query.clone().requires_grad_()
    out = case.with_(query=query).run_op()
    assert out.requires_grad and torch.equal(out.detach(), plain)
    with pytest.raises(RuntimeError, match="pagedfuse::paged_attention has no backward"):
        out.sum().backward()


@host
def test_the_table_is_bounded():
    """Past its limit the table starts over: the calls after that are still launched right."""
    library.HOST.set_limit(2)
    try:
        for batch in (1, 2, 3):
            case = make_case(seq_lens=tuple(range(9, 9 + batch)), seed=30 + batch)
            assert numerics.rel_err(case.run_op(), case.reference()) <= 1e-5
            assert library.HOST.stats()["entries"] <= 2
        _, hits, _ = _stats_after(case.run_op)
        assert hits == 1
    finally:
        library.HOST.set_limit(4096)


def test_the_ops_run_without_the_extension():
    """Where pagedfuse._host is not built, the Python kernels serve every call."""
    script = """
import sys
sys.modules["pagedfuse._host"] = None  # an import of it raises ImportError
sys.path.insert(0, "tests")
import torch
from helpers.cases import make_case
from pagedfuse import numerics
from pagedfuse.ops import library
assert library.HOST is None
case = make_case(seq_lens=(17, 5), kind="int8_kv", seed=26)
for _ in range(2):
    assert numerics.rel_err(case.run_op(), case.reference()) <= 1e-5
out = case.with_(query=case.query.clone().requires_grad_()).run_op()
try:
    out.sum().backward()
except RuntimeError as err:
    assert "has no backward" in str(err)
else:
    raise AssertionError("backward ran")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parent.parent, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@host
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["float", "int8_kv", "int8_k"])
def test_a_repeated_cuda_decode_launches_from_cpp(empty_table, kind):
    """On the GPU the CUDA C++ decode's launch is kept per signature: the second call is a
    hit on the current stream, and each call equals the reference on fresh data."""
    if not cuda_native.decode_available(torch.device("cuda")):
        pytest.skip("the CUDA C++ decode library is not built for this GPU")
    case = make_case(seq_lens=(300, 17, 120), q_lens=(1, 1, 1), kind=kind, seed=27,
                     dtype=torch.bfloat16, device="cuda")
    for first in (True, False, False):
        out, hits, misses = _stats_after(lambda: case.run_op(max_query_len=1))
        assert (hits, misses) == ((0, 1) if first else (1, 0))
        assert numerics.rel_err(out, case.reference()) <= 2e-2
        _refill(case)
    x = torch.randn(4, 8, 64, device="cuda", dtype=torch.bfloat16)
    torch.ops.pagedfuse.quantize_int8(x)
    (q, scale), hits, _ = _stats_after(lambda: torch.ops.pagedfuse.quantize_int8(x))
    expected_q, expected_scale = quantize_int8_reference(x.cpu())
    assert hits == 1
    assert torch.equal(q.cpu(), expected_q) and torch.equal(scale.cpu(), expected_scale)


def test_a_signature_cache_starts_over_when_full():
    """The host paths' per-signature caches: entries up to the limit, then the insert past
    it empties the cache first (the work redone, the memory bounded)."""
    cache = SignatureCache(limit=3)
    assert [cache.put(k, str(k)) for k in range(3)] == ["0", "1", "2"]
    assert dict(cache) == {0: "0", 1: "1", 2: "2"} and cache.get(1) == "1"
    assert cache.put(3, "3") == "3"
    assert dict(cache) == {3: "3"} and cache.get(0) is None


def test_short_queries_launch_their_columns(decode_backend, recorder, monkeypatch):
    """Four query tokens per sequence (GQA 4: 16 columns) take two n-tiles of one KV head
    per CTA on the split grid, even with PAGEDFUSE_BALANCED on, and the record says so."""
    monkeypatch.setenv("PAGEDFUSE_BALANCED", "1")
    c = _call("int8_kv", query=torch.randn(12, 8, 64).to(torch.bfloat16))
    starts = torch.arange(0, 13, 4, dtype=torch.int32)
    call = build_call(c.op, c.query, c.key_cache, c.value_cache, c.key_scale, c.value_scale,
                      c.block_table, c.seq_lens, starts, c.scale, True, None, None, 4)
    plan = decode_backend.make_plan(call)
    assert plan.columns == cuda_native.Columns(4, 2, 1)
    assert plan.config.heads == 1 and plan.ctas == 0 and plan.splits >= 1
    decode_backend.run(call, torch.empty_like(call.query))
    record = recorder.launches[-1][0]
    assert (record.max_query, record.column_tiles, record.column_groups, record.causal,
            record.heads) == (4, 2, 1, 1, 1)

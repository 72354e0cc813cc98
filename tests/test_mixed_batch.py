"""The ``mixed_batch`` backend (decode rows beside prompt chunks in one call: the CUDA C++
decode for the one, a prefill kernel for the other).

Without a GPU: which sizes may mix one-token queries with longer ones, which calls the
backend declines and why, and (where Triton is installed) that it runs the decode part first
and the prefill part second, each told to skip the other's sequences. On a GPU (marked
``cuda``): mixed batches of every cache kind against the float64 reference into NaN-poisoned
outputs, through the backend and through the op's own choice, and from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from helpers.cases import make_case
from helpers.prefill import varlen_case

from pagedfuse.numerics import rel_err
from pagedfuse.ops import prefill_plan as pp
from pagedfuse.ops.signature_cache import SignatureCache

cuda = pytest.mark.cuda


@pytest.mark.parametrize(("q_lens", "hint", "mixed"), [
    ([1, 33, 1], 33, True),  # decode rows beside a chunk
    ([33, 33], 33, False),  # 66 tokens = 2 x 33: no sequence can be shorter
    ([40], None, False),  # one sequence
    ([5, 3], None, True),  # no hint: the bound is every token
    ([1, 1], 1, False),  # a decode call (the CUDA decode's own)
])
def test_which_sizes_may_mix_decode_rows(q_lens, hint, mixed):
    case = make_case(seq_lens=[q + 50 for q in q_lens], q_lens=q_lens, head_dim=128,
                     dtype=torch.bfloat16)
    assert pp.may_mix_decode_rows(case.call(max_query_len=hint)) is mixed


@pytest.fixture(scope="module")
def mb():
    pytest.importorskip("triton")  # the backend and its parts import the kernels
    from pagedfuse.ops.backends import mixed_batch

    return mixed_batch


def test_calls_without_decode_rows_or_a_decode_kernel_are_declined(mb):
    uniform = make_case(seq_lens=[80, 80], q_lens=[30, 30], head_dim=128, dtype=torch.bfloat16)
    assert mb.supports(uniform.call(max_query_len=30)) == (
        "no one-token query can sit beside a longer one (the sizes say so)")
    mixed = make_case(seq_lens=[80, 51], q_lens=[30, 1], head_dim=128, dtype=torch.bfloat16)
    why = mb.supports(mixed.call(max_query_len=30))  # a CPU call: no decode library for it
    assert why.startswith("the decode rows: cuda_decode: "), why


@pytest.mark.parametrize(("gluon_reason", "hint", "kind", "prefill"), [
    (None, 40, "int8_kv", "gluon"), ("slower", 40, "float", "triton"),
    (None, None, "int8_kv", "triton"),  # no hint: the chunks' lengths may be any
    (None, None, "float", "gluon"),  # ... where its launches for any lengths measured as fast
])
def test_the_decode_part_runs_first_then_the_prefill_part(mb, monkeypatch, gluon_reason,
                                                          hint, kind, prefill):
    """With the kernels replaced by recorders: the decode's rows, then the longer
    sequences' on the Gluon kernel where it measured faster for the longest query and
    that length is hinted or its launches for any lengths measured as fast (16-bit K/V,
    UNEQUAL_FASTER), else triton_prefill."""
    from pagedfuse.ops.backends import cuda_decode, gluon_prefill, triton_prefill

    ran = []
    # run's parts per signature: these are recorders
    monkeypatch.setattr(mb, "_PARTS", SignatureCache())
    monkeypatch.setattr(cuda_decode, "rows_unsupported", lambda call: None)
    monkeypatch.setattr(gluon_prefill, "supports", lambda call: None)
    monkeypatch.setattr(gluon_prefill, "slower", lambda call: gluon_reason)
    monkeypatch.setattr(triton_prefill, "supports", lambda call: None)
    for module, name in ((cuda_decode, "decode"), (gluon_prefill, "gluon"),
                         (triton_prefill, "triton")):
        monkeypatch.setattr(module, "run_rows" if name == "decode" else "run_longer",
                            lambda call, out, name=name: ran.append(name))
    case = make_case(seq_lens=[60, 90, 51], q_lens=[1, 40, 1], head_dim=128,
                     dtype=torch.bfloat16, kind=kind)
    call = case.call(max_query_len=hint)
    assert mb.supports(call) is None
    mb.run(call, torch.empty_like(case.query))
    assert ran == ["decode", prefill]
    with pytest.raises(TypeError, match="plan: the mixed_batch backend takes none"):
        mb.run(call, torch.empty_like(case.query), plan=object())


def test_run_works_out_a_signatures_parts_once(mb, monkeypatch):
    """An eager call's parts are cached per call signature (its Geometry) and hints, as the
    registry caches its choice: the checks run on the first call only, and a call with
    other hints is worked out anew."""
    ran, asked = [], []

    def parts(call):
        asked.append(call.max_query_len)
        return (lambda c, out: ran.append("decode"), lambda c, out: ran.append("prefill"))

    monkeypatch.setattr(mb, "parts", parts)
    monkeypatch.setattr(mb, "_PARTS", SignatureCache())
    case = make_case(seq_lens=[60, 90, 51], q_lens=[1, 40, 1], head_dim=128,
                     dtype=torch.bfloat16)
    call = case.call(max_query_len=40)
    out = torch.empty_like(case.query)
    for _ in range(3):
        mb.run(call, out)
    mb.run(call._replace(max_query_len=None), out)
    assert asked == [40, None] and ran == ["decode", "prefill"] * 4


# decode rows beside prompt chunks, or beside speculative decoding's few-token queries
MIXES = {"chunks": ([1, 33, 1, 1, 300, 1], [700, 10, 0, 2000, 90, 1]),
         "drafts": ([1, 4, 1, 3, 4, 1], [700, 10, 0, 2000, 90, 1])}


def _mixed(kind: str, head_dim: int = 128, mix: str = "chunks"):
    q_lens, histories = MIXES[mix]
    return varlen_case(q_lens, histories, num_q_heads=32, num_kv_heads=8, head_dim=head_dim,
                       kind=kind)


@cuda
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
def test_mixed_batches_match_the_reference(mb, kind, head_dim, mix):
    """mixed_batch and the op's own choice against the reference, beside decode rows: prompt
    chunks, and drafts of 3-4 tokens (at head_dim 256 with INT8 V, the Gluon launch whose
    second warpgroup widens V)."""
    from pagedfuse.ops.backends import get_backend, report_for

    case = _mixed(kind, head_dim, mix)
    call = case.call(case.longest, case.longest_query)
    if why := mb.supports(call):
        pytest.skip(f"mixed_batch declines here: {why}")
    want = case.reference()
    assert rel_err(case.run_backend(get_backend("mixed_batch"), None, case.longest,
                                    case.longest_query), want) < 2e-2
    if mix == "chunks":  # (drafts of up to 4 tokens: the CUDA decode's columns may take them)
        assert report_for(call).chosen == "mixed_batch"  # the op's own choice
    got = case.run_op(max_seq_len=case.longest, max_query_len=case.longest_query)
    assert rel_err(got, want) < 2e-2


@cuda
@pytest.mark.parametrize("head_dim", [64, 128])
def test_long_int8_kv_chunks_beside_decode_rows_take_the_dequantized_copy(mb, head_dim):
    """Chunks of DEQUANT_V_FROM tokens and more run on a copy of their own pages (ranked
    among the sequences), a shorter chunk and the decode rows as they are: every row against
    the reference, into NaN, and from a CUDA graph."""
    from pagedfuse.ops.backends import get_backend, gluon_prefill

    case = varlen_case([1, 600, 1, 40, 513, 1], [700, 10, 0, 2000, 90, 1], num_q_heads=32,
                       num_kv_heads=8, head_dim=head_dim, kind="int8_kv")
    call = case.call(case.longest, case.longest_query)
    if why := mb.supports(call):
        pytest.skip(f"mixed_batch declines here: {why}")
    # 1156 tokens: slots for 4 sequences of DEQUANT_V_FROM (256) tokens, 2 filled
    assert gluon_prefill.long_query_slots(call) == 4 and not gluon_prefill.dequantizes_v(call)
    want = case.reference()
    backend = get_backend("mixed_batch")
    assert rel_err(case.run_backend(backend, None, case.longest, case.longest_query),
                   want) < 2e-2
    out = torch.full_like(case.query, float("nan"))
    backend.run(call, out, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.run(call, out, None)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, want) < 2e-2


@cuda
def test_a_windowed_capped_mixed_batch(mb):
    """Windows and soft caps reach both parts (the decode's rows start at their window)."""
    case = varlen_case([1, 33, 1, 300], [700, 10, 2000, 90], num_q_heads=32, num_kv_heads=8,
                       head_dim=128, window_left=64, softcap=30.0)
    from pagedfuse.ops.backends import get_backend

    assert mb.supports(case.call(case.longest, case.longest_query)) is None
    assert rel_err(case.run_backend(get_backend("mixed_batch"), None, case.longest,
                                    case.longest_query), case.reference()) < 2e-2


@cuda
def test_a_mixed_batch_replays_from_a_cuda_graph(mb):
    case = _mixed("int8_k")
    call = case.call(case.longest, case.longest_query)
    if why := mb.supports(call):
        pytest.skip(f"mixed_batch declines here: {why}")
    out = torch.full_like(case.query, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mb.run(call, out)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mb.run(call, out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, case.reference()) < 2e-2

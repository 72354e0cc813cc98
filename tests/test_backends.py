"""The kernel-backend registry: which backend the op picks, forcing one, the support report
from fake tensors, the head-dim answers, check_metadata's cached verdicts, and a toy backend
registered by a test that is chosen, reported and conformance-tested."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from helpers import toy_backend
from helpers.backends import registered, without_backends
from helpers.cases import make_case
from helpers.conformance import GRID, run_case
from torch._subclasses.fake_tensor import FakeTensorMode

import pagedfuse.ops
from pagedfuse import numerics
from pagedfuse.ops import backends
from pagedfuse.ops.call import FLOAT_OP, INT8_OP


def _report(case, **kwargs):
    """support_report of ``case`` on fake copies of its tensors."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        args = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                for k, v in case.op_args().items() if k != "scale"}
        return backends.support_report(case.op, **args, **kwargs)


def test_cpu_calls_take_the_cpu_kernels_and_other_devices_the_reference():
    case = make_case()
    assert backends.choose(case.call()).name == "cpu"
    assert "cpu" in pagedfuse.ops.kernel_devices()
    assert [b.name for b in backends.backends_for("xpu")] == ["reference"]
    assert "xpu" not in pagedfuse.ops.kernel_devices()
    assert pagedfuse.ops.supported_head_dims(FLOAT_OP, "xpu") is None


def test_a_device_without_backends_runs_the_reference():
    case = make_case(kind="int8_kv")
    with without_backends("cpu"):
        assert "cpu" not in pagedfuse.ops.kernel_devices()
        assert pagedfuse.ops.supported_head_dims(INT8_OP, "cpu") is None
        assert backends.choose(case.call()).name == "reference"
        out = case.run_op()
    assert backends.choose(case.call()).name == "cpu"
    assert numerics.rel_err(out, case.reference()) <= 1e-5  # the reference itself, in fp32


def test_head_dims_come_from_the_backends():
    assert pagedfuse.ops.supported_head_dims(INT8_OP, "cpu") == frozenset({64, 128, 256})
    assert 96 in pagedfuse.ops.supported_head_dims(FLOAT_OP, "cpu")
    assert pagedfuse.ops.head_dim_reason(INT8_OP, "cpu", 96) == \
        "head_dim 96 not in {64, 128, 256} for paged_attention_int8 on cpu"
    assert pagedfuse.ops.head_dim_reason(INT8_OP, "cpu", 128) is None


def test_pagedfuse_backend_forces_one(monkeypatch):
    case = make_case(seq_lens=(40, 9), q_lens=(3, 1), causal=True, dtype=torch.bfloat16)
    monkeypatch.setenv("PAGEDFUSE_BACKEND", "reference")
    assert backends.choose(case.call()).name == "reference"
    forced = case.run_op()
    assert numerics.rel_err(forced, case.reference()) <= numerics.kernel_tolerance(
        torch.bfloat16)
    monkeypatch.setenv("PAGEDFUSE_BACKEND", "nonesuch")
    with pytest.raises(ValueError, match="no kernel backend named 'nonesuch' "
                                         r"\(registered: .*cpu.*reference"):
        case.run_op()
    monkeypatch.delenv("PAGEDFUSE_BACKEND")
    assert backends.choose(case.call()).name == "cpu"


def test_a_forced_backend_that_cannot_take_the_call_says_why(monkeypatch):
    with registered(toy_backend.TOY):
        monkeypatch.setenv("PAGEDFUSE_BACKEND", "toy")
        with pytest.raises(ValueError, match="PAGEDFUSE_BACKEND=toy cannot run this call: "
                                             "float32 only"):
            make_case(dtype=torch.bfloat16).run_op()


def test_support_report_from_fake_tensors():
    report = _report(make_case(head_dim=128, kind="int8_kv"), max_query_len=1)
    assert report.chosen == "cpu" and str(report) == "would run cpu"
    report = _report(make_case(head_dim=96, kind="int8_k"))
    assert report.chosen is None
    assert str(report) == "no backend on cpu takes this call: cpu: head_dim 96 not in " \
                          "{64, 128, 256}"


@pytest.mark.skipif("cuda" not in pagedfuse.ops.kernel_devices(),
                    reason="no CUDA backends registered (Triton is not installed)")
def test_support_report_for_cuda_from_fake_tensors():
    """On fake CUDA tensors (no GPU needed): the decode kernel needs a q_len bound of 1,
    the mixed batch sizes that leave room for decode rows beside longer queries, the Gluon
    prefill defers where query lengths may differ, no CUDA backend has head_dim 96, and a
    CPU build (no device to ask) has the prefill kernels name that."""
    from pagedfuse.ops.prefill_plan import NO_CUDA

    with FakeTensorMode():
        query = torch.empty(4, 32, 128, dtype=torch.bfloat16, device="cuda")
        cache = torch.empty(100, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
        table = torch.empty(4, 10, dtype=torch.int32, device="cuda")
        lens = torch.empty(4, dtype=torch.int32, device="cuda")
        starts = torch.empty(5, dtype=torch.int32, device="cuda")
        narrow = torch.empty(4, 32, 96, dtype=torch.bfloat16, device="cuda")
        narrow_cache = torch.empty(100, 16, 8, 96, dtype=torch.bfloat16, device="cuda")
        hinted = backends.support_report(FLOAT_OP, query, cache, cache, table, lens, starts,
                                         max_query_len=1)
        unhinted = backends.support_report(FLOAT_OP, query, cache, cache, table, lens, starts)
        longer = backends.support_report(FLOAT_OP, query.repeat(3, 1, 1), cache, cache, table,
                                         lens, starts)
        odd = backends.support_report(FLOAT_OP, narrow, narrow_cache, narrow_cache, table, lens,
                                      starts, max_query_len=1)
    asked = [n for n in hinted.reasons if n != "cudnn_prefill"]  # where cuDNN's is installed
    assert asked == ["cuda_decode", "mixed_batch", "gluon_prefill", "triton_prefill", "triton"]
    assert longer.reasons["cuda_decode"] == "more than 8 query tokens per sequence"
    assert hinted.reasons["mixed_batch"].startswith("no one-token query can sit beside")
    if torch.cuda.is_available():
        # 4 tokens in 4 sequences, no hint: up to 4 query tokens x 4 heads each, two column
        # groups of the CUDA decode; they may all be decode rows, which the mixed batch gives
        # to the CUDA decode
        assert hinted.chosen == "cuda_decode" and unhinted.chosen == "mixed_batch"
        assert unhinted.reasons["cuda_decode"].startswith(
            "defers: 4 query tokens x 4 query heads take 2 column groups")
        if torch.cuda.get_device_capability() == (9, 0):  # where the Gluon kernel runs
            # it takes queries that may differ with 16-bit K/V (UNEQUAL_FASTER), after
            # mixed_batch (priority 170 against 160)
            assert unhinted.reasons["gluon_prefill"] is None
    else:
        assert hinted.chosen == unhinted.chosen == "triton"
        assert unhinted.reasons["gluon_prefill"] == unhinted.reasons["triton_prefill"] == NO_CUDA
    assert str(odd) == ("no backend on cuda takes this call: " + "; ".join(
        f"{n}: head_dim 96 not in {{64, 128, 256}}" for n in odd.reasons))


def test_a_deferring_backend_is_passed_over_by_the_choice_but_runs_when_forced(monkeypatch):
    """``defers``: the op's own choice asks the next backend, the report says why, and
    PAGEDFUSE_BACKEND still runs it."""
    slower = dataclasses.replace(toy_backend.TOY, name="toy_defers", defers=lambda call: (
        "measured slower on batches" if call.geometry.batch > 1 else None))
    pair, single = make_case(seq_lens=(37, 20)), make_case(seq_lens=(37,))
    toy_backend.runs.clear()
    with registered(slower):
        assert backends.choose(single.call(max_query_len=1)) is slower
        assert backends.choose(pair.call(max_query_len=1)).name == "cpu"
        assert str(_report(pair, max_query_len=1)) == \
            "would run cpu; toy_defers: defers: measured slower on batches"
        monkeypatch.setenv("PAGEDFUSE_BACKEND", "toy_defers")
        out = pair.run_op(max_query_len=1)
        assert len(toy_backend.runs) == 1
        assert numerics.rel_err(out, pair.reference()) <= numerics.KERNEL_RTOL[torch.float32]


def test_toy_backend_is_chosen_reported_and_conformance_tested(monkeypatch):
    decode = make_case(seq_lens=(37, 20, 5))
    prefill = make_case(seq_lens=(37, 20), q_lens=(4, 1), causal=True)
    toy_backend.runs.clear()
    with registered(toy_backend.TOY) as toy:
        assert backends.choose(decode.call()).name == "cpu"  # 3 tokens: maybe not decode
        assert backends.choose(decode.call(max_query_len=1)) is toy
        out = decode.run_op(max_query_len=1)
        assert len(toy_backend.runs) == 1
        assert numerics.rel_err(out, decode.reference()) <= numerics.KERNEL_RTOL[torch.float32]

        assert backends.choose(prefill.call()).name == "cpu"
        prefill.run_op()
        assert len(toy_backend.runs) == 1
        assert str(_report(decode, max_query_len=1)) == "would run toy; cpu: ok"
        assert str(_report(prefill)) == "would run cpu; toy: decode only (max_query_len 1, " \
                                        "or one token per sequence)"
        assert str(_report(make_case(head_dim=128), max_query_len=1)) == \
            "would run cpu; toy: head_dim 128 not in {64}"

        declined = {c.name: run_case(toy, c, "cpu", monkeypatch) for c in GRID}
        taken = [name for name, why in declined.items() if why is None]
        assert "decode-f32-gqa4-d64-p16-hinted" in taken and "decode-f32-gqa16-d64" in taken
        assert declined["decode-f32-gqa4-d64-p16"].startswith("decode only")
        assert declined["decode-bf16-hnd-gqa6-d256"] == "head_dim 256 not in {64}"
        assert declined["int8k-f32-gqa4-d128"] == "no paged_attention_int8 kernel"
    assert backends.choose(decode.call()).name == "cpu"
    with pytest.raises(ValueError, match="no kernel backend named 'toy'"):
        backends.get_backend("toy")


def test_a_new_backend_serves_a_new_head_dim():
    """check_metadata's cached verdicts follow the registry: a head_dim no backend served
    becomes valid while one that serves it is registered."""
    case = make_case(head_dim=48)
    with pytest.raises(ValueError, match="query: head_dim 48 not in"):
        case.run_op()
    wide = backends.Backend(name="toy48", device="cpu", priority=1, head_dims={FLOAT_OP: {48}},
                            run=backends.get_backend("reference").run)
    backends.register_backend(wide)
    try:
        out = case.run_op()
        assert numerics.rel_err(out, case.reference()) <= numerics.KERNEL_RTOL[torch.float32]
    finally:
        backends.unregister_backend("toy48")
    with pytest.raises(ValueError, match="query: head_dim 48 not in"):
        case.run_op()


def test_names_are_unique():
    with pytest.raises(ValueError, match="a backend named 'cpu' is already registered"):
        backends.register_backend(backends.get_backend("cpu"))


def test_cached_verdicts_still_check_each_pointer():
    """A repeated signature skips the metadata checks but not the alignment of each call's
    data pointers."""
    case = make_case(head_dim=64)
    case.run_op()
    buffer = torch.randn(case.query.numel() + 1)
    shifted = buffer[1:].view(case.query.shape)  # 4 bytes off: same shape, same strides
    with pytest.raises(ValueError, match="query: data pointer is not 16-byte aligned"):
        case.with_(query=shifted).run_op()


def test_without_grad_mode_and_with_it_the_result_is_the_same():
    case = make_case(dtype=torch.bfloat16, seq_lens=(40, 9), q_lens=(3, 1), causal=True)
    with torch.inference_mode():
        a = case.run_op()
    with torch.no_grad():
        b = case.run_op()
    c = case.run_op()
    assert torch.equal(a, b) and torch.equal(a, c)


def test_a_call_that_needs_gradients_fails_at_backward():
    case = make_case()
    query = case.query.clone().requires_grad_()
    out = case.with_(query=query).run_op()
    assert out.requires_grad
    assert torch.equal(out.detach(), case.run_op())
    with pytest.raises(RuntimeError, match="pagedfuse::paged_attention has no backward"):
        out.sum().backward()



def test_the_runner_takes_a_backend_at_a_head_dim_the_devices_kernels_lack(monkeypatch):
    """As the reference on CUDA at head_dim 96: the device's kernels serve only 64, yet the
    any-device reference runs the grid's head_dim 96 case through the shared runner."""
    only64 = backends.Backend(name="only64", device="cpu", priority=1,
                              head_dims={FLOAT_OP: {64}}, run=lambda call, out, plan: None)
    case = next(c for c in GRID if c.name == "decode-f32-d96")
    with without_backends("cpu"), registered(only64):
        assert backends.head_dim_reason(FLOAT_OP, "cpu", 96) is not None
        assert run_case(backends.get_backend("reference"), case, "cpu", monkeypatch) is None


def test_a_switch_overridden_for_a_block_is_put_back(monkeypatch):
    """envs.overridden forces a backend for a block and restores the variable as it was,
    unset included, also when the block raises; an undeclared name is refused."""
    from pagedfuse import envs

    monkeypatch.delenv("PAGEDFUSE_BACKEND", raising=False)
    with envs.overridden("PAGEDFUSE_BACKEND", "reference"):
        assert envs.PAGEDFUSE_BACKEND == "reference"
    assert "PAGEDFUSE_BACKEND" not in os.environ
    monkeypatch.setenv("PAGEDFUSE_BACKEND", "cpu")
    with pytest.raises(RuntimeError), envs.overridden("PAGEDFUSE_BACKEND", "reference"):
        raise RuntimeError
    assert envs.PAGEDFUSE_BACKEND == "cpu"
    with envs.overridden("PAGEDFUSE_BACKEND", None):
        assert envs.PAGEDFUSE_BACKEND == "cpu"
    with pytest.raises(ValueError, match="name: 'PAGEDFUSE_BAKEND' is not a declared switch"):
        with envs.overridden("PAGEDFUSE_BAKEND", "cpu"):
            pass

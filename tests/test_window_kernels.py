"""window_left and softcap in the kernels: the CPU C++ kernels (PAGEDFUSE_CPU_ISA=portable and
avx512) against the float64 reference, through the op and straight into a NaN-filled output;
the Triton split-KV kernel on the CPU through Triton's interpreter (a subprocess, since the
interpreter is chosen when Triton kernels are defined); on a GPU (marked ``cuda``) the CUDA
C++ decode and the Triton split-KV kernel through the conformance runner on the window grid,
the decode's split and balanced grids, and the pages they read.

The reference is held to an independent oracle in test_windows_softcap.py. A window must not
only hide the keys before it but leave them unread: the CPU kernel is run on a table whose
pages before every query's window point far outside the cache, the GPU kernels on one whose
pages there hold NaN.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.cases import KINDS, Case, make_case
from helpers.conformance import GridCase, run_case
from helpers.window_cases import (
    DECODE,
    GPU_GRID,
    POISONS,
    WINDOWS,
    distinct_blocks,
    poison_case,
    poisoned_before_windows,
    window_case,
)

from pagedfuse import numerics
from pagedfuse.ops import cpu, cuda_native
from pagedfuse.ops.backends import choose, get_backend

CPU = get_backend("cpu")
TESTS = Path(__file__).parent


@pytest.fixture(params=("portable", "avx512"))
def isa(request, monkeypatch):
    """The ISA, with 4 threads: fewer items than threads, so long contexts are split."""
    if request.param not in cpu.available_isas():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    monkeypatch.setenv("PAGEDFUSE_CPU_ISA", request.param)
    old = torch.get_num_threads()
    torch.set_num_threads(4)
    yield request.param
    torch.set_num_threads(old)


def tolerance(c: Case) -> float:
    if c.key_scale is not None and c.query.dtype == torch.float32:
        return numerics.EXACT_INT8_RTOL
    return numerics.KERNEL_RTOL[c.query.dtype]


def check(c: Case) -> torch.Tensor:
    """The op and the kernel into a NaN-filled output, against the float64 reference."""
    ref = c.reference()
    assert ref.abs().sum() > 0, "degenerate case: the reference is all zeros"
    for how, out in (("op", c.run_op()), ("kernel", c.run_backend(CPU))):
        assert out.dtype == c.query.dtype and out.shape == c.query.shape
        err = numerics.rel_err(out, ref)
        assert err <= tolerance(c), f"{how}: relative error {err:.3g} > {tolerance(c)}"
    return ref


def assert_options_matter(c: Case, ref: torch.Tensor) -> None:
    """The reference without the case's options differs (else ignoring them would pass)."""
    plain = c.with_(window_left=None, softcap=None).reference()
    assert numerics.rel_err(ref, plain) > 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("window", WINDOWS)
def test_windows(isa, window, causal):
    c = window_case(window, causal)
    ref = check(c)
    if window < c.longest:
        assert_options_matter(c, ref)
    else:  # a window longer than every context hides nothing: bit for bit no window
        assert torch.equal(c.run_backend(CPU), c.with_(window_left=None).run_backend(CPU))


@pytest.mark.parametrize("kind", ["float", "int8_k", "int8_kv"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_window_and_softcap_every_cache(isa, kind, layout, dtype):
    c = window_case(16, True, layout=layout, kind=kind, dtype=dtype, softcap=5.0,
                    num_q_heads=12, head_dim=128)
    assert_options_matter(c, check(c))


@pytest.mark.parametrize("cap", [0.5, 50.0])
@pytest.mark.parametrize("bias", [None, "bool", "float"])
def test_softcap(isa, cap, bias):
    c = make_case(seq_lens=(300, 37, 20), q_lens=(3, 5, 1), num_q_heads=8, num_kv_heads=2,
                  head_dim=64, causal=True, bias=bias, softcap=cap, seed=3)
    c = c.with_(query=c.query * 4)  # scores of several units, so a cap of 50 shows too
    assert_options_matter(c, check(c))


def test_q_len_over_chunks_and_groups(isa):
    """256 query rows per item: 40 tokens x 16 heads take three items per sequence, each
    starting at its own first token's window; a group of 8 per KV head."""
    c = make_case(seq_lens=(200, 90), q_lens=(40, 33), num_q_heads=16, num_kv_heads=2,
                  head_dim=64, causal=True, window_left=9, softcap=2.0, seed=5)
    assert_options_matter(c, check(c))


@pytest.mark.parametrize("where", POISONS)
@pytest.mark.parametrize("kind", ["float", "int8_kv"])
def test_non_finite_with_a_window_and_a_cap(isa, kind, where):
    """As SDPA over the capped scores of the keys each row reads: the cap takes +-inf to
    +-softcap (finite), a NaN stays NaN, keys before a row's window never reach it."""
    c = poison_case(where, kind)
    ref = c.reference()
    for out in (c.run_backend(CPU), c.run_op()):
        torch.testing.assert_close(out.double(), ref.double(), rtol=1e-4, atol=1e-4,
                                   equal_nan=True)
    rows = ref[:3].isnan().any(-1).any(-1).tolist()  # sequence 0's three rows
    if "before_window" in where or (kind == "float" and where in ("q_inf", "q_neginf",
                                                                  "k_inf")):
        assert not any(rows), where  # never read, or capped
    elif "first_row_key" in where:
        assert rows == [True, False, False], where
    elif where.startswith("q"):  # a NaN; or an Inf, which the int8 op's query scale carries
        assert rows == [False, True, False], where
    elif where.startswith("bias"):
        assert rows == [True, False, False], where
    else:  # a NaN K, or an infinite int8 K scale (0 x Inf in its row): every row reads it
        assert rows == [True, True, True], where


def test_softcap_of_infinite_scores_without_it_is_nan(isa):
    """The contrast to the test above: without the cap an infinite query makes its row NaN."""
    c = poison_case("q_inf").with_(softcap=None)
    out = c.run_backend(CPU)
    assert out[1].isnan().any() and not out[0].isnan().any()


def test_reads_only_the_windows_pages(tmp_path):
    """Pages wholly before every query's window point 2^40 blocks past the cache, beyond
    the address space: a kernel that touched them (their rows, or for int8 their scales)
    would fault (run in a subprocess, so a fault fails only this test)."""
    script = textwrap.dedent("""
        import os, sys, torch
        sys.path.insert(0, sys.argv[1])
        from helpers.window_cases import distinct_blocks, window_case
        from pagedfuse import numerics
        from pagedfuse.ops import cpu
        from pagedfuse.ops.backends import get_backend
        torch.set_num_threads(4)
        for isa in cpu.available_isas():
            os.environ["PAGEDFUSE_CPU_ISA"] = isa
            for causal, kind in ((False, "float"), (True, "float"), (True, "int8_kv")):
                c = distinct_blocks(window_case(16, causal, seq_lens=(300, 137, 20),
                                                num_blocks=40, kind=kind))
                ref = c.reference()
                table = c.block_table.long()
                for b, (n, q) in enumerate(zip(c.seq_lens.tolist(), (3, 5, 1))):
                    first = n - q + 1 - 16  # the first query's window starts there
                    table[b, : max(first, 0) // 16] = 2**40
                got = c.with_(block_table=table).run_backend(get_backend("cpu"))
                assert numerics.rel_err(got, ref) <= 1e-4, (isa, causal, kind)
        print("read only the windows")
        """)
    path = tmp_path / "window_reads.py"
    path.write_text(script)
    run = subprocess.run([sys.executable, str(path), str(TESTS)], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and "read only the windows" in run.stdout, \
        f"rc {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"


def test_triton_kernel_in_the_interpreter():
    """The Triton split-KV kernel (backend ``triton``) on CPU tensors under
    TRITON_INTERPRET=1: fp32 and fp16, its own split count and 3 splits, the window cases,
    the soft cap, and the non-finite cases (helpers/triton_interpret.py)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "helpers.triton_interpret"], env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode == 0 and run.stdout.startswith("unsupported:"):
        pytest.skip(f"Triton's interpreter cannot run here: {run.stdout.strip()}")
    assert run.returncode == 0 and "checked" in run.stdout, \
        f"rc {run.returncode}\n{run.stdout[-5000:]}\n{run.stderr[-5000:]}"


def test_distinct_blocks_is_a_permutation():
    c = distinct_blocks(make_case(seq_lens=(60, 37), num_blocks=40, block_size=4))
    used = torch.cat([c.block_table[0, :15], c.block_table[1, :10]])
    assert len(set(used.tolist())) == 25 and int(used.max()) < 40
    assert bool((c.block_table[0, 15:] >= 40).all())


# On the GPU. The CUDA C++ decode takes the grid's decode calls, the Triton prefill kernel
# its calls with q_len > 1, the Triton split-KV kernel every call; each must take what it is
# given (a decline fails rather than skips).
GPU_BACKENDS = {"cuda_decode": "decode", "triton_prefill": "qlen", "triton": ""}


def gpu_tolerance(c: Case) -> float:
    """The GPU kernels round P to 16 bits and quantize it per tile for an int8 P·V."""
    return numerics.kernel_tolerance(c.query.dtype, c.call().kind)


def _gpu_params() -> list:
    return [pytest.param(backend, case, id=f"{backend}-{case.name}")
            for case in GPU_GRID for backend, prefix in GPU_BACKENDS.items()
            if case.name.startswith(prefix)]


@pytest.mark.cuda
@pytest.mark.parametrize(("backend", "grid_case"), _gpu_params())
def test_gpu_kernels_match_the_reference(backend, grid_case: GridCase, monkeypatch):
    """Straight into a NaN-filled output and through the op with PAGEDFUSE_BACKEND naming the
    backend, against the float64 reference (helpers.conformance.run_case)."""
    pytest.importorskip("triton")
    why = run_case(get_backend(backend), grid_case, "cuda", monkeypatch)
    assert why is None, f"{backend} declined {grid_case.name}: {why}"


def _gpu_decode_case(kind: str, head_dim: int, window: int | None, softcap: float | None):
    """Eight KV heads with a group of 3; windows that start mid-page and mid-tile, and a
    sequence shorter than the window."""
    return make_case(seq_lens=(700, 45, 301), num_q_heads=24, num_kv_heads=8,
                     head_dim=head_dim, dtype=torch.bfloat16, kind=kind, window_left=window,
                     softcap=softcap, seed=head_dim, device="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_decode_every_grid(kind, head_dim):
    """The CUDA C++ decode with a window of 100 (and a soft cap of 1, and the cap alone), for
    every count of KV heads per CTA, 1 and 3 splits (some splits then hold no key of the
    window) and the balanced grid."""
    pytest.importorskip("triton")
    from pagedfuse.ops.backends import cuda_decode

    backend = get_backend("cuda_decode")
    for window, softcap in ((100, None), (100, 1.0), (None, 1.0)):
        c = _gpu_decode_case(kind, head_dim, window, softcap)
        call = c.call(max_query_len=1)
        ref = c.reference()
        assert_options_matter(c, ref)
        native = cuda_native.kind_of(c.key_cache, c.value_cache)
        for heads in cuda_native.HEADS_PER_CTA:
            config = cuda_decode.native_config(native, head_dim, 8, 3, call.device, heads=heads)
            for splits in (1, 3, cuda_decode.BALANCED):
                plan = backend.make_plan(call, config, splits)
                out = c.run_backend(backend, plan, max_query_len=1)
                err = numerics.rel_err(out, ref)
                assert err <= gpu_tolerance(c), (window, softcap, heads, splits, err)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_kernels_read_only_the_windows_pages(backend, kind):
    """Pages wholly before every query's window hold NaN (poisoned_before_windows): the
    kernels still match the reference of the unpoisoned case, at one split and at several."""
    pytest.importorskip("triton")
    q_lens = DECODE if backend == "cuda_decode" else (3, 5, 1)
    c = distinct_blocks(window_case(16, True, seq_lens=(300, 137, 20), q_lens=q_lens,
                                    num_blocks=40, kind=kind, dtype=torch.bfloat16))
    ref = c.reference()
    c = poisoned_before_windows(c.to("cuda"))
    chosen = get_backend(backend)
    call = c.call(max_query_len=max(q_lens))
    for splits in (1, 4):
        out = c.run_backend(chosen, chosen.make_plan(call, splits=splits),
                            max_query_len=max(q_lens))
        assert numerics.rel_err(out, ref) <= gpu_tolerance(c), splits


@pytest.mark.cuda
def test_windowed_calls_take_the_fast_kernels():
    """A decode call with a window and a cap goes to the CUDA C++ decode by default, and its
    launch plan is the one of a context as long as the window; prompts with them go to the
    prefill kernel, and a prompt beside a decode row to mixed_batch (the two kernels)."""
    pytest.importorskip("triton")
    from pagedfuse.ops.backends import cuda_decode

    c = make_case(seq_lens=(5000, 300), num_q_heads=32, num_kv_heads=8, head_dim=128,
                  dtype=torch.bfloat16, window_left=256, softcap=30.0, device="cuda")
    call = c.call(max_seq_len=5000, max_query_len=1)
    assert choose(call).name == "cuda_decode"
    plan = cuda_decode.make_plan(call)
    short = make_case(seq_lens=(256, 256), num_q_heads=32, num_kv_heads=8, head_dim=128,
                      dtype=torch.bfloat16, device="cuda").call(max_seq_len=256,
                                                                 max_query_len=1)
    assert plan == cuda_decode.make_plan(short)
    spec = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                window_left=256, softcap=30.0, device="cuda")
    prompts = make_case(seq_lens=(5000, 800), q_lens=(700, 700), **spec)
    assert choose(prompts.call(max_query_len=700)).name == "triton_prefill"
    beside_decode = make_case(seq_lens=(5000, 300), q_lens=(700, 1), **spec)
    assert choose(beside_decode.call()).name == "mixed_batch"

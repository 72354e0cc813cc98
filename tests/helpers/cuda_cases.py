"""CUDA cases and backend runs with explicit plans, shared by test_cuda_kernels.py and the
memcheck cases of benchmarks/gpu_check.sh."""

from __future__ import annotations

import torch

from helpers.cases import Case, make_case, random_lengths
from pagedfuse.ops.backends import choose, get_backend, reason


def gpu_case(**spec) -> Case:
    """make_case on CUDA, bf16 unless ``spec`` says otherwise."""
    return make_case(**{"dtype": torch.bfloat16, **spec}, device="cuda")


def lengths(batch: int, page: int = 16) -> list[int]:
    """Random lengths up to a few pages past four, so most end mid-page."""
    return random_lengths(batch, 4 * page + 39, seed=batch)


def run(case: Case, backend: str | None = None, max_seq_len: int | None = None,
        max_query_len: int | None = None, **plan) -> torch.Tensor:
    """``backend`` (default: the op's choice for the call) into a NaN-poisoned output; any
    ``plan`` arguments (config, splits) go to that backend's make_plan."""
    call = case.call(max_seq_len, max_query_len)
    chosen = get_backend(backend) if backend else choose(call)
    if backend:
        assert reason(chosen, call) is None, reason(chosen, call)
    return case.run_backend(chosen, chosen.make_plan(call, **plan) if plan else None,
                            max_seq_len, max_query_len)


def replayed(graph: torch.cuda.CUDAGraph, out: torch.Tensor, n: int) -> list[torch.Tensor]:
    """A copy of the captured output ``out`` after each of ``n`` replays of ``graph``."""
    outs = []
    for _ in range(n):
        graph.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    return outs

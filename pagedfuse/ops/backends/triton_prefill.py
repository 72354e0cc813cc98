"""The Triton prefill kernels (triton_prefill.py) as a backend: CUDA calls with more than one
query token per sequence, bf16/fp16 queries, every cache format. A grid over (head pack,
query tile, sequence) spreads a prompt's tiles over the whole GPU, which the split-KV
``triton`` kernel (one program per sequence and KV head) cannot; it outranks that kernel
wherever it applies, short queries included (H200, q_len 4 at B=64 and 8K keys, llama3
geometry, bf16: 0.61 ms against the split-KV kernel's 6.6 ms), and so takes every call the
CUDA C++ decode cannot prove to be one query token per sequence."""

from __future__ import annotations

import dataclasses

import torch

from pagedfuse.ops.backends.registry import Backend, register_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall, options_missing
from pagedfuse.ops.prefill_plan import HEAD_DIMS, PrefillPlan, default_plan, prefill_unsupported
from pagedfuse.ops.triton_prefill import prefill_into


def make_plan(call: PagedCall, **overrides: object) -> PrefillPlan:
    """The heuristic's plan for ``call`` with ``overrides`` (PrefillPlan's fields) in place:
    how benchmarks pin tiles, warps, stages and the INT8 P·V mode."""
    return dataclasses.replace(default_plan(call), **overrides)


def supports(call: PagedCall) -> str | None:
    return (options_missing(call, "triton_prefill", implemented=("window_left", "softcap"))
            or prefill_unsupported(call))


def run_longer(call: PagedCall, out: torch.Tensor) -> None:
    """The rows of ``call``'s sequences of two or more query tokens (a mixed batch's
    chunks, whose decode rows another kernel serves)."""
    prefill_into(call, out, min_query_len=2)


BACKEND = register_backend(Backend(
    name="triton_prefill", device="cuda", priority=150,
    head_dims={FLOAT_OP: frozenset(HEAD_DIMS), INT8_OP: frozenset(HEAD_DIMS)},
    supports=supports, run=prefill_into, make_plan=make_plan))

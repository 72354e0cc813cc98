"""cuDNN's paged SDPA (cudnn_paged.py) as a backend for the float op's calls with more than
one query token per sequence: bf16/fp16, no attn_bias, no window or soft cap, head_dim
64/128/256 (the head dims every CUDA backend serves, so that the registry's head-dim verdict
stays true for decode too), Hopper or newer. Registered where ``nvidia-cudnn-frontend``
(``pip install pagedfuse[cudnn]``) is installed next to a CUDA build of torch.

Priority 140, below triton_prefill (150) and gluon_prefill (160): on the H200 it took
0.98-1.12x the Gluon kernel's time at head_dim 128 and 0.90-1.00x at 256 with 512 or more
query tokens per sequence, and lost at head_dim 64 and on short queries (docs/library-kernels.md,
benchmarks/results/library_prefill_h200_2026-12-02_with_flashinfer.json); the registry has
no per-call preference yet, so it runs where PAGEDFUSE_BACKEND names it."""

from __future__ import annotations

from pagedfuse.ops.backends.registry import Backend, register_backend
from pagedfuse.ops.call import FLOAT_OP, PagedCall, options_missing
from pagedfuse.ops.cudnn_paged import paged_sdpa_into, unsupported

HEAD_DIMS = frozenset((64, 128, 256))


def supports(call: PagedCall) -> str | None:
    return options_missing(call, "cudnn_prefill") or unsupported(call)


BACKEND = register_backend(Backend(
    name="cudnn_prefill", device="cuda", priority=140, head_dims={FLOAT_OP: HEAD_DIMS},
    supports=supports, run=paged_sdpa_into))

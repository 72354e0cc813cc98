"""cuDNN's paged SDPA (cudnn_paged.py) as a backend for the float op's calls with more than
one query token per sequence: bf16/fp16, no attn_bias, no window or soft cap, head_dim
64/128/256 (the head dims every CUDA backend serves, so that the registry's head-dim verdict
stays true for decode too), Hopper or newer. Registered where ``nvidia-cudnn-frontend``
(``pip install pagedfuse[cudnn]``) is installed next to a CUDA build of torch.

Priority: see docs/design.md's backend table and the measurement it cites
(benchmarks/results/library_prefill_h200_*.json)."""

from __future__ import annotations

from pagedfuse.ops.backends.registry import Backend, register_backend
from pagedfuse.ops.call import FLOAT_OP, PagedCall, options_missing
from pagedfuse.ops.cudnn_paged import paged_sdpa_into, unsupported

HEAD_DIMS = frozenset((64, 128, 256))


def supports(call: PagedCall) -> str | None:
    return options_missing(call, "cudnn_prefill") or unsupported(call)


BACKEND = register_backend(Backend(
    name="cudnn_prefill", device="cuda", priority=160, head_dims={FLOAT_OP: HEAD_DIMS},
    supports=supports, run=paged_sdpa_into))

"""Continuous batching's mixed calls, decode rows beside prompt chunks in one call, as one
backend that runs each part on the kernel built for it, with no host sync: the CUDA C++
decode's grid serves the sequences of one query token and skips the others on the device
(csrc/cuda/paged_decode.cu ``sequence``), then a prefill kernel serves the others and skips
the one-token ones (``min_query_len`` 2): the Gluon kernel where its measured rule takes the
call's longest query (gluon_prefill.slower) and either that length is hinted or its
launches for queries of any length measured as fast (gluon_prefill.takes_unequal_queries:
without the hint the longest query is every token of the batch, and the chunks' real
lengths may be any), else triton_prefill. Run alone, a prefill kernel serves the decode
rows in a packed launch of their own (default_plans), slower than the CUDA decode. An INT8 K
query is quantized by each part, every row of it.

It takes a call only where the sizes leave room for a one-token query beside a longer one
(prefill_plan.may_mix_decode_rows) and the decode takes the call's caches and options.
Priority 170: above the prefill kernels (160, 150); below cuda_decode (200), whose calls
(one query token per sequence) it never takes. The decode runs first: with a decode library
built before it skipped the longer sequences it wrote their first rows, which the prefill
then overwrites.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedfuse.ops.backends import cuda_decode, gluon_prefill, triton_prefill
from pagedfuse.ops.backends.registry import Backend, register_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall
from pagedfuse.ops.prefill_plan import HEAD_DIMS, may_mix_decode_rows
from pagedfuse.ops.signature_cache import SignatureCache

NAME = "mixed_batch"
Part = Callable[[PagedCall, torch.Tensor], None]
# run's parts per call signature (the Geometry, one object per signature of real tensors)
# and hints, as the registry caches its choice: an eager call would otherwise redo the
# parts' checks (about 24 µs on the H200's host, beside a kernel of 0.18 ms at q_len 4)
_PARTS: SignatureCache[tuple, tuple[Part, Part] | str] = SignatureCache()


def parts(call: PagedCall) -> tuple[Part, Part] | str:
    """The decode part and the prefill part of ``call``, or why the backend declines it."""
    if not may_mix_decode_rows(call):
        return "no one-token query can sit beside a longer one (the sizes say so)"
    if why := cuda_decode.rows_unsupported(call):
        return f"the decode rows: cuda_decode: {why}"
    if (gluon_prefill.supports(call) is None and gluon_prefill.slower(call) is None
            and (call.max_query_len is not None or gluon_prefill.takes_unequal_queries(call))):
        return cuda_decode.run_rows, gluon_prefill.run_longer
    if why := triton_prefill.supports(call):
        return f"the longer queries: triton_prefill: {why}"
    return cuda_decode.run_rows, triton_prefill.run_longer


def supports(call: PagedCall) -> str | None:
    found = parts(call)
    return found if isinstance(found, str) else None


def run(call: PagedCall, out: torch.Tensor, plan: object = None) -> None:
    """Each part into ``out``, the decode first (see the module docstring)."""
    if plan is not None:
        raise TypeError("plan: the mixed_batch backend takes none (its parts choose their "
                        "own launches)")
    key = (call.geometry, call.causal, call.max_seq_len, call.max_query_len)
    found = _PARTS.get(key)
    if found is None:
        found = _PARTS.put(key, parts(call))
    if isinstance(found, str):
        raise ValueError(f"mixed_batch cannot run this call: {found}")
    for part in found:
        part(call, out)


_DIMS = frozenset(cuda_decode.HEAD_DIMS) & frozenset(HEAD_DIMS)
BACKEND = register_backend(Backend(
    name=NAME, device="cuda", priority=170, head_dims={FLOAT_OP: _DIMS, INT8_OP: _DIMS},
    supports=supports, run=run))

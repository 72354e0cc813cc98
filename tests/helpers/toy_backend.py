"""A toy kernel backend, as a new backend is written: one module, one registration.

It serves float32 decode calls at head_dim 64 on the CPU with no bias, by an implementation
of its own (gather each sequence's keys, then SDPA), and counts the calls it ran. Tests
register it for their duration and see it chosen, reported and
conformance-tested (helpers.backends.registered)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedfuse.ops.backends import Backend
from pagedfuse.ops.call import FLOAT_OP, PagedCall

runs: list[PagedCall] = []


def supports(call: PagedCall) -> str | None:
    if call.query.dtype != torch.float32:
        return "float32 only"
    if call.attn_bias is not None:
        return "no attn_bias"
    if not call.decode:
        return "decode only (max_query_len 1, or one token per sequence)"
    return None


def run(call: PagedCall, out: torch.Tensor, plan: None = None) -> None:
    runs.append(call)
    page = call.geometry.block_size
    starts = call.query_start_loc.tolist()
    for b, length in enumerate(call.seq_lens.tolist()):
        if starts[b + 1] == starts[b]:
            continue
        blocks = call.block_table[b, : -(-length // page)].long()
        k = call.key_cache[blocks].flatten(0, 1)[:length].transpose(0, 1)  # [Hkv, L, D]
        v = call.value_cache[blocks].flatten(0, 1)[:length].transpose(0, 1)
        q = call.query[starts[b]:starts[b + 1]].transpose(0, 1)  # [Hq, 1, D]
        o = F.scaled_dot_product_attention(q, k, v, scale=call.scale, enable_gqa=True)
        out[starts[b]:starts[b + 1]] = o.transpose(0, 1)


TOY = Backend(name="toy", device="cpu", priority=1000, head_dims={FLOAT_OP: {64}},
              supports=supports, run=run)


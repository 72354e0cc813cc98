"""The pure-torch reference as a backend: any device, any call, one sequence at a time.

It serves devices that have no backend of their own (and any call when forced with
PAGEDFUSE_BACKEND=reference); on a device with kernels the op runs it only for a call using
an option (window_left, softcap) that no kernel of the device implements yet.
"""

from __future__ import annotations

import torch

from pagedfuse.ops.backends.registry import Backend, register_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall
from pagedfuse.ops.reference import paged_attention_reference, quantize_int8_reference


def run(call: PagedCall, out: torch.Tensor, plan: None = None) -> None:
    """``plan``: the reference has no launch choices."""
    out.copy_(paged_attention_reference(
        call.query, call.key_cache, call.value_cache, call.block_table, call.seq_lens,
        call.query_start_loc, call.scale, call.causal, call.attn_bias, call.key_scale,
        call.value_scale, window_left=call.window_left, softcap=call.softcap))


BACKEND = register_backend(Backend(
    name="reference", device=None, priority=0, head_dims={FLOAT_OP: None, INT8_OP: None},
    run=run, quantize=quantize_int8_reference))

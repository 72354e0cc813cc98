"""Context managers that change which kernel runs for one test: the backend registry, the
CPU kernels' instruction set."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from pagedfuse import envs
from pagedfuse.ops.backends import Backend, backends_for, register_backend, unregister_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall, options_missing
from pagedfuse.ops.reference import paged_attention_reference


@contextlib.contextmanager
def registered(backend: Backend) -> Iterator[Backend]:
    """``backend`` registered for the duration."""
    register_backend(backend)
    try:
        yield backend
    finally:
        unregister_backend(backend.name)


def _options_only(call: PagedCall) -> str | None:
    return None if call.options else "serves only calls with window_left or softcap"


def _reference(call: PagedCall, out: torch.Tensor, plan: None = None) -> None:
    out.copy_(paged_attention_reference(
        call.query, call.key_cache, call.value_cache, call.block_table, call.seq_lens,
        call.query_start_loc, call.scale, call.causal, call.attn_bias, call.key_scale,
        call.value_scale, window_left=call.window_left, softcap=call.softcap))


# Takes the calls that use window_left or softcap ahead of the CPU kernels and runs the
# reference, the op's definition: tests hold the rewrite of such sites to eager apart from the
# kernels' rounding (the kernels are held to the reference in test_window_kernels.py).
OPTIONS_STAND_IN = Backend(name="options_stand_in", device="cpu", priority=1000,
                           head_dims={FLOAT_OP: None, INT8_OP: None}, supports=_options_only,
                           run=_reference)


def _no_options(call: PagedCall) -> str | None:
    return options_missing(call, "no_options")


# A CPU kernel backend without window_left and softcap, as a new backend starts out: it takes
# every other call (running the reference) and declines calls that use them with its reason.
# Registered where the device's own kernels are removed (without_backends), the rewrite and
# the op see a device whose kernels lack the options.
NO_OPTIONS = Backend(name="no_options", device="cpu", priority=1000,
                     head_dims={FLOAT_OP: None, INT8_OP: None}, supports=_no_options,
                     run=_reference)


@contextlib.contextmanager
def without_backends(device_type: str) -> Iterator[None]:
    """The device's own backends removed for the duration, so only the reference serves it
    (as on a device that has no kernels)."""
    removed = [unregister_backend(b.name) for b in backends_for(device_type)
               if b.device == device_type]
    try:
        yield
    finally:
        for backend in removed:
            register_backend(backend)


@contextlib.contextmanager
def use_isa(isa: str) -> Iterator[None]:
    """PAGEDFUSE_CPU_ISA=isa for the block (the CPU kernels read it on every call); skips the
    test where this CPU cannot run that path."""
    from pagedfuse.ops import cpu

    if isa not in cpu.available_isas():
        pytest.skip(f"this CPU cannot run the {isa} path")
    with envs.overridden("PAGEDFUSE_CPU_ISA", isa):
        assert cpu.selected_isa() == isa
        yield


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block: enough of them and the CPU kernels
    split a long context and combine the parts."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)

"""The record every kernel backend receives: one validated call of a paged-attention op.

The op checks its arguments once (validate.py) and hands the kernels a ``PagedCall`` instead
of a positional argument list, so a new argument (a window, a soft cap) is one new field here
and every backend sees it by name. The sizes come from shapes only, never from tensor
values, so building the record costs no host synchronisation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

Tensor = torch.Tensor

FLOAT_OP = "paged_attention"
INT8_OP = "paged_attention_int8"


@dataclass(frozen=True, eq=False)
class Geometry:
    """The sizes of a call, read off the shapes (SymInts under a fake trace).

    Compared by identity: for real tensors check_metadata makes one Geometry per call
    signature (every argument's shape, strides, dtype and device) and returns that same
    object for each call with it, so a cache keyed on a Geometry is keyed on the signature.
    """

    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    batch: int
    max_blocks: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads


class PagedCall(NamedTuple):
    """The op's validated arguments, as the schema names them, plus the geometry.

    ``key_scale`` is None for the float op; ``value_scale`` is None unless the value cache is
    int8. ``max_seq_len`` / ``max_query_len`` are optional upper bounds the caller knows
    (the rewrite fills them in); the properties below fall back to shape bounds without them.
    ``seq_lens`` and ``query_start_loc`` are dense (build_call copies strided ones), so a
    kernel may index them as plain arrays. ``window_left`` (keys a query reaches back,
    itself included) and ``softcap`` (scores become softcap * tanh(score / softcap)) are
    None when off; they follow the geometry so that a record written positionally before
    they existed still builds.
    A NamedTuple rather than a frozen dataclass: it is built on every eager call, and a
    tuple builds in a fifth of the time.
    """

    op: str
    query: Tensor
    key_cache: Tensor
    value_cache: Tensor
    key_scale: Tensor | None
    value_scale: Tensor | None
    block_table: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    scale: float
    causal: bool
    attn_bias: Tensor | None
    max_seq_len: int | None
    max_query_len: int | None
    geometry: Geometry
    window_left: int | None = None
    softcap: float | None = None

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def int8_k(self) -> bool:
        return self.key_scale is not None

    @property
    def int8_v(self) -> bool:
        return self.value_cache.dtype == torch.int8

    @property
    def kind(self) -> str:
        """What the caches hold: "int8_kv", "int8_k" (16/32-bit V) or "float"."""
        if not self.int8_k:
            return "float"
        return "int8_kv" if self.int8_v else "int8_k"

    @property
    def query_bound(self) -> int:
        """An upper bound on every sequence's query tokens (the hint, else all of them)."""
        return self.max_query_len if self.max_query_len is not None else \
            self.geometry.num_tokens

    @property
    def context_bound(self) -> int:
        """An upper bound on every sequence's keys (the hint, else the table's capacity)."""
        g = self.geometry
        return self.max_seq_len if self.max_seq_len is not None else \
            g.max_blocks * g.block_size

    @property
    def keys_bound(self) -> int:
        """An upper bound on the keys one sequence's queries read: the context, or with a
        window the window plus the queries after the first (what split-KV grids divide)."""
        if self.window_left is None:
            return self.context_bound
        return min(self.context_bound, self.window_left + self.query_bound - 1)

    @property
    def decode(self) -> bool:
        """At most one query token per sequence, known from the hint or the shapes."""
        return self.query_bound <= 1

    @property
    def options(self) -> tuple[str, ...]:
        """The optional semantics this call switches on, by argument name."""
        return tuple(name for name in OPTIONS if getattr(self, name) is not None)


# Optional semantics a kernel may not implement yet (it declines calls that use them).
OPTIONS = ("window_left", "softcap")


# The soft caps the op takes: every kernel computes c * tanh(s / c) in float32, which these
# keep clear of overflow and denormals.
SOFTCAP_RANGE = (2.0**-100, 2.0**100)


def options_missing(call: PagedCall, kernel: str,
                    implemented: tuple[str, ...] = ()) -> str | None:
    """A backend's ``supports`` answer for the options its ``kernel`` lacks: None when the
    call uses only ``implemented`` ones, else e.g. "window_left: not in the cpu kernel yet"."""
    missing = [name for name in call.options if name not in implemented]
    return f"{', '.join(missing)}: not in the {kernel} kernel yet" if missing else None


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): tile and pad sizes of the launch
    planners, computed on the host without triton.next_power_of_2's constexpr-call cost (a
    few µs per call, paid on every eager launch) and without importing Triton."""
    return 1 << max(n - 1, 0).bit_length()


# Inductor's allocators: a fresh strided tensor without a trip through the dispatcher, which
# torch.empty takes (on the CPU 0.4 µs against torch.empty's 2.1 and empty_like's 0.8). The
# CUDA one allocates on the current device.
_EMPTY_CPU = getattr(torch._C._dynamo.guards, "_empty_strided_cpu", None)
_EMPTY_CUDA = getattr(torch._C._dynamo.guards, "_empty_strided_cuda", None)


@functools.lru_cache(maxsize=1024)
def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape`` (cached: the shapes of a
    model's calls repeat, and the loop costs more than the lookup)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def empty_contiguous(like: Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                     strides: tuple[int, ...] | None = None) -> Tensor:
    """A fresh contiguous tensor of ``shape`` and ``dtype`` on ``like``'s device (``strides``:
    its contiguous strides, where the caller has them): the kernels' outputs, allocated on
    every eager call."""
    if like.is_cpu:
        alloc = _EMPTY_CPU
    elif like.is_cuda and like.get_device() == torch._C._cuda_getDevice():
        alloc = _EMPTY_CUDA
    else:
        alloc = None
    if alloc is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return alloc(shape, contiguous_strides(shape) if strides is None else strides, dtype)

"""CUDA host code of the kernel backends: the split-KV heuristics (all of them), and for the
Triton kernels the query quantization before an INT8 kernel, the partial-result buffers and
the split combine (Triton kernels in triton_paged.py / triton_quantize.py; the CUDA C++
decode launches its own in the same host call as its grid, see cuda_native.decode_into).

Everything a launch needs comes from shapes, strides and the optional int hints, never from
tensor values, so the path has no host synchronisation and captures in CUDA graphs.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from pagedfuse.ops import prefill_plan
from pagedfuse.ops.call import PagedCall, next_power_of_2
from pagedfuse.ops.triton_paged import combine_splits_kernel
from pagedfuse.ops.triton_quantize import quantize_int8

PROGRAMS_PER_SM = 4  # split-KV target for head_dim 128 (see num_kv_splits)
WAVE_FILL = 0.9  # a grid over several waves keeps at least this share of their slots busy
UNDERFILLED = 4 / 3  # wanted splits from here on: one split leaves the GPU short of programs
MIN_TILES_PER_SPLIT = 16  # ... and the fill splits pay off once each keeps this many tiles


class LaunchConfig(NamedTuple):
    """Tile and pipelining choices for one kernel specialisation; ``fill_splits``: the
    splits a long context takes when one split under-fills the GPU (1: no such rule);
    ``resident``: (sequence, KV head) programs that fit on one SM, where known (then the
    split count fills one wave, see num_kv_splits); ``pow2_wave``: that count is a power of
    two (else see wave_splits); ``heads``: KV heads per CTA and ``balanced``: the balanced
    grid rather than splits (the CUDA C++ decode)."""

    block_n: int
    num_warps: int
    num_stages: int
    fill_splits: int = 1
    resident: int = 0
    pow2_wave: bool = True
    heads: int = 1
    balanced: bool = False


sm_count = prefill_plan.sm_count  # the one helper, shared with the Triton-free host rules


def num_kv_splits(batch: int, num_kv_heads: int, head_dim: int, context: int,
                  sm_count: int, config: LaunchConfig) -> int:
    """Splits per sequence, never more than key tiles.

    With ``config.resident`` (the CUDA C++ decode): wave_splits. Otherwise (Triton): a power
    of two so the grid holds about PROGRAMS_PER_SM programs per SM, scaled by
    sqrt(128 / head_dim) (bigger tiles keep more bytes in flight per program). Where 4/3 or
    more splits are wanted but fewer than ``config.fill_splits`` (bf16 at B=64 with 4 KV
    heads on the H200), a long context takes ``fill_splits``: there 1 split under-fills the
    GPU and 2 measured slow, 4 was 3-9% faster. Fitted to the H200's split sweeps
    (2026-11-29/30, benchmarks/tuning/decode_sweeps.py splits and splitcheck)."""
    tiles = -(-context // config.block_n)
    if config.resident:
        return max(1, min(wave_splits(batch * num_kv_heads, config.resident * sm_count,
                                      pow2=config.pow2_wave), tiles))
    target = PROGRAMS_PER_SM * sm_count * math.sqrt(128 / head_dim)
    wanted = max(1.0, target / max(batch * num_kv_heads, 1))
    splits = 1 << int(math.log2(wanted))
    fill = config.fill_splits
    if splits < fill <= tiles // MIN_TILES_PER_SPLIT and wanted >= UNDERFILLED:
        splits = fill
    return max(1, min(splits, tiles))


def wave_splits(programs: int, slots: int, max_splits: int = 8, pow2: bool = True) -> int:
    """Splits for a grid of ``programs`` x splits on a GPU that runs ``slots`` programs at
    once. If one split fits in one wave: the largest power of two that still does, or with
    ``pow2`` False the largest 2^k or 3 * 2^k (not any count: the split combine pads it to
    a power of two, so one just above a power of two doubles the combine's work; on the
    H200 qwen35 INT8 K at B=1 took 28.5 µs with 66 splits, 24.6 with 64). If not:
    the fewest splits whose last wave is at least WAVE_FILL full, since a partial wave idles
    the rest of the GPU for a whole program's time (H200, 2026-11-30, the native sweep: 512
    programs on 396 slots took 416 µs at 1 split, 339 µs at 2 and 319 µs at 3, the rule's
    choice)."""
    if programs <= slots:
        fit = slots // max(programs, 1)
        top = 1 << (fit.bit_length() - 1)
        return top * 3 // 2 if not pow2 and fit >= top * 3 // 2 else top

    def fill(splits: int) -> float:
        work = programs * splits
        return work / (-(-work // slots) * slots)

    return next((s for s in range(1, max_splits + 1) if fill(s) >= WAVE_FILL),
                max(range(1, max_splits + 1), key=fill))


def bias_args(attn_bias: torch.Tensor | None, unused: torch.Tensor):
    """A kernel's view of ``attn_bias``: (tensor, 4-D strides with 0 on broadcast dims, rows,
    cols, is_bool); without a bias the pointer slot gets ``unused`` (never read), so no
    allocation per call."""
    if attn_bias is None:
        return unused, (0, 0, 0, 0), 1, 1, False
    bias = attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))
    strides = tuple(st if n > 1 else 0 for st, n in zip(bias.stride(), bias.shape, strict=True))
    is_bool = bias.dtype == torch.bool
    return (bias.view(torch.uint8) if is_bool else bias), strides, bias.shape[2], \
        bias.shape[3], is_bool


@functools.cache
def pdl_capable(device: torch.device) -> bool:
    """Programmatic dependent launch needs sm_90."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def quantized_query(call: PagedCall) -> tuple[torch.Tensor, torch.Tensor]:
    """The query as int8 with its per-(token, head) scales, for an INT8 K kernel (one small
    kernel that every split shares)."""
    return quantize_int8(call.query)


def partials(call: PagedCall, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 buffers for ``rows`` partial output rows and their log-sum-exps, in one
    allocation."""
    head_dim = call.geometry.head_dim
    parts = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=call.device)
    return parts[: rows * head_dim], parts[rows * head_dim:]


def combine(call: PagedCall, out: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor,
            splits: int, pdl: bool) -> None:
    """Merge ``splits`` partial rows per (token, head) into ``out``; with ``pdl`` launched as
    a programmatic dependent launch that waits in the kernel for the attention grid."""
    geo = call.geometry
    rows = geo.num_tokens * geo.num_q_heads
    combine_splits_kernel[(rows,)](
        part_o, part_lse, out, rows, splits,
        SPLITS_PAD=next_power_of_2(splits), HEAD_DIM=geo.head_dim, WAIT=pdl,
        num_warps=max(1, min(4, geo.head_dim // 64)), launch_pdl=pdl,
    )

"""CUDA kernels of the pagedfuse ops: Triton launches, and the CUDA C++ decode
(cuda_native.py) where it applies; registered at import.

Everything the launch needs comes from shapes, strides and the optional int hints, never
from tensor values, so the path has no host synchronisation and captures in CUDA graphs.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import torch

from pagedfuse.ops import cuda_native
from pagedfuse.ops.library import register_device_kernels
from pagedfuse.ops.triton_paged import LOG2E, combine_splits_kernel, paged_attention_kernel
from pagedfuse.ops.triton_quantize import next_power_of_2, quantize_int8

MIN_ROWS = 16  # tl.dot needs M >= 16: the group's heads are padded up to it
MAX_ROWS = 64  # q_len > 1: query tokens per tile, times the padded group
PROGRAMS_PER_SM = 4  # split-KV target for head_dim 128 (see num_kv_splits)
WAVE_FILL = 0.9  # a grid over several waves keeps at least this share of their slots busy
UNDERFILLED = 4 / 3  # wanted splits from here on: one split leaves the GPU short of programs
MIN_TILES_PER_SPLIT = 16  # ... and the fill splits pay off once each keeps this many tiles
# Programmatic dependent launch on sm_90 (PAGEDFUSE_PDL=0 turns it off, e.g. for a profiler
# that serializes kernels): the CUDA C++ decode may start while quantize_int8 still runs, and
# the split combine while the decode finishes, each waiting in the kernel for what it reads.
PDL = os.environ.get("PAGEDFUSE_PDL", "1") != "0"
BALANCED = 0  # the split count that means the CUDA C++ decode's balanced grid
# PAGEDFUSE_BALANCED=1: the CUDA C++ decode takes its balanced grid rather than fixed splits.
# On the H200 1.4-8x faster on a batch of one long sequence among short ones (not with
# tinyllama's INT8 caches at B=8), up to 1.4% slower on equal lengths at B=64 with KV >= 1 GB
# and up to 24% at B=8 (benchmarks/RESULTS.md, call 72); the lengths are on the device, so
# the op cannot choose per call.
BALANCED_GRID = os.environ.get("PAGEDFUSE_BALANCED", "0") == "1"


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


def launch_config(int8_k: bool) -> LaunchConfig:
    """Keys per tile, warps and pipeline depth: the best of a sweep on the H200 at B=64,
    L=8192 for all three head dims (benchmarks/NOTES-gpu.md). The fill rule is bf16 only:
    the INT8 kernels measured best at the plain rule's 1-2 splits there."""
    return LaunchConfig(128, 4, 2) if int8_k else LaunchConfig(64, 4, 2, fill_splits=4)


def native_config(kind: str, head_dim: int, num_kv_heads: int, batch: int,
                  device: torch.device, heads: int | None = None) -> LaunchConfig:
    """The CUDA C++ decode: ``heads`` KV heads per CTA (by default
    cuda_native.heads_per_cta); block_n is the keys a CTA steps over per head at a time
    (the split heuristic's tile); it has one tile in flight per warp (num_stages 1); resident
    is the variant's CUDA occupancy in (sequence, KV head) programs. INT8 K with a 16-bit V
    fills its one wave closer than a power of two of splits does (wave_splits): on the H200
    at B=8, 6 splits (3 CTAs per SM, 8 KV heads) were 1.7-2.9% faster than 4 and 12
    (tinyllama) as fast as 8, where the same 6 splits cost bf16 10-13%
    (benchmarks/RESULTS.md, calls 36 and 43)."""
    variant = cuda_native.decode_variant(device, kind, head_dim)
    if heads is None:
        heads = cuda_native.heads_per_cta(variant, num_kv_heads, batch, _sm_count(device))
    return LaunchConfig(cuda_native.cta_tokens(variant, heads), variant.warps, 1,
                        resident=variant.resident * heads, pow2_wave=kind != "int8_k",
                        heads=heads, balanced=BALANCED_GRID)


def native_reason(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  key_scale: torch.Tensor | None, value_scale: torch.Tensor | None,
                  block_table: torch.Tensor, attn_bias: torch.Tensor | None,
                  max_query_len: int | None) -> str | None:
    """Why a call cannot take the CUDA C++ decode (None: it can): it needs one query token
    per sequence and no bias, plus cuda_native's own conditions."""
    if attn_bias is not None:
        return "attn_bias"
    if (max_query_len if max_query_len is not None else query.shape[0]) > 1:
        return "more than one query token per sequence"
    group = query.shape[1] // key_cache.shape[2]
    return cuda_native.decode_unsupported(query, key_cache, value_cache, key_scale,
                                          value_scale, block_table, group)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the Triton interpreter on CPU tensors (tests of the kernels' logic)
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def num_kv_splits(batch: int, num_kv_heads: int, head_dim: int, context: int,
                  sm_count: int, config: LaunchConfig) -> int:
    """Splits per sequence, never more than key tiles.

    With ``config.resident`` (the CUDA C++ decode): wave_splits. Otherwise (Triton): a power
    of two so the grid holds about PROGRAMS_PER_SM programs per SM, scaled by
    sqrt(128 / head_dim) (bigger tiles keep more bytes in flight per program). Where 4/3 or
    more splits are wanted but fewer than ``config.fill_splits`` (bf16 at B=64 with 4 KV
    heads on the H200), a long context takes ``fill_splits``: there 1 split under-fills the
    GPU and 2 measured slow, 4 was 3-9% faster. Fitted to the H200 sweeps in NOTES-gpu.md."""
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
    the rest of the GPU for a whole program's time (H200 sweep in NOTES-gpu.md: 512 programs
    on 396 slots took 416 µs at 1 split, 339 µs at 2 and 319 µs at 3, the rule's choice)."""
    if programs <= slots:
        fit = slots // max(programs, 1)
        top = 1 << (fit.bit_length() - 1)
        return top * 3 // 2 if not pow2 and fit >= top * 3 // 2 else top

    def fill(splits: int) -> float:
        work = programs * splits
        return work / (-(-work // slots) * slots)

    return next((s for s in range(1, max_splits + 1) if fill(s) >= WAVE_FILL),
                max(range(1, max_splits + 1), key=fill))


@functools.lru_cache(maxsize=1024)
def balanced_ctas(config: LaunchConfig, variant: cuda_native.Variant, batch: int,
                  num_kv_heads: int, head_dim: int, context: int, sm_count: int) -> int:
    """CTAs of the balanced grid: the split grid's count at the balanced kernel's occupancy,
    one per sequence and group of ``config.heads`` KV heads times num_kv_splits. Then with
    equal lengths each CTA's share is one split's chunk, as in the split grid; one CTA per
    resident slot instead, with shares that start mid-sequence, was slower on the H200 at 17
    of 21 points, by up to 3.9% (benchmarks/RESULTS.md, call 73). Cached per geometry like
    launch_plan, since every eager call of the balanced grid asks for it."""
    balanced = config._replace(resident=variant.balanced_resident * config.heads)
    splits = num_kv_splits(batch, num_kv_heads, head_dim, context, sm_count, balanced)
    return num_kv_heads // config.heads * max(batch, 1) * splits


def _bias_args(attn_bias: torch.Tensor | None, unused: torch.Tensor):
    """(tensor, 4-D strides with 0 on broadcast dims, rows, cols, is_bool); without a bias
    the pointer slot gets ``unused`` (never read), so no allocation per call."""
    if attn_bias is None:
        return unused, (0, 0, 0, 0), 1, 1, False
    bias = attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))
    strides = tuple(st if n > 1 else 0 for st, n in zip(bias.stride(), bias.shape, strict=True))
    is_bool = bias.dtype == torch.bool
    return (bias.view(torch.uint8) if is_bool else bias), strides, bias.shape[2], \
        bias.shape[3], is_bool


class LaunchPlan(NamedTuple):
    """Everything a launch derives from sizes: cached per geometry, so an eager call pays a
    dict lookup for it, not the arithmetic (the host cost is what B=1 eager decode waits on)."""

    group: int
    group_pad: int
    qt: int
    block_m: int
    splits: int
    decode: bool
    config: LaunchConfig


@functools.lru_cache(maxsize=1024)
def launch_plan(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                batch: int, context: int, max_query_len: int | None, sm_count: int,
                config: LaunchConfig) -> LaunchPlan:
    """Tile shape and split count (BALANCED where the config takes the balanced grid) for
    one call's sizes (``context``: longest sequence or its bound, ``max_query_len``: longest
    query or None for "up to num_tokens")."""
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    q_bound = max_query_len if max_query_len is not None else num_tokens
    qt = 1 if q_bound <= 1 else min(next_power_of_2(q_bound), max(1, MAX_ROWS // group_pad))
    block_m = max(MIN_ROWS, qt * group_pad)  # padding rows: qt >= every q_len, so masked
    splits = (BALANCED if config.balanced and batch <= cuda_native.BALANCED_MAX_BATCH else
              num_kv_splits(batch, num_kv_heads, head_dim, context, sm_count, config))
    return LaunchPlan(group, group_pad, qt, block_m, splits, q_bound <= 1, config)


def paged_attention_into(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, key_scale: torch.Tensor | None,
                         value_scale: torch.Tensor | None, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                         causal: bool, attn_bias: torch.Tensor | None, max_seq_len: int | None,
                         max_query_len: int | None, config: LaunchConfig | None = None,
                         splits: int | None = None, native: bool | None = None) -> None:
    """Fill contiguous ``out`` [T, Hq, D]; ``config``/``splits`` override the heuristics
    (the benchmark's sweeps; ``splits`` BALANCED: the CUDA C++ decode's balanced grid).
    ``native``: None takes the CUDA C++ decode wherever it applies
    (on the H200 as fast as the Triton kernel or faster for every cache format and head_dim
    it is built for, bf16 at B >= 8 by 2-14%; benchmarks/RESULTS.md, calls 30-32), False
    always the Triton kernel, True requires the CUDA C++ one."""
    num_tokens, num_q_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = key_cache.shape
    batch, max_blocks = block_table.shape
    int8_k = key_scale is not None
    kind = cuda_native.kind_of(key_cache, value_cache)
    if native is not False:
        reason = native_reason(query, key_cache, value_cache, key_scale, value_scale,
                               block_table, attn_bias, max_query_len)
        if native and reason:
            raise ValueError(f"the CUDA C++ decode cannot run this call: {reason}")
        native = reason is None
    context = max_seq_len if max_seq_len is not None else max_blocks * page
    default = (native_config(kind, head_dim, num_kv_heads, batch, query.device) if native
               else launch_config(int8_k))
    plan = launch_plan(num_tokens, num_q_heads, num_kv_heads, head_dim, batch, context,
                       max_query_len, _sm_count(query.device), config or default)
    splits = plan.splits if splits is None else splits
    if splits == BALANCED and not native:
        raise ValueError("splits=0 (the balanced grid) is the CUDA C++ decode's")
    pdl = PDL and _pdl_capable(query.device)
    # Pointer slots a specialisation does not read get any tensor (Triton needs a pointer).
    q, q_scale = quantize_int8(query, release=pdl and native) if int8_k else (query, query)
    if native and not int8_k and not cuda_native.aligned_rows(q):
        q = query.clone(memory_format=torch.contiguous_format)  # fresh, so aligned
    direct = splits == 1
    heads, ctas, counters = plan.config.heads, 0, None
    if direct:
        part_o = part_lse = out
    else:  # one allocation: the partial rows, then their log-sum-exps
        if splits == BALANCED:  # two pieces per CTA of its heads' query rows
            ctas = balanced_ctas(
                plan.config, cuda_native.decode_variant(query.device, kind, head_dim),
                batch, num_kv_heads, head_dim, context, _sm_count(query.device))
            rows = 2 * ctas * heads * plan.group
            counters = cuda_native.balanced_counters(query.device,
                                                     batch * num_kv_heads // heads)
        else:
            rows = splits * num_tokens * num_q_heads
        parts = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=query.device)
        part_o, part_lse = parts[: rows * head_dim], parts[rows * head_dim:]
    if native:
        cuda_native.decode_into(out, q, q_scale if int8_k else None, key_cache, value_cache,
                                key_scale, value_scale, block_table, seq_lens,
                                query_start_loc, scale * LOG2E, splits, heads, part_o,
                                part_lse,
                                pdl=(cuda_native.PDL_OFF if not pdl else
                                     cuda_native.PDL_AFTER_QUANTIZE if int8_k else
                                     cuda_native.PDL_WAIT_FIRST),
                                ctas=ctas, counters=counters)
    else:
        _launch_triton(plan, splits, out, q, q_scale, key_cache, value_cache, key_scale,
                       value_scale, block_table, seq_lens, query_start_loc, scale, causal,
                       attn_bias, part_o, part_lse)
    if splits > 1:
        combine_splits_kernel[(num_tokens * num_q_heads,)](
            part_o, part_lse, out, num_tokens * num_q_heads, splits,
            SPLITS_PAD=next_power_of_2(splits), HEAD_DIM=head_dim, WAIT=pdl,
            num_warps=max(1, min(4, head_dim // 64)), launch_pdl=pdl,
        )


def _launch_triton(plan: LaunchPlan, splits: int, out, q, q_scale, key_cache, value_cache,
                   key_scale, value_scale, block_table, seq_lens, query_start_loc, scale,
                   causal, attn_bias, part_o, part_lse) -> None:
    """The Triton attention kernel for every call the CUDA C++ decode does not take."""
    num_tokens, _, head_dim = q.shape
    num_blocks, page, num_kv_heads, _ = key_cache.shape
    batch, max_blocks = block_table.shape
    int8_k = key_scale is not None
    v_int8 = value_cache.dtype == torch.int8
    config = plan.config
    ks = key_scale if int8_k else q_scale
    vs = value_scale if value_scale is not None else ks
    bias, bias_strides, bias_rows, bias_cols, bias_bool = _bias_args(attn_bias, out)
    paged_attention_kernel[(batch, num_kv_heads, splits)](
        q, q_scale, key_cache, value_cache, ks, vs, block_table, seq_lens, query_start_loc,
        bias, out, part_o, part_lse,
        scale * LOG2E, num_tokens, num_blocks, max_blocks,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        *(ks.stride() if int8_k else (0, 0, 0)),
        *(vs.stride() if v_int8 else (0, 0, 0)),
        *block_table.stride(), *bias_strides, bias_rows, bias_cols,
        GROUP=plan.group, GROUP_PAD=plan.group_pad, QT=plan.qt, BLOCK_M=plan.block_m,
        BLOCK_N=config.block_n,
        HEAD_DIM=head_dim, PAGE=page, INT8_K=int8_k, V_INT8=v_int8, CAUSAL=causal,
        HAS_BIAS=attn_bias is not None, BIAS_BOOL=bias_bool, DIRECT=splits == 1,
        PRECISION="ieee" if out.dtype == torch.float32 else "tf32", DECODE=plan.decode,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


register_device_kernels("cuda", paged_attention_into, quantize_int8)

"""CUDA kernels of the pagedfuse ops: Triton launches, registered at import.

Everything the launch needs comes from shapes, strides and the optional int hints, never
from tensor values, so the path has no host synchronisation and captures in CUDA graphs.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from pagedfuse.ops.library import register_device_kernels
from pagedfuse.ops.triton_paged import LOG2E, combine_splits_kernel, paged_attention_kernel
from pagedfuse.ops.triton_quantize import next_power_of_2, quantize_int8

MIN_ROWS = 16  # tl.dot needs M >= 16: the group's heads are padded up to it
MAX_ROWS = 64  # q_len > 1: query tokens per tile, times the padded group
PROGRAMS_PER_SM = 4  # split-KV target for head_dim 128 (see num_kv_splits)
UNDERFILLED = 4 / 3  # wanted splits from here on: one split leaves the GPU short of programs
MIN_TILES_PER_SPLIT = 16  # ... and the fill splits pay off once each keeps this many tiles


class LaunchConfig(NamedTuple):
    """Tile and pipelining choices for one kernel specialisation; ``fill_splits``: the
    splits a long context takes when one split under-fills the GPU (1: no such rule)."""

    block_n: int
    num_warps: int
    num_stages: int
    fill_splits: int = 1


def launch_config(int8_k: bool) -> LaunchConfig:
    """Keys per tile, warps and pipeline depth: the best of a sweep on the H200 at B=64,
    L=8192 for all three head dims (benchmarks/NOTES-gpu.md). The fill rule is bf16 only:
    the INT8 kernels measured best at the plain rule's 1-2 splits there."""
    return LaunchConfig(128, 4, 2) if int8_k else LaunchConfig(64, 4, 2, fill_splits=4)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the Triton interpreter on CPU tensors (tests of the kernels' logic)
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_kv_splits(batch: int, num_kv_heads: int, head_dim: int, context: int,
                  sm_count: int, config: LaunchConfig) -> int:
    """Splits per sequence: a power of two so the grid holds about PROGRAMS_PER_SM programs
    per SM, scaled by sqrt(128 / head_dim) (bigger tiles keep more bytes in flight per
    program), and never more splits than key tiles. Where 4/3 or more splits are wanted but
    fewer than ``config.fill_splits`` (bf16 at B=64 with 4 KV heads on the H200), a long
    context takes ``fill_splits``: there 1 split under-fills the GPU and 2 measured slow, 4
    was 3-9% faster. Fitted to the H200 sweeps in NOTES-gpu.md."""
    target = PROGRAMS_PER_SM * sm_count * math.sqrt(128 / head_dim)
    wanted = max(1.0, target / max(batch * num_kv_heads, 1))
    splits = 1 << int(math.log2(wanted))
    tiles = -(-context // config.block_n)
    fill = config.fill_splits
    if splits < fill <= tiles // MIN_TILES_PER_SPLIT and wanted >= UNDERFILLED:
        splits = fill
    return max(1, min(splits, tiles))


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
    """Tile shape and split count for one call's sizes (``context``: longest sequence or its
    bound, ``max_query_len``: longest query or None for "up to num_tokens")."""
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    q_bound = max_query_len if max_query_len is not None else num_tokens
    qt = 1 if q_bound <= 1 else min(next_power_of_2(q_bound), max(1, MAX_ROWS // group_pad))
    block_m = max(MIN_ROWS, qt * group_pad)  # padding rows: qt >= every q_len, so masked
    splits = num_kv_splits(batch, num_kv_heads, head_dim, context, sm_count, config)
    return LaunchPlan(group, group_pad, qt, block_m, splits, q_bound <= 1, config)


def paged_attention_into(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, key_scale: torch.Tensor | None,
                         value_scale: torch.Tensor | None, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                         causal: bool, attn_bias: torch.Tensor | None, max_seq_len: int | None,
                         max_query_len: int | None, config: LaunchConfig | None = None,
                         splits: int | None = None) -> None:
    """Fill contiguous ``out`` [T, Hq, D]; ``config``/``splits`` override the heuristics
    (the benchmark's sweeps)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, page, num_kv_heads, _ = key_cache.shape
    batch, max_blocks = block_table.shape
    int8_k = key_scale is not None
    v_int8 = value_cache.dtype == torch.int8
    context = max_seq_len if max_seq_len is not None else max_blocks * page
    plan = launch_plan(num_tokens, num_q_heads, num_kv_heads, head_dim, batch, context,
                       max_query_len, _sm_count(query.device), config or launch_config(int8_k))
    config = plan.config
    splits = plan.splits if splits is None else splits

    # Pointer slots a specialisation does not read get any tensor (Triton needs a pointer).
    if int8_k:
        q, q_scale = quantize_int8(query)
    else:
        q, q_scale = query, query
    ks = key_scale if int8_k else q_scale
    vs = value_scale if value_scale is not None else ks
    bias, bias_strides, bias_rows, bias_cols, bias_bool = _bias_args(attn_bias, out)
    direct = splits == 1
    if direct:
        part_o = part_lse = out
    else:  # one allocation: the partial rows, then their log-sum-exps
        rows = splits * num_tokens * num_q_heads
        parts = torch.empty(rows * (head_dim + 1), dtype=torch.float32, device=query.device)
        part_o, part_lse = parts[: rows * head_dim], parts[rows * head_dim:]
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
        HAS_BIAS=attn_bias is not None, BIAS_BOOL=bias_bool, DIRECT=direct,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32", DECODE=plan.decode,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if not direct:
        combine_splits_kernel[(num_tokens * num_q_heads,)](
            part_o, part_lse, out, num_tokens * num_q_heads, splits,
            SPLITS_PAD=next_power_of_2(splits), HEAD_DIM=head_dim,
            num_warps=max(1, min(4, head_dim // 64)),
        )


register_device_kernels("cuda", paged_attention_into, quantize_int8)

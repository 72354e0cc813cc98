"""The Triton attention kernel (triton_paged.py) as a backend: every CUDA call at its head
dims, any q_len, attn_bias, every cache format, window_left and softcap; the CUDA C++ decode
outranks it where that applies."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from triton.runtime.errors import OutOfResources, PTXASError

from pagedfuse import envs
from pagedfuse.ops import cuda
from pagedfuse.ops.backends.registry import Backend, register_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall, next_power_of_2, options_missing
from pagedfuse.ops.cuda import LaunchConfig
from pagedfuse.ops.triton_paged import LOG2E, paged_attention_kernel
from pagedfuse.ops.triton_quantize import quantize_int8

HEAD_DIMS = frozenset({64, 128, 256})  # tl.arange needs a power of two; these are tested
MIN_ROWS = 16  # tl.dot needs M >= 16: the group's heads are padded up to it
MAX_ROWS = 64  # q_len > 1: query tokens per tile, times the padded group
# fp32 accumulator registers a thread holds at most: the warps grow with block_m x head_dim.
# At 64 rows x 256 dims, 4 warps hold 128 each, and for sm_90 ptxas spilled 14-20 KB or
# failed to allocate registers at all; 8 warps spill about 3.5 KB.
ACC_REGS = 64


def launch_config(int8_k: bool) -> LaunchConfig:
    """Keys per tile, warps and pipeline depth: the best of a sweep on the H200 at B=64,
    L=8192 for all three head dims (2026-11-29, the tiles sweep of
    benchmarks/tuning/decode_sweeps.py). The fill rule is bf16 only:
    the INT8 kernels measured best at the plain rule's 1-2 splits there."""
    return LaunchConfig(128, 4, 2) if int8_k else LaunchConfig(64, 4, 2, fill_splits=4)


class TritonPlan(NamedTuple):
    """Everything a launch derives from sizes: cached per geometry, so an eager call pays a
    lookup for it, not the arithmetic (the host cost is what B=1 eager decode waits on).
    ``pdl``: the split combine goes as a programmatic dependent launch."""

    group: int
    group_pad: int
    qt: int
    block_m: int
    splits: int
    decode: bool
    config: LaunchConfig
    pdl: bool


@functools.lru_cache(maxsize=1024)
def launch_plan(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                batch: int, context: int, max_query_len: int | None, sm_count: int,
                config: LaunchConfig, pdl: bool) -> TritonPlan:
    """Tile shape and split count for one call's sizes (``context``: longest sequence or its
    bound, ``max_query_len``: longest query or None for "up to num_tokens")."""
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    q_bound = max_query_len if max_query_len is not None else num_tokens
    qt = 1 if q_bound <= 1 else min(next_power_of_2(q_bound), max(1, MAX_ROWS // group_pad))
    block_m = max(MIN_ROWS, qt * group_pad)  # padding rows: qt >= every q_len, so masked
    warps = block_m * head_dim // (32 * ACC_REGS)
    if warps > config.num_warps:
        config = config._replace(num_warps=warps)
    splits = cuda.num_kv_splits(batch, num_kv_heads, head_dim, context, sm_count, config)
    return TritonPlan(group, group_pad, qt, block_m, splits, q_bound <= 1, config, pdl)


def make_plan(call: PagedCall, config: LaunchConfig | None = None,
         splits: int | None = None) -> TritonPlan:
    """The launch of ``call``: the heuristics' choice, or ``config`` / ``splits`` instead
    (the benchmarks' sweeps)."""
    g, device = call.geometry, call.device
    chosen = launch_plan(g.num_tokens, g.num_q_heads, g.num_kv_heads, g.head_dim, g.batch,
                         call.keys_bound, call.max_query_len, cuda.sm_count(device),
                         config or launch_config(call.int8_k),
                         envs.PAGEDFUSE_PDL and cuda.pdl_capable(device))
    if splits is None:
        return chosen
    if splits < 1:
        raise ValueError(f"splits={splits}: the Triton kernel takes 1 or more (0, the "
                         "balanced grid, is the CUDA C++ decode's)")
    return chosen._replace(splits=splits)


# The launch config each kernel specialisation runs with where its plan needs more shared
# memory than the GPU has (head_dim 256 with several query rows per tile; INT8 V at head_dim
# 128 and up, whose V tile is transposed through shared memory) or more registers than
# ptxas can allocate: found by launching, as ptxas decides and GPUs differ (232 KB of shared
# memory per block on the H200, 163 KB on an A100).
_FITTED: dict[tuple, LaunchConfig] = {}


def _smaller(config: LaunchConfig) -> LaunchConfig | None:
    """The next config to try after ``config`` ran out of shared memory or registers: one
    pipeline stage, then half the keys per tile, down to 16 (None: nothing smaller). The
    splits' chunks are rounded to the kernel's own BLOCK_N, so the plan's split count stays
    valid."""
    if config.num_stages > 1:
        return config._replace(num_stages=1)
    if config.block_n > 16:
        return config._replace(block_n=config.block_n // 2)
    return None


def supports(call: PagedCall) -> str | None:
    return options_missing(call, "triton", implemented=("window_left", "softcap"))


def kernel_args(call: PagedCall, out: torch.Tensor, p: TritonPlan, q: torch.Tensor,
                q_scale: torch.Tensor, part_o: torch.Tensor,
                part_lse: torch.Tensor) -> tuple[tuple, dict]:
    """paged_attention_kernel's run-time arguments and constexprs (all but the launch config)
    for ``call`` under plan ``p``: ``q``/``q_scale`` the quantized query with an INT8 K cache
    (else the query twice), ``part_o``/``part_lse`` the partial results (``out`` with one
    split). Run uses them; benchmarks/prefill_asm.py compiles with them offline."""
    g = call.geometry
    key_cache, value_cache = call.key_cache, call.value_cache
    int8_k, v_int8 = call.int8_k, call.int8_v
    # Pointer slots a specialisation does not read get any tensor (Triton needs a pointer).
    ks = call.key_scale if int8_k else q_scale
    vs = call.value_scale if call.value_scale is not None else ks
    bias, bias_strides, bias_rows, bias_cols, bias_bool = cuda.bias_args(call.attn_bias, out)
    # A window as long as the table holds keys hides none: clamped there it stays an int32.
    window = 0 if call.window_left is None else min(call.window_left,
                                                    g.max_blocks * g.block_size)
    args = (
        q, q_scale, key_cache, value_cache, ks, vs, call.block_table, call.seq_lens,
        call.query_start_loc, bias, out, part_o, part_lse,
        call.scale * LOG2E, (call.softcap or 0.0) * LOG2E, window,
        g.num_tokens, g.num_blocks, g.max_blocks,
        q.stride(0), q.stride(1), *key_cache.stride()[:3], *value_cache.stride()[:3],
        *(ks.stride() if int8_k else (0, 0, 0)),
        *(vs.stride() if v_int8 else (0, 0, 0)),
        *call.block_table.stride(), *bias_strides, bias_rows, bias_cols)
    constexprs = dict(
        GROUP=p.group, GROUP_PAD=p.group_pad, QT=p.qt, BLOCK_M=p.block_m,
        HEAD_DIM=g.head_dim, PAGE=g.block_size, INT8_K=int8_k, V_INT8=v_int8,
        CAUSAL=call.causal, HAS_BIAS=call.attn_bias is not None, BIAS_BOOL=bias_bool,
        DIRECT=p.splits == 1,
        PRECISION="ieee" if out.dtype == torch.float32 else "tf32", DECODE=p.decode,
        WINDOW=call.window_left is not None, SOFTCAP=call.softcap is not None)
    return args, constexprs


def run(call: PagedCall, out: torch.Tensor, plan: TritonPlan | None = None) -> None:
    """Fill the contiguous ``out`` [T, Hq, D]: the attention grid (batch, KV heads, splits),
    then the split combine where there are several splits."""
    p = make_plan(call) if plan is None else plan
    g = call.geometry
    q, q_scale = cuda.quantized_query(call) if call.int8_k else (call.query, call.query)
    if p.splits == 1:
        part_o = part_lse = out
    else:
        part_o, part_lse = cuda.partials(call, p.splits * g.num_tokens * g.num_q_heads)
    args, constexprs = kernel_args(call, out, p, q, q_scale, part_o, part_lse)
    key = (out.device, q.dtype, call.value_cache.dtype, out.dtype, p.config,
           *constexprs.values())
    config = _FITTED.get(key, p.config)
    while True:
        try:
            paged_attention_kernel[(g.batch, g.num_kv_heads, p.splits)](
                *args, **constexprs, BLOCK_N=config.block_n, num_warps=config.num_warps,
                num_stages=config.num_stages)
            break
        except (OutOfResources, PTXASError):
            config = _smaller(config)
            if config is None:
                raise
            _FITTED[key] = config
    if p.splits > 1:
        cuda.combine(call, out, part_o, part_lse, p.splits, p.pdl)


BACKEND = register_backend(Backend(
    name="triton", device="cuda", priority=100,
    head_dims={FLOAT_OP: HEAD_DIMS, INT8_OP: HEAD_DIMS}, supports=supports, run=run,
    make_plan=make_plan, quantize=quantize_int8))

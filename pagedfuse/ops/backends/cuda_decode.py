"""The CUDA C++ decode (csrc/cuda/paged_decode.cu, bound in cuda_native.py) as a backend:
up to MAX_QUERY query tokens per sequence, no attn_bias, 16-bit queries, at most MAX_GROUP
query heads per KV head, with window_left and softcap. Where it applies it outranks the
Triton kernel: on the H200 it is as fast or faster for every cache format and head_dim it
is built for, bf16 at B >= 8 by 2-14% (2026-11-30; docs/cuda-decode.md). Short queries
(speculative decoding, multi-token prediction: 2 to MAX_QUERY tokens) run as the MMAs'
columns (cuda_native.Columns); the op's own choice takes them where one CTA per KV head
holds all of a sequence's columns, so each K/V tile is read once (``defers``)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from pagedfuse import envs
from pagedfuse.ops import cuda, cuda_native, triton_quantize
from pagedfuse.ops.backends.registry import Backend, register_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall, options_missing
from pagedfuse.ops.cuda import LaunchConfig
from pagedfuse.ops.signature_cache import SignatureCache

HEAD_DIMS = frozenset(cuda_native.HEAD_DIMS)
BALANCED = 0  # the split count that means the balanced grid


def native_config(kind: str, head_dim: int, num_kv_heads: int, batch: int,
                  device: torch.device, heads: int | None = None,
                  balanced: bool | None = None, tiles: int = 0) -> LaunchConfig:
    """The decode's launch: ``heads`` KV heads per CTA (by default
    cuda_native.heads_per_cta); block_n is the keys a CTA steps over per head at a time
    (the split heuristic's tile); it has one tile in flight per warp (num_stages 1); resident
    is the variant's CUDA occupancy in (sequence, KV head) programs. INT8 K with a 16-bit V
    fills its one wave closer than a power of two of splits does (wave_splits): on the H200
    at B=8, 6 splits (3 CTAs per SM, 8 KV heads) were 1.7-2.9% faster than 4 and 12
    (tinyllama) as fast as 8, where the same 6 splits cost bf16 10-13%
    (2026-11-30, the native sweep). ``balanced`` (default PAGEDFUSE_BALANCED):
    the balanced grid rather than fixed splits, up to its batch limit. ``tiles``: the
    short-query kernel's n-tiles of columns (cuda_native.Columns; 0: the one-token kernel)."""
    return _native_config(kind, head_dim, num_kv_heads, batch, device, heads,
                          envs.PAGEDFUSE_BALANCED if balanced is None else balanced, tiles)


@functools.lru_cache(maxsize=1024)
def _native_config(kind: str, head_dim: int, num_kv_heads: int, batch: int,
                   device: torch.device, heads: int | None, balanced: bool,
                   tiles: int) -> LaunchConfig:
    """native_config's arithmetic, cached: an eager call asks for it every time."""
    variant = cuda_native.decode_variant(device, kind, head_dim, tiles)
    if heads is None:
        heads = cuda_native.heads_per_cta(variant, num_kv_heads, batch, cuda.sm_count(device))
    return LaunchConfig(cuda_native.cta_tokens(variant, heads), variant.warps, 1,
                        resident=variant.resident * heads, pow2_wave=kind != "int8_k",
                        heads=heads, balanced=balanced)


@functools.lru_cache(maxsize=1024)
def balanced_ctas(config: LaunchConfig, variant: cuda_native.Variant, batch: int,
                  num_kv_heads: int, head_dim: int, context: int, sm_count: int) -> int:
    """CTAs of the balanced grid: the split grid's count at the balanced kernel's occupancy,
    one per sequence and group of ``config.heads`` KV heads times num_kv_splits. Then with
    equal lengths each CTA's share is one split's chunk, as in the split grid; one CTA per
    resident slot instead, with shares that start mid-sequence, was slower on the H200 at 17
    of 21 points, by up to 3.9% (2026-11-30, the balanced sweep)."""
    balanced = config._replace(resident=variant.balanced_resident * config.heads)
    splits = cuda.num_kv_splits(batch, num_kv_heads, head_dim, context, sm_count, balanced)
    return num_kv_heads // config.heads * max(batch, 1) * splits


class DecodePlan(NamedTuple):
    """One launch: ``splits`` per sequence (BALANCED: the balanced grid of ``ctas`` CTAs),
    ``config.heads`` KV heads per CTA, ``pdl``: programmatic dependent launches,
    ``columns``: the query tokens per sequence served and their MMA columns."""

    config: LaunchConfig
    splits: int
    ctas: int
    pdl: bool
    columns: cuda_native.Columns = cuda_native.ONE_TOKEN


@functools.lru_cache(maxsize=1024)
def launch_plan(kind: str, num_kv_heads: int, head_dim: int, batch: int, context: int,
                device: torch.device, config: LaunchConfig, splits: int | None,
                pdl: bool) -> DecodePlan:
    """The plan of one geometry: cached, since every eager call asks for it."""
    sms = cuda.sm_count(device)
    if splits is None:
        splits = (BALANCED if config.balanced and batch <= cuda_native.BALANCED_MAX_BATCH else
                  cuda.num_kv_splits(batch, num_kv_heads, head_dim, context, sms, config))
    ctas = 0
    if splits == BALANCED:
        variant = cuda_native.decode_variant(device, kind, head_dim)
        ctas = balanced_ctas(config, variant, batch, num_kv_heads, head_dim, context, sms)
    return DecodePlan(config, splits, ctas, pdl)


# The default plan per call signature (the Geometry), hints and switches: an eager call asks
# for it every time.
_PLANS: SignatureCache[tuple, DecodePlan] = SignatureCache()


def make_plan(call: PagedCall, config: LaunchConfig | None = None,
              splits: int | None = None,
              columns: cuda_native.Columns | None = None) -> DecodePlan:
    """The launch of ``call``: the heuristics' choice, or ``config`` (native_config with a
    chosen ``heads`` and ``tiles``) / ``splits`` (BALANCED: the balanced grid) / ``columns``
    (ONE_TOKEN: its one-token sequences alone) instead. With a window the splits divide
    only the window's keys. Several query tokens per sequence take the split grid, its
    programs counted over the column groups."""
    balanced, pdl = envs.PAGEDFUSE_BALANCED, envs.PAGEDFUSE_PDL
    default = config is None and splits is None and columns is None
    if default:
        key = (call.geometry, call.max_seq_len, call.max_query_len, balanced, pdl)
        found = _PLANS.get(key)
        if found is not None:
            return found
    g, device = call.geometry, call.device
    kind = cuda_native.kind_of(call.key_cache, call.value_cache)
    if columns is None:
        columns = cuda_native.ONE_TOKEN if call.query_bound <= 1 else cuda_native.columns_for(
            call.query_bound, g.group,
            cuda_native.decode_variant(device, kind, g.head_dim).max_column_tiles)
    programs = g.batch * columns.groups  # sequences' CTAs per KV head group and split
    if columns != cuda_native.ONE_TOKEN:
        balanced = False
    chosen = launch_plan(kind, g.num_kv_heads, g.head_dim, programs, call.keys_bound, device,
                         config or native_config(kind, g.head_dim, g.num_kv_heads, programs,
                                                 device, balanced=balanced,
                                                 tiles=columns.tiles),
                         splits, pdl and cuda.pdl_capable(device))._replace(columns=columns)
    if default:
        _PLANS.put(key, chosen)
    return chosen


def supports(call: PagedCall) -> str | None:
    return _unsupported(call, one_token=True)


def rows_unsupported(call: PagedCall) -> str | None:
    """Why the decode grid cannot serve the one-token sequences of ``call`` beside longer
    ones (which it skips on the device: csrc/cuda/paged_decode.cu ``sequence``), or None."""
    return _unsupported(call, one_token=False)


def _unsupported(call: PagedCall, one_token: bool) -> str | None:
    missing = options_missing(call, "cuda_decode", implemented=("window_left", "softcap"))
    if missing:
        return missing
    if call.attn_bias is not None:
        return "attn_bias"
    if one_token:
        bound = call.query_bound
        if not isinstance(bound, int):
            return "query tokens per sequence unknown (dynamic)"
        if bound > cuda_native.MAX_QUERY:
            return f"more than {cuda_native.MAX_QUERY} query tokens per sequence"
    return cuda_native.decode_unsupported(call)


def defers(call: PagedCall) -> str | None:
    """Why the op's own choice leaves a short query (2 to MAX_QUERY tokens per sequence) to
    the prefill kernels: its columns take several column groups, each reading the K/V
    again. On the H200 at B=64, L=8192 (2026-12-03, benchmarks/results/
    probes_h200_2026-12-03_short_heads.json) one group took 0.65-0.99x the Gluon prefill's
    time wherever it was timed (q_len 2 in every cache kind of llama3_8b and tinyllama;
    llama3_8b's INT8 K+V at q_len 4 in two n-tiles: 0.71x), and several groups 0.93-3.7x:
    under 1x only for INT8 K+V in two (qwen35 at q_len 2), 1.15x for llama3_8b's at q_len 8
    in two, 2.3x for qwen35's at q_len 8 in six (0.954 ms against 0.416)."""
    bound = call.query_bound
    if bound <= 1:
        return None
    groups = make_plan(call).columns.groups
    if groups > 1:
        return (f"{bound} query tokens x {call.geometry.group} query heads take {groups} column "
                "groups, each reading the K/V again: the prefill kernels measured faster")
    return None


def _pdl(call: PagedCall, plan: DecodePlan) -> int:
    return (cuda_native.PDL_OFF if not plan.pdl else
            cuda_native.PDL_AFTER_QUANTIZE if call.int8_k else cuda_native.PDL_WAIT_FIRST)


def run(call: PagedCall, out: torch.Tensor, plan: DecodePlan | None = None) -> None:
    """Fill the contiguous ``out`` [T, Hq, D] in one launch call: the query's quantization
    (INT8 K), the decode grid, then the split combine where there are several splits."""
    p = make_plan(call) if plan is None else plan
    cuda_native.decode_into(call, out, p.splits, p.config.heads, pdl=_pdl(call, p), ctas=p.ctas,
                            columns=p.columns)


def run_rows(call: PagedCall, out: torch.Tensor) -> None:
    """The one-token sequences of a batch that also holds longer ones (rows_unsupported
    None): their rows of ``out``, in one split, since a split launch's combine would write
    (and read partials for) every row of the batch. An INT8 K query is quantized for every
    row, the longer sequences' too."""
    p = make_plan(call, splits=1, columns=cuda_native.ONE_TOKEN)
    cuda_native.decode_into(call, out, p.splits, p.config.heads, pdl=_pdl(call, p))


def host_launch(call: PagedCall) -> dict | None:
    """What the C++ host path (csrc/host) launches this call's signature with: the default
    plan's launch record (None: the call stays in Python)."""
    p = make_plan(call)
    return cuda_native.host_launch(call, p.splits, p.config.heads, _pdl(call, p), p.ctas,
                                   p.columns)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8 on CUDA: the library's kernel where it runs on ``x``'s device (one
    launch, where a Triton launch costs several times its host time), else Triton's."""
    if cuda_native.decode_available(x.device):
        return cuda_native.quantize_int8(x)
    return triton_quantize.quantize_int8(x)


def host_quantize(x: torch.Tensor) -> dict | None:
    """The C++ host path's launch of quantize_int8 for x's signature: the library's kernel,
    where it runs on x's device (None: Triton's, in Python)."""
    return cuda_native.host_quantize(x) if cuda_native.decode_available(x.device) else None


BACKEND = register_backend(Backend(
    name="cuda_decode", device="cuda", priority=200,
    head_dims={FLOAT_OP: HEAD_DIMS, INT8_OP: HEAD_DIMS}, supports=supports, run=run,
    make_plan=make_plan, quantize=quantize, host_launch=host_launch,
    host_quantize=host_quantize, defers=defers))

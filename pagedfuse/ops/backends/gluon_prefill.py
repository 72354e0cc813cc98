"""The Gluon prefill kernels (pagedfuse/ops/gluon_prefill.py) as a backend: calls with more
than one query token per sequence on an sm_90 GPU, where the Q·K^T of one key tile overlaps
the softmax of another. One "ws" kernel serves every cache kind: 16-bit K and V (the float
op: a bf16/fp16 Q·K^T), INT8 K with a 16-bit V (an int8 Q·K^T over the query quantized per
(token, head)) and INT8 K+V (V widened to fp16 in shared memory by warps of its own,
P' = p * v_scale in fp16), at head_dim 64, 128 and 256.

Two pipelines (``GluonPlan.pipeline``): "ws", warp-specialized with TMA loads of the pages
(FlashAttention-3's structure; the default wherever the cache's page size and strides allow
TMA boxes, see ``tma_unsupported``), and "cp", one partition with cp.async gathers (any page
size and strides; INT8 K with a 16-bit V at head_dim 128 only). A call whose pages "ws"
cannot load and "cp" does not cover is declined with the TMA reason.

Priority 160, above triton_prefill (150), but the op's own choice takes it only where it
measured faster (``defers``, ``FASTER``, whose comment has the H200's numbers): 16-bit K/V
and INT8 K at every head_dim, INT8 K+V at head_dim 128 and 256, and at 64 for queries of up
to 8 tokens (``FASTER_SHORT``); triton_prefill keeps longer INT8 K+V queries at 64 up to
``DEQUANT_V_FROM`` tokens. Those runs had every sequence's query of one length. INT8 K+V
queries of DEQUANT_V_FROM tokens a sequence and more run on a copy of the call's pages
with V dequantized (``dequantizes_v``; ``triton_pages``), where the INT8 K kernel takes
them; a mixed batch's chunks of that length likewise, on a copy of their own pages
(``run_longer``). The grid sizes its tiles by the longest query (``default_plan``); where
the sizes do not prove the lengths equal (num_tokens = batch x max_query_len, or one
sequence: no length is read), the sequences short enough for the packed tile of one-token
queries get a launch of their own (``default_plans``), as triton_prefill's do, and the main
launch runs over a list of the tiles that have rows (``tile_grid``). The op's choice takes
such a batch only where those launches measured as fast (``UNEQUAL_FASTER``: 16-bit K/V,
and INT8 K at head_dim 128 and 256); elsewhere a batch of queries that may differ stays with
triton_prefill.
PAGEDFUSE_BACKEND=gluon_prefill runs it on every call it supports.

The host-side rules here (which calls it takes, the launch plan) import neither Triton nor
Gluon; the kernel module is imported on the first ``run`` only, so the package imports
where Gluon is missing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import torch

from pagedfuse import envs
from pagedfuse.ops.backends.registry import Backend, register_backend
from pagedfuse.ops.call import FLOAT_OP, INT8_OP, PagedCall, options_missing
from pagedfuse.ops.prefill_plan import (
    NO_CUDA,
    capability,
    packed_first,
    prefill_unsupported,
    sm_count,
)
from pagedfuse.ops.signature_cache import SignatureCache

NAME = "gluon_prefill"
HEAD_DIMS = frozenset((64, 128, 256))
CP_HEAD_DIMS = frozenset((128,))  # "cp": INT8 K with a 16-bit V only
BLOCK_MS = (64, 128)  # one or two consumer warpgroups of 64 rows
BLOCK_NS = (32, 64, 128)
PIPELINES = ("ws", "cp")
# "cp": a buffer for P·V, one for the next Q·K^T, one being filled; "ws": the producer fills
# one while the consumers read the other
MIN_STAGES = {"ws": 2, "cp": 3}
SWIZZLE = 128  # bytes: the shared-memory swizzle of the K/V tiles, and a TMA box's width
# "ws" keys per tile, buffers and whether K and V have rings of their own (kv_rings), by
# (call.kind, head_dim): the fastest of those timed on the H200 that fit sm_90's 227 KB of
# shared memory (2-3 candidates per kind among block_n 32/64/128 x 2-8 buffers, on
# bench_prefill.py's geometries and cases; benchmarks/results/gluon_tiles_h200_2026-12-02.json).
# More, shorter tiles won where only 2-3 buffers fit: a consumer hands each buffer back to
# the producer sooner (16-bit K/V at head_dim 128: 64 x 4 took 0.65-0.79x the time of
# 128 x 2; at 256: 32 x 4 took 0.83-0.90x that of 64 x 2). Separate K and V rings hand the
# K buffer back a tile earlier, which lets 16-bit K/V at head_dim 256 run 64 x 2: 0.89-0.96x
# the time of 32 x 4 (qwen35, all six bench_prefill.py cases); on every other kind's tiles
# they took 0.94-1.11x the time (below 1 only at q_len 64 on tinyllama), and 128 x 2 at
# head_dim 128 gained nothing
# (benchmarks/results/probes_h200_2026-12-02_rings.json). INT8 K+V at head_dim 64 and 128
# takes tiles of 128 keys since its V widening got cheaper (a byte permute): 0.84-0.91x
# the time of 64 x 5 at 64, 0.94-1.00x that of 64 x 4 at 128 (8K and 8 x 2K prompts,
# benchmarks/results/gluon_tiles_h200_2026-12-02_int8_kv.json). The last field, v_loader:
# with 16-bit K/V at head_dim 256 a page of 16 tokens is four TMA boxes per cache (one per
# 128-byte span of its 512-byte rows), and one warp issuing K's and V's took 1.12-1.13x
# the time of pages of 256 (qwen35 8K and 8 x 2K prompts); V loaded by a warp of its own
# took 0.905x and 0.955x the time of the one producer, and elsewhere 1.00-1.23x
# (benchmarks/results/probes_h200_2026-12-02_v_loader.json)
WS_TILES = {
    ("float", 64): (128, 4, False, False), ("int8_k", 64): (128, 4, False, False),
    ("int8_kv", 64): (128, 4, False, False), ("float", 128): (64, 4, False, False),
    ("int8_k", 128): (128, 4, False, False), ("int8_kv", 128): (128, 3, False, False),
    ("float", 256): (64, 2, True, True), ("int8_k", 256): (64, 3, False, False),
    ("int8_kv", 256): (64, 3, False, False),
}
# "ws" registers per thread (setmaxnreg): the producer warp needs few, and a consumer holds
# a 64 x 128 fp32 score tile, P and a 64 x D fp32 accumulator (FA3 gives it 240)
CONSUMER_REGS = 232
PRODUCER_REGS = 40
MIN_REGS = 24  # setmaxnreg's least
REGISTER_FILE = 65536  # 32-bit registers per SM on sm_90
CTAS_PER_SM = (1, 2)  # three (80 registers) did not compile with INT8 V at head_dim 128
# (call.kind, head_dim) where "ws" measured faster than triton_prefill on the H200 at every
# q_len timed (4, 64, 512, 2048, 8192; CUDA graph replays: bench_prefill.py, record
# prefill_h200_2026-12-03_own_tiles.json, and for short queries' tiles at two CTAs per SM
# probes_h200_2026-12-03_ctas_per_sm.json): 16-bit K/V 0.53-0.81x its time at head_dim 128
# and 256, 0.74-0.93x at 64; INT8 K 0.59-0.76x at 128 and 256 (at q_len 4 with
# SHORT_INT8_TILES 0.97x at 128), at 64 0.83-0.96x but 1.06x on eight 2K prompts; INT8 K+V
# 0.60-0.84x at 128 and 256 (q_len 4 at 128: 0.91x). Not INT8 K+V at 64: 0.76x at q_len 4
# but 1.02-1.24x from 64 up (from DEQUANT_V_FROM on the copy it is judged as INT8 K: kernel_kind).
# Those runs had every sequence's query of one length. (Thresholds by q_len, taken from plain
# calls where an eager Gluon call's 0.26 ms of host time hid the kernels under about 0.4 ms,
# once kept short queries on triton_prefill.)
FASTER = frozenset({("float", 64), ("float", 128), ("float", 256), ("int8_k", 64),
                    ("int8_k", 128), ("int8_k", 256), ("int8_kv", 128), ("int8_kv", 256)})
# (call.kind, head_dim) where it measured faster for short queries alone (query_bound up to
# SHORT_QUERY): INT8 K+V at 64, 0.76-0.77x triton_prefill's time at q_len 2, 4 and 8 (B=64,
# L=8192; probes_h200_2026-12-03_short_columns.json, and 0.77x at q_len 4 in
# prefill-subset_h200_2026-12-03_short_columns.json), 1.02-1.24x from q_len 64 up
FASTER_SHORT = frozenset({("int8_kv", 64)})
SHORT_QUERY = 8
# (call.kind, head_dim) where its launches for queries that may differ (a packed launch for
# the short ones, then the main one over its tile list: default_plans, tile_grid) measured
# at least as fast as triton_prefill's at q_len 4, B=64, L=8192 without length hints on the
# H200, the case least in their favour (every query short: long ones gain more, see
# FASTER), by CUDA graph replays in two runs (probes_h200_2026-12-02_tile_list.json):
# 16-bit K/V 0.78x at head_dim 256, 0.82x at 128, 0.90x at 64; INT8 K
# 0.75x at 256 and even at 128 (0.997x and 1.009x). Not INT8 K at 64 (1.06x) nor INT8 K+V
# (1.02-1.04x at 128 over the list, 1.05x without it; 1.22-1.24x at 256)
UNEQUAL_FASTER = frozenset({("float", 64), ("float", 128), ("float", 256), ("int8_k", 128),
                            ("int8_k", 256)})
# INT8 K+V calls of long queries (at least DEQUANT_V_FROM tokens a sequence on average) run
# the INT8 K kernel over a copy of their pages with V dequantized to the query's dtype
# (triton_pages.dequantize_v), where the copy fits PAGEDFUSE_DEQUANT_SCRATCH_MB: the kernel
# then neither widens V tiles in shared memory nor scales each weight by its key's V scale.
# On the H200, copy included, by CUDA graph replays in turns (bench_prefill.py's cases,
# benchmarks/results/probes_h200_2026-12-03_dequant_v.json): 0.72-0.83x the time of the INT8
# K+V kernel at head_dim 128, 0.86-0.91x at 256, 0.80-0.84x at 64 (where it also beat
# triton_prefill's INT8 K+V but on eight 2K prompts, 1.04x: INT8 K's rule at 64), from q_len
# 512 up; the copy took 0.009-0.051 ms there. Below (16 x 128 and 8 x 256 query tokens over
# 4096 keys, probes_h200_2026-12-03_dequant_v_below.json): at q_len 256 0.84-0.96x the
# time at every head_dim (and 0.97x triton_prefill's at 64), at 128 0.89-0.98x but 1.06x at
# head_dim 256, at 64 1.19-1.21x at 128 and 256 (the copy a third of the call's time). Errors
# 1.23-1.27x those of dequantize-then-attend, against the INT8 K+V kernel's 1.21-1.24x (a
# bf16 V: an fp16 one gave the kernel's)
DEQUANT_V_FROM = 256
# Short queries' one-warpgroup tiles (a GQA group's heads x up to 64 // group tokens) with an
# INT8 K cache: keys per tile and buffers, by (call.kind, head_dim), at two CTAs per SM
# (ctas_per_sm 2: 128 registers, no spill). At q_len 4, B=64, L=8192 on the H200, interleaved
# against the one-CTA default (128 x 3-4): INT8 K 0.93x the time at head_dim 128 (0.418 ms,
# 90% of the K/V byte floor) and 0.80x at 64; INT8 K+V 0.88x at 128 (0.409) and 0.69x at 64
# (128 x 2: 0.137 ms; 64 x 3 0.75x). With 16-bit K/V it gained nothing (0.99-1.00x at best,
# the one-CTA tiles at 98% and 82% of the floor already); three CTAs (80 registers) ran out
# of registers at head_dim 128 and gained nothing at 64
# (benchmarks/results/probes_h200_2026-12-03_ctas_per_sm.json; bench_prefill.py --gluon-sweep
# times these choices at its short case)
SHORT_INT8_TILES = {("int8_k", 64): (64, 3), ("int8_k", 128): (64, 3),
                    ("int8_kv", 64): (128, 2), ("int8_kv", 128): (64, 3)}
# Short contexts (every sequence's keys at most TWO_CTA_KEYS: the context bound, the hint or
# the table's capacity) at head_dim 64 with 128-row tiles: keys per tile, buffers and whether
# the rows' sums come from the tensor cores, by call.kind, at two CTAs per SM (80 registers a
# thread at launch: two consumers at 104-112 and the producer's warpgroup at MIN_REGS), so
# that one CTA's start and end (the first tile's loads, the output's store: a quarter of a
# CTA's time on eight 2K prompts) run beside another's key loop. On the H200 (tinyllama,
# CUDA graph replays in turns against one CTA per SM's 128 x 4 with the sums;
# probes_h200_2026-12-03_two_ctas.json), 64 x 3 without the sums: 16-bit K/V 0.83x the time
# on 16 prompts of 1K, 0.92x on eight of 2K, 0.98x on 1K chunks over 1K, 0.99x on four 4K
# prompts; INT8 K 0.78x, 0.85x, 0.89x, 0.91x. Over 8-16K keys (one 8K prompt, chunks) the
# variants timed there took 0.97-1.20x, the longer key loop paying for the registers it lost
# (64 x 3 spills 96-192 bytes a thread; 32-key tiles spill none but carry the loop's fixed
# work twice per key, and trailed 64 x 3 on every short context; 64 x 2 took 1.08-1.47x).
# Head dim 128 does not compile at 80 registers (ptxas asks for 94)
TWO_CTA_KEYS = 4096
TWO_CTA_TILES = {"float": (64, 3, False), "int8_k": (64, 3, False)}
# ... and where a query row reads at most this many keys on average (mean_keys), by kind:
# 16-bit K/V's long key loops lose more to the registers than the overlap of starts and ends
# gains. Timed in turns on the H200 (tinyllama, CUDA graph replays; record
# gluon_ab_h200_2026-12-03_two_ctas_by_keys.json), two CTAs against one took 16-bit K/V
# 0.91x the time at a mean of 1024 keys (eight 2K prompts) and 0.96x at 992 (q_len 64 over
# 1K), 1.00x at 2048 (four 4K prompts), but 1.04-1.11x at 2016 (q_len 64 over 2K) and over
# 4K keys (q_len 64-2048); INT8 K 0.84-0.97x at every mean timed, up to 4064 (q_len 64 over
# 4K)
TWO_CTA_MEAN_KEYS = {"float": 1536, "int8_k": TWO_CTA_KEYS}
# One consumer warpgroup (64 rows) is the launch's default partition and keeps maxnreg's 136
# registers: at head_dim 256 its 64 x 256 fp32 accumulator alone takes 128 of them, and for
# sm_90 ptxas failed ("insufficient registers", 158 wanted) in every cache kind
MAX_HEAD_DIM_64_ROWS = 128
# Buffers where the second warpgroup widens INT8 V (wg1_widens; _plan says why)
WG1_WIDENS_STAGES = 4
# Two KV heads as one (kv_pairs) for 16-bit short queries at these head dims, where a tile of
# one KV head's group would be at most half full, and only where the unpaired tiles (a CTA
# per sequence and KV head) would take more than one CTA per SM: pairing then saves a wave,
# else it leaves SMs idle. On the H200 at head_dim 64 (tinyllama: 32 query heads, 4 KV
# heads, L=8192, q_len 4), in turns against the unpaired default (bench_prefill.py
# --gluon-ab, records gluon_ab_h200_2026-12-03_kv_pairs.json and
# gluon_ab_h200_2026-12-04_kv_pairs_fill.json), by batch (unpaired CTAs on 132 SMs): 0.733x
# the time at B=34 (136), 0.750x at 40, 0.797x at 48 (0.795x at q_len 2), 0.865x at 56,
# 0.921x at 64 (256; 0.919x at q_len 2 and 1); but 1.20x at B=32 (128), 1.29x at 24, 1.30x
# at 16 and 1.33x at 8
PAIRS_HEAD_DIMS = frozenset((64,))


@dataclasses.dataclass(frozen=True)
class GluonPlan:
    """Launch choices: the kernel (``pipeline``, see the module docstring), rows per tile
    (``block_m``, 64 per warpgroup), query heads packed into a tile's rows token-major
    (``pack``, a divisor of the GQA group), keys per step (``block_n``), shared-memory
    buffers per key tile (``stages``), for "ws" whether K and V buffers are released apart
    (``kv_rings``, each with its own barriers) and then whether a warp of its own loads V
    (``v_loader``, beside the producer's K), whether the producer loads the query rows by
    TMA where a view of them allows it (``q_tma``: one head per tile, pack 1; else the
    consumers load them), whether the rows' sums come from the tensor cores (``sum_mma``)
    and the rows' maxima move only past a margin (``lazy_max``), both with a 16-bit V,
    whether each consumer stops at the last key tile its own rows read (``own_tiles``: below
    the diagonal, consumer 0's rows end a tile of 64 keys before consumer 1's), whether the
    grid may run over a list of the tiles that have rows where the sequences' lengths differ
    (``tile_list``, see ``tile_grid``), and the query lengths the launch serves (``min_q``
    to ``max_q``, 0: no upper bound; another launch takes the rest), and the CTAs an SM
    holds at once by their registers (``ctas_per_sm``: 2 caps a CTA's at half the register
    file, so that two short queries' one-warpgroup tiles, or at head_dim 64 two 128-row
    tiles over short contexts, share an SM), and whether the second warpgroup of a 128-row
    launch widens INT8 V for the first's 64 rows (``wg1_widens``: the tile holds 64 rows,
    and consumer 1's warps with a consumer's registers take the widener's place), and
    whether two KV heads of 16-bit caches run as one of twice the head_dim (``kv_pairs``:
    ``pair_view``; ``pack`` then divides the pair's two groups), so that a short query's
    tile is not half empty, and whether a consumer stores its rows by TMA boxes where every
    row is in the query and the query came by TMA, from a buffer of the output's type that
    no one reads any more: the 16-bit query's, or with INT8 K a 16-bit V cache's (``o_tma``;
    else each thread stores its own values)."""

    block_m: int = 128
    pack: int = 1
    block_n: int = 128
    stages: int = 3
    pipeline: str = "ws"
    kv_rings: bool = False
    v_loader: bool = False
    q_tma: bool = True
    sum_mma: bool = False
    lazy_max: bool = False
    own_tiles: bool = True
    tile_list: bool = True
    min_q: int = 0
    max_q: int = 0
    ctas_per_sm: int = 1
    wg1_widens: bool = False
    kv_pairs: bool = False
    o_tma: bool = False

    @property
    def rows(self) -> int:
        """Query rows per tile: ``block_m``, or with ``wg1_widens`` one consumer's 64."""
        return 64 if self.wg1_widens else self.block_m

    @property
    def tokens(self) -> int:
        """Query tokens per tile."""
        return self.rows // self.pack

    @property
    def num_warps(self) -> int:
        """Warps of the launch (for "ws": the default partition, consumer 0)."""
        return 4 if self.pipeline == "ws" else self.block_m // 16

    @property
    def maxnreg(self) -> int:
        """"ws": the launch's registers per thread, so that the partitions' setmaxnreg
        (``worker_regs``) fit the CTA's share of the register file (``ctas_per_sm`` of them);
        consumer 0 gets what the others leave."""
        groups = self.block_m // 64 + 1
        share = ((self.block_m // 64) * CONSUMER_REGS + PRODUCER_REGS) // groups // 8 * 8
        return min(share, REGISTER_FILE // (self.ctas_per_sm * 128 * groups) // 8 * 8)

    @property
    def worker_regs(self) -> tuple[int, int]:
        """"ws": setmaxnreg of consumer 1 (CONSUMER_REGS; none with one consumer) and of the
        producer's warpgroup (PRODUCER_REGS); consumer 0, the launch's default partition, gets
        the CTA's share they leave. Two CTAs of two consumers an SM split what the producer's
        warpgroup leaves at setmaxnreg's least (MIN_REGS) between the consumers."""
        consumers = self.block_m // 64
        if consumers == 1 or self.ctas_per_sm == 1:
            return CONSUMER_REGS, PRODUCER_REGS
        consumer = (self.maxnreg * (consumers + 1) - MIN_REGS) // consumers // 8 * 8
        return consumer, MIN_REGS


@dataclasses.dataclass(frozen=True)
class TileGrid:
    """A launch's query tiles: at most ``per_sequence`` of each sequence, as a grid axis of
    that many beside one of the sequences, or (``listed``) one axis over a list of every
    sequence's tiles that the kernel builds on the device, of at most ``length``."""

    per_sequence: int
    length: int
    listed: bool


def tile_grid(call: PagedCall, plan: GluonPlan, min_query_len: int = 0) -> TileGrid:
    """``plan``'s tile axes for ``call``, its sequences of fewer than ``min_query_len``
    tokens left out: a list where the sizes bound it below a tile per (tile, sequence).
    A sequence of q >= m tokens has ceil(q / tokens) <= (q + tokens - 1) / tokens tiles,
    at most num_tokens // m sequences have m tokens, and their queries hold num_tokens at
    most; so a batch of decode rows beside two 512-token chunks (62 sequences) launches 69
    tiles' CTAs per head instead of 248, most of which would exit at once, one per SM at a
    time (the launch's shared memory takes the SM)."""
    g = call.geometry
    queries = min(call.query_bound, plan.max_q) if plan.max_q else call.query_bound
    per_sequence = -(-queries // plan.tokens)
    full = g.batch * per_sequence
    shortest = max(min_query_len, plan.min_q, 1)
    served = min(g.batch, g.num_tokens // shortest)
    length = min(full, (g.num_tokens + served * (plan.tokens - 1)) // plan.tokens)
    if plan.tile_list and length < full:
        return TileGrid(per_sequence, length, True)
    return TileGrid(per_sequence, full, False)


def default_plan(call: PagedCall) -> GluonPlan:
    """128-row tiles for long queries; shorter ones pack heads of the GQA group into the
    rows (any divisor of the group) and take 64 rows once that holds the longest query (up
    to MAX_HEAD_DIM_64_ROWS).
    The "ws" kernel with WS_TILES' keys and buffers wherever the cache allows its TMA boxes,
    else "cp" (for a call "cp" does not run, ``call_unsupported`` says why)."""
    return _plan(call, call.query_bound)


def default_plans(call: PagedCall) -> tuple[GluonPlan, ...]:
    """The launches ``prefill_into`` makes when given no plan, in order: where the sizes do
    not prove every query equally long, a packed launch for the short ones first
    (prefill_plan.packed_first, as triton_prefill's)."""
    main = default_plan(call)
    g = call.geometry
    if g.batch == 1 or g.num_tokens == g.batch * call.query_bound:
        return (main,)
    return packed_first(main, _plan(call, 1))


# default_plans, checked, per call signature (the Geometry: shapes, strides, dtypes) and
# hint, all they depend on: an eager call would otherwise work them out again, tens of µs of
# host time beside kernels of 0.15 ms at q_len 4
_PLANS: SignatureCache[tuple, tuple[GluonPlan, ...]] = SignatureCache()


def checked_default_plans(call: PagedCall) -> tuple[GluonPlan, ...]:
    """default_plans(call), each through check_plan, once per signature."""
    key = (call.geometry, call.max_query_len)
    found = _PLANS.get(key)
    if found is None:
        found = default_plans(call)
        for plan in found:
            check_plan(call, plan)
        _PLANS.put(key, found)
    return found


def mean_keys(call: PagedCall) -> int:
    """About the keys a query row reads on average in a sequence of the bounds' sizes: the
    context less half the queries, which end it (bottom-right causal); else all of it."""
    if not call.causal or not isinstance(call.query_bound, int):
        return call.context_bound
    return call.context_bound - min(call.query_bound, call.context_bound) // 2


def _plan(call: PagedCall, query_bound: int) -> GluonPlan:
    """default_plan for queries of up to ``query_bound`` tokens."""
    group, queries = call.geometry.group, max(min(query_bound, 128), 1)
    kv_pairs = (call.geometry.head_dim in PAIRS_HEAD_DIMS and 2 * group * queries <= 64
                and call.geometry.batch * call.geometry.num_kv_heads > sm_count(call.device)
                and _pairs_unsupported(call) is None)
    group, head_dim = kernel_heads(call, kv_pairs)
    pack = max(d for d in range(1, group + 1) if group % d == 0 and d * queries <= 128)
    block_n, stages, kv_rings, v_loader = _ws_tiles(call.kind, head_dim)
    rows_fit_64 = pack * queries <= 64
    one_group = rows_fit_64 and head_dim <= MAX_HEAD_DIM_64_ROWS
    # the query by TMA: at a CTA's start the consumers' own loads took 1.5 µs on the H200's
    # eight 2K prompts (llama3_8b), and the boxes 0.96-0.98x the time of every kind but INT8
    # K+V, where they took 1.005-1.03x (benchmarks/results/probes_h200_2026-12-02_q_tma.json).
    # The rows' sums on the tensor cores took 0.92-0.997x the time of the CUDA cores' in
    # every 16-bit V case; lazy maxima 0.95-0.97x at head_dim 256 (with the sums) but
    # 1.00-1.08x at 128 and 64, where the accumulator's rescale they skip is shorter
    # (bench_prefill.py --gluon-ab, gluon_ab_h200_2026-12-02_sum_mma_lazy_max.json)
    v16 = call.kind != "int8_kv"
    # Consumers that stop at their own last key tile took 0.98-0.99x the time on eight 2K
    # prompts with 64-key tiles (qwen35, llama3_8b bf16), 0.95-1.00x elsewhere, outputs
    # bit-identical; but INT8 K+V at head_dim 128, whose 128-key tiles leave consumer 0
    # nothing to skip on these cases, took 1.02-1.04x (probes_h200_2026-12-03_own_tiles.json)
    own_tiles = not (call.kind == "int8_kv" and call.geometry.head_dim == 128)
    # The tile list (where the lengths differ) cut the cost of a launch whose CTAs all exit
    # from 29-40 µs to 9-13 (llama3_8b: 32 x 240 CTAs, 32 x 30 listed) and took the mixed
    # batch from 1.02-1.11x its parts to 1.00-1.05x with a 16-bit V; with INT8 V it took
    # llama3_8b's to 1.14-1.16x against 1.09-1.11x, the same CTAs over a list cut to its
    # real entries taking 0.425 ms against 0.353 alone (not located: their loops compile
    # alike), and 0.97-1.02x elsewhere (probes_h200_2026-12-02_tile_list.json)
    # The output by TMA took 0.94x the time on eight 2K prompts (llama3_8b and qwen35),
    # 0.96x at tinyllama, 0.97-1.00x on the 8K prompt and chunks with 16-bit K/V, from the
    # query's buffer (gluon_ab_h200_2026-12-03_o_tma.json); with INT8 K, whose int8 query's
    # buffer is half the output's size, from a V buffer: 0.92-0.96x on eight 2K prompts,
    # 0.97-0.99x on the 8K prompt, 0.99-1.01x on chunks (gluon_ab_h200_2026-12-04_o_tma_int8_k
    # .json), both in turns on the H200: the rows' own stores had ended each CTA. INT8 V's
    # buffers are int8
    ctas_per_sm, sum_mma = 1, v16
    if one_group and (short := SHORT_INT8_TILES.get((call.kind, call.geometry.head_dim))):
        (block_n, stages), ctas_per_sm = short, 2
    elif (not one_group and call.geometry.head_dim == 64 and call.kind in TWO_CTA_TILES
          and isinstance(call.context_bound, int) and call.context_bound <= TWO_CTA_KEYS
          and mean_keys(call) <= TWO_CTA_MEAN_KEYS[call.kind]):
        (block_n, stages, sum_mma), ctas_per_sm = TWO_CTA_TILES[call.kind], 2
    # INT8 V where one consumer's rows hold the query but one consumer alone does not fit
    # (head_dim 256): the second warpgroup, which would have no rows, widens V with a
    # consumer's registers, where two widener warps at 40 registers had set the pace
    # (qwen35's q_len 4: about 2230 of 2580 cycles a key tile). With four buffers, in turns on
    # the H200 at B=64, L=8192 (qwen35, q_len 2, 4, 8), 0.933-0.960x the time of the widener
    # warps' plan; three buffers 0.99-1.00x (gluon_ab_h200_2026-12-03_wg1_widens.json)
    wg1_widens = call.kind == "int8_kv" and rows_fit_64 and not one_group
    if wg1_widens:
        stages = WG1_WIDENS_STAGES
    plan = GluonPlan(block_m=64 if one_group else 128, pack=pack, block_n=block_n,
                     stages=stages, kv_rings=kv_rings, v_loader=v_loader, q_tma=v16,
                     sum_mma=sum_mma, lazy_max=v16 and head_dim == 256,
                     own_tiles=own_tiles, tile_list=v16, ctas_per_sm=ctas_per_sm,
                     wg1_widens=wg1_widens, kv_pairs=kv_pairs, o_tma=v16)
    if tma_unsupported(call, plan.block_n):
        plan = _as_cp(plan)
    return plan


def _as_cp(plan: GluonPlan) -> GluonPlan:
    """``plan`` on the "cp" pipeline, with its tiles and without what only "ws" has."""
    return dataclasses.replace(plan, pipeline="cp", block_n=128, stages=3, kv_rings=False,
                               v_loader=False, sum_mma=False, lazy_max=False,
                               own_tiles=False, ctas_per_sm=1, wg1_widens=False,
                               kv_pairs=False, o_tma=False)


def _ws_tiles(kind: str, head_dim: int) -> tuple[int, int, bool, bool]:
    """The "ws" kernel's default keys per tile, buffers, kv_rings and v_loader."""
    return WS_TILES.get((kind, head_dim), (128, 3, False, False))


def kernel_heads(call: PagedCall, kv_pairs: bool) -> tuple[int, int]:
    """The GQA group and head_dim of the KV heads the kernel runs: with ``kv_pairs`` two of
    ``call``'s as one (``pair_view``)."""
    pairs = 2 if kv_pairs else 1
    return pairs * call.geometry.group, pairs * call.geometry.head_dim


def pair_view(cache: torch.Tensor) -> torch.Tensor:
    """A cache [blocks, tokens, heads, D] as [blocks, tokens, heads / 2, 2 D]: each two KV
    heads as one (``GluonPlan.kv_pairs``; ``_pairs_unsupported`` says where it cannot be)."""
    return cache.view(*cache.shape[:2], cache.shape[2] // 2, 2 * cache.shape[3])


def _pairs_unsupported(call: PagedCall) -> str | None:
    """Why two KV heads of ``call`` cannot run as one (kv_pairs)."""
    g = call.geometry
    if call.kind != "float":
        return (f"{call.kind} caches: each KV head has scales of its own (kv_pairs takes "
                "16-bit caches)")
    if g.num_kv_heads % 2 or 2 * g.head_dim not in HEAD_DIMS:
        return (f"{g.num_kv_heads} KV heads of head_dim {g.head_dim}: kv_pairs needs an even "
                f"count and twice the head_dim in {sorted(HEAD_DIMS)}")
    for name, cache in (("key_cache", call.key_cache), ("value_cache", call.value_cache)):
        if cache.stride(3) != 1 or cache.stride(2) != g.head_dim:
            return (f"{name}: strides {tuple(cache.stride())}: kv_pairs needs each token's "
                    "heads side by side (head stride = head_dim, unit-stride dims)")
        if why := view_unsupported(name, pair_view(cache)):
            return why
    return None


def _cp_unsupported(call: PagedCall) -> str | None:
    """Why the "cp" kernel cannot run ``call``."""
    if call.kind != "int8_k" or call.geometry.head_dim not in CP_HEAD_DIMS:
        return (f"the cp pipeline runs INT8 K with a 16-bit V at head_dim 128 only, not "
                f"{call.kind} at {call.geometry.head_dim}")
    return None


def tma_rows(cache: torch.Tensor) -> int:
    """Rows of the cache's 2D TMA view: its token stride wide, covering every element."""
    extent = 1 + sum((n - 1) * st for n, st in zip(cache.shape, cache.stride(), strict=True))
    return -(-extent // cache.stride(1))


def swizzle_bytes(cache: torch.Tensor) -> int:
    """The shared-memory swizzle of a cache's tiles, and its TMA boxes' width in bytes: 128,
    or a head's row where that is narrower (64-dim int8: 64)."""
    return min(SWIZZLE, cache.shape[-1] * cache.element_size())


def tma_unsupported(call: PagedCall, block_n: int) -> str | None:
    """Why the "ws" kernel's TMA boxes cannot load ``call``'s pages at ``block_n`` keys per
    tile: a box is min(page, block_n) keys of one head, a whole number of the 128-byte
    swizzle's 8-row atoms, and a page (block, head) must start at a row and column of a 2D
    view whose rows are the cache's tokens."""
    page = call.geometry.block_size
    if page % 8 or (page % block_n and block_n % page):
        return (f"page size {page}: the TMA boxes need a multiple of 8 keys that divides "
                f"or is a multiple of block_n {block_n} (the cp pipeline takes it)")
    for name, cache in (("key_cache", call.key_cache), ("value_cache", call.value_cache)):
        if why := view_unsupported(name, cache):
            return why
    return None


def view_unsupported(name: str, x: torch.Tensor) -> str | None:
    """Why ``x`` [blocks, tokens, heads, D] (a cache, or the query as one block) has no 2D TMA
    view [rows, token stride] in which each (block, head) starts at a row and column: the
    kernels' boxes are one swizzle span wide."""
    sb, st, sh, sd = x.stride()
    size = x.element_size()
    d = x.shape[-1]
    if d * size not in (32, 64) and (d * size) % SWIZZLE:
        return (f"{name}: head_dim {d}: a row of {d * size} bytes is not 32, 64 or a "
                f"multiple of {SWIZZLE} (the TMA boxes' swizzle spans)")
    if sd != 1 or st < 1 or sb % st or (st * size) % 16:
        return (f"{name}: strides {tuple(x.stride())}: a 2D TMA view needs unit-stride heads, "
                "a token stride of whole 16 bytes and a block stride that is a multiple of the "
                "token stride")
    if any((h * sh) % st + d > st for h in range(x.shape[2])):
        return (f"{name}: strides {tuple(x.stride())}: a head's row does not lie in one row "
                "of the token-stride view")
    if tma_rows(x) >= 2**31:
        return f"{name}: {tma_rows(x)} rows: TMA coordinates are 32-bit"
    return None


def make_plan(call: PagedCall, **overrides: object) -> GluonPlan:
    """default_plan with ``overrides`` (GluonPlan's fields) in place, checked (a switch to
    the "cp" pipeline starts from its defaults)."""
    plan = default_plan(call)
    if overrides.get("pipeline") == "cp" and plan.pipeline != "cp":
        plan = _as_cp(plan)
    plan = dataclasses.replace(plan, **overrides)
    check_plan(call, plan)
    return plan


def check_plan(call: PagedCall, plan: GluonPlan) -> None:
    """A plan's rules, with the argument named."""
    if plan.pipeline not in PIPELINES:
        raise ValueError(f"plan: pipeline {plan.pipeline!r} not in {PIPELINES}")
    if plan.pipeline == "cp" and (why := _cp_unsupported(call)):
        raise ValueError(f"plan: {why}")
    if plan.block_m not in BLOCK_MS:
        raise ValueError(f"plan: block_m {plan.block_m} not in {BLOCK_MS}")
    if plan.kv_pairs and plan.pipeline != "ws":
        raise ValueError(f"plan: kv_pairs is for the 'ws' pipeline, not {plan.pipeline!r}")
    if plan.kv_pairs and (why := _pairs_unsupported(call)):
        raise ValueError(f"plan: kv_pairs: {why}")
    group, head_dim = kernel_heads(call, plan.kv_pairs)
    if plan.pipeline == "ws" and plan.block_m == 64 and head_dim > MAX_HEAD_DIM_64_ROWS:
        raise ValueError(f"plan: block_m 64 with pipeline 'ws' runs head_dim up to "
                         f"{MAX_HEAD_DIM_64_ROWS}, not {head_dim} (one consumer's registers "
                         "do not hold its accumulator)")
    if plan.block_n not in BLOCK_NS:
        raise ValueError(f"plan: block_n {plan.block_n} not in {BLOCK_NS}")
    if plan.pack < 1 or group % plan.pack or plan.pack > plan.block_m:
        raise ValueError(f"plan: pack {plan.pack} must divide the GQA group {group} and be "
                         f"<= block_m {plan.block_m}")
    if plan.stages < MIN_STAGES[plan.pipeline]:
        raise ValueError(f"plan: stages {plan.stages} must be >= {MIN_STAGES[plan.pipeline]} "
                         f"for pipeline {plan.pipeline!r}")
    if plan.pipeline == "ws" and (why := tma_unsupported(call, plan.block_n)):
        raise ValueError(f"plan: pipeline 'ws': {why}")
    if plan.kv_rings and plan.pipeline != "ws":
        raise ValueError(f"plan: kv_rings: the {plan.pipeline!r} pipeline has one ring of K "
                         "and V buffers (kv_rings is for 'ws')")
    for flag in ("sum_mma", "lazy_max", "own_tiles", "o_tma"):
        if getattr(plan, flag) and plan.pipeline != "ws":
            raise ValueError(f"plan: {flag} is for the 'ws' pipeline, not {plan.pipeline!r}")
    if plan.sum_mma and call.kind == "int8_kv":
        raise ValueError("plan: sum_mma needs a 16-bit V cache (with INT8 V, P·V takes "
                         "P times the V scales, not P)")
    if plan.lazy_max and call.kind == "int8_kv":
        raise ValueError("plan: lazy_max needs a 16-bit V cache (with INT8 V, weights of "
                         "up to 2**8 times a V scale above 256 overflow P' in fp16)")
    if plan.v_loader and not plan.kv_rings:
        raise ValueError("plan: v_loader needs kv_rings (without them one barrier pair "
                         "serves K and V, which one warp loads)")
    if plan.ctas_per_sm not in CTAS_PER_SM:
        raise ValueError(f"plan: ctas_per_sm {plan.ctas_per_sm} not in {CTAS_PER_SM}")
    if plan.ctas_per_sm > 1 and plan.pipeline != "ws":
        raise ValueError(f"plan: ctas_per_sm {plan.ctas_per_sm} is for the 'ws' pipeline")
    if plan.ctas_per_sm > 1 and plan.block_m == 128 and head_dim != 64:
        raise ValueError(f"plan: ctas_per_sm {plan.ctas_per_sm} with block_m 128 runs head_dim "
                         f"64 only, not {head_dim} (two consumers' accumulators do not fit "
                         "their share of the register file)")
    if plan.ctas_per_sm > 1 and plan.block_m == 128 and plan.block_n > 64:
        raise ValueError(f"plan: ctas_per_sm {plan.ctas_per_sm} with block_m 128 takes block_n "
                         f"up to 64, not {plan.block_n} (a consumer's scores and weights do "
                         "not fit its share of the register file)")
    if plan.wg1_widens and (call.kind != "int8_kv" or plan.pipeline != "ws"
                            or plan.block_m != 128):
        raise ValueError(f"plan: wg1_widens needs an INT8 V cache and the 'ws' pipeline's "
                         f"second warpgroup (block_m 128), not {call.kind} on "
                         f"{plan.pipeline!r} with block_m {plan.block_m}")
    if plan.min_q < 0 or plan.max_q < 0:
        raise ValueError(f"plan: min_q {plan.min_q} and max_q {plan.max_q} must be >= 0 (0: "
                         "no bound)")


@functools.cache
def _gluon_installed() -> bool:
    try:
        return importlib.util.find_spec("triton.experimental.gluon") is not None
    except ModuleNotFoundError:  # no triton (or no triton.experimental) at all
        return False


def call_unsupported(call: PagedCall) -> str | None:
    """Why the kernels cannot run ``call``, from the call alone (no device query): what they
    do not implement. (16-bit caches are in the query's dtype: validate checks that.)"""
    if call.geometry.head_dim not in HEAD_DIMS:
        return (f"head_dim {call.geometry.head_dim}: the gluon_prefill kernel is built for "
                f"{sorted(HEAD_DIMS)}")
    if call.attn_bias is not None:
        return "attn_bias: not in the gluon_prefill kernel"
    cache = (*call.key_cache.shape, *call.key_cache.stride(), *call.value_cache.stride())
    if not all(isinstance(n, int) for n in cache):
        return "cache sizes or strides are dynamic: the TMA views are built from them"
    why = tma_unsupported(call, _ws_tiles(call.kind, call.geometry.head_dim)[0])
    if why and (cp := _cp_unsupported(call)):
        return f"{why}; {cp}"
    return None


def supports(call: PagedCall) -> str | None:
    if why := options_missing(call, NAME):
        return why
    if call.device.type != "cuda":
        return f"device {call.device.type}: Gluon kernels run on CUDA only (no interpreter)"
    if not _gluon_installed():
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if (cap := capability(call.device)) is None:
        return NO_CUDA
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}: the kernel's wgmma needs 9.0 (Hopper)"
    return prefill_unsupported(call) or call_unsupported(call)


def compact_pages(call: PagedCall) -> int:
    """Pages per sequence of ``call``'s dequantized copy: the table's width, or fewer where
    the max_seq_len hint bounds the keys."""
    g = call.geometry
    return min(g.max_blocks, -(-call.context_bound // g.block_size))


def compact_bytes(call: PagedCall, slots: int | None = None) -> int:
    """Bytes of ``call``'s dequantized copy of ``slots`` sequences (default: all): int8 K,
    its scales, V in the query's dtype."""
    g = call.geometry
    per_row = g.head_dim * (1 + call.query.element_size()) + call.key_scale.element_size()
    slots = g.batch if slots is None else slots
    return slots * compact_pages(call) * g.block_size * g.num_kv_heads * per_row


def _copy_fits(call: PagedCall, slots: int) -> bool:
    """An INT8 K+V call of static sizes whose copy of ``slots`` sequences fits the budget."""
    g = call.geometry
    return (call.kind == "int8_kv" and all(isinstance(n, int) for n in (
                g.num_tokens, g.batch, g.max_blocks, call.context_bound))
            and compact_bytes(call, slots) <= envs.PAGEDFUSE_DEQUANT_SCRATCH_MB << 20)


def dequantizes_v(call: PagedCall) -> bool:
    """Whether ``run`` serves ``call`` (INT8 K+V) on a copy of its pages with V dequantized:
    queries of DEQUANT_V_FROM tokens a sequence on average, a copy within the budget."""
    g = call.geometry
    return (_copy_fits(call, g.batch) and g.num_tokens >= DEQUANT_V_FROM * max(g.batch, 1))


def long_query_slots(call: PagedCall) -> int:
    """How many of ``call``'s sequences may have DEQUANT_V_FROM query tokens or more (the
    copy ``run_longer`` makes of those), 0 where it makes none: not INT8 K+V, no such
    sequence possible, or over the budget."""
    g = call.geometry
    if not isinstance(g.num_tokens, int) or g.num_tokens < DEQUANT_V_FROM:
        return 0
    slots = min(g.batch, g.num_tokens // DEQUANT_V_FROM)
    return slots if _copy_fits(call, slots) else 0


def kernel_kind(call: PagedCall) -> str:
    """The cache kind the kernel runs ``call`` as: INT8 K for a dequantized copy."""
    return "int8_k" if dequantizes_v(call) else call.kind


def slower(call: PagedCall) -> str | None:
    """Why the kernel measured no faster than triton_prefill for ``call``'s cache kind (as
    it runs it: kernel_kind) and head_dim (FASTER; FASTER_SHORT for queries of up to
    SHORT_QUERY tokens), or None."""
    g, kind = call.geometry, kernel_kind(call)
    short = isinstance(call.query_bound, int) and call.query_bound <= SHORT_QUERY
    if (kind, g.head_dim) not in FASTER and not (short and (kind, g.head_dim) in FASTER_SHORT):
        return f"{kind} at head_dim {g.head_dim}: triton_prefill measured as fast or faster"
    if not all(isinstance(n, int) for n in (call.query_bound, g.num_tokens, g.batch)):
        return "query sizes are dynamic: equal query lengths cannot be shown"
    return None


def takes_unequal_queries(call: PagedCall) -> bool:
    """Whether its launches for queries that may differ (default_plans) measured as fast as
    triton_prefill's for ``call``'s cache kind and head_dim (UNEQUAL_FASTER)."""
    return (kernel_kind(call), call.geometry.head_dim) in UNEQUAL_FASTER


def defers(call: PagedCall) -> str | None:
    """Why the op's own choice leaves ``call`` to triton_prefill (``slower``, or query
    lengths that may differ where its two launches measured slower), or None."""
    if why := slower(call):
        return why
    g, bound = call.geometry, call.query_bound
    if g.batch > 1 and g.num_tokens != g.batch * bound and not takes_unequal_queries(call):
        return (f"{g.num_tokens} tokens in {g.batch} sequences of up to {bound}: the query "
                "lengths may differ, where it measured slower (UNEQUAL_FASTER)")
    return None


def run(call: PagedCall, out: torch.Tensor, plan: object = None) -> None:
    """The kernel (imported here: Gluon stays out of the package's import), on a dequantized
    copy of an INT8 K+V call's pages where ``dequantizes_v`` says so and no plan is given
    (a plan is one launch of the kernel on the call as it is)."""
    from pagedfuse.ops.gluon_prefill import prefill_into

    if plan is not None and not isinstance(plan, GluonPlan):
        raise TypeError(f"plan: a GluonPlan, got {type(plan).__name__}")
    if plan is None and dequantizes_v(call):
        from pagedfuse.ops.triton_pages import dequantize_v

        call = dequantize_v(call, compact_pages(call), call.geometry.batch)
    prefill_into(call, out, plan)


def run_longer(call: PagedCall, out: torch.Tensor) -> None:
    """The rows of ``call``'s sequences of two or more query tokens (a mixed batch's
    chunks, whose decode rows another kernel serves): the one-token ones' tiles exit at
    once. With INT8 K+V, chunks of DEQUANT_V_FROM tokens and more run on a copy of their
    own pages with V dequantized (``long_query_slots``), the shorter ones as they are."""
    from pagedfuse.ops.gluon_prefill import prefill_into

    slots = long_query_slots(call)
    if not slots:
        prefill_into(call, out, min_query_len=2)
        return
    from pagedfuse.ops.triton_pages import dequantize_v
    from pagedfuse.ops.triton_quantize import quantize_int8

    quantized = quantize_int8(call.query)  # once, for both launches
    prefill_into(call, out, min_query_len=2, max_query_len=DEQUANT_V_FROM - 1,
                 quantized=quantized)
    prefill_into(dequantize_v(call, compact_pages(call), slots, DEQUANT_V_FROM), out,
                 min_query_len=DEQUANT_V_FROM, quantized=quantized)


BACKEND = register_backend(Backend(
    name=NAME, device="cuda", priority=160, head_dims={FLOAT_OP: HEAD_DIMS, INT8_OP: HEAD_DIMS},
    supports=supports, run=run, make_plan=make_plan, defers=defers))

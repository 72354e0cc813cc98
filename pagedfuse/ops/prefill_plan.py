"""Launch planning for the prefill kernels (triton_prefill.py), importable without Triton.

Which calls the prefill kernels take (``prefill_unsupported``), the launch choices of one
call (``PrefillPlan``) and their defaults: a backend registry can ask all of this on a
machine with no GPU and no Triton.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import TypeVar

import torch

from pagedfuse.ops.call import PagedCall, next_power_of_2

Plan = TypeVar("Plan")

HEAD_DIMS = (64, 128, 256)
PV_MODES = ("half", "int8")
# Triton's interpreter runs these kernels on CPU tensors (tests of the logic, no GPU).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class PrefillPlan:
    """Launch choices for one call: rows per tile (``block_m``), query heads packed into a
    tile's rows (``pack``, a divisor of the GQA group), keys per step (``block_n``), warps,
    software-pipeline depth, the INT8 P·V mode (PV_MODES), key ``splits`` (more than 1:
    partial rows merged by a second kernel) and the query lengths the launch serves
    (``min_q`` to ``max_q``, 0: no upper bound; another launch takes the rest)."""

    block_m: int = 128
    pack: int = 1
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    pv: str = "half"
    splits: int = 1
    min_q: int = 0
    max_q: int = 0

    @property
    def tokens(self) -> int:
        """Query tokens per tile."""
        return self.block_m // self.pack


# (head_dim, cache kind) -> (block_m, block_n, num_warps, num_stages) for q_len >= 128: the
# fastest mean over full 8K prefill and 2K chunks of 16K in the H200 sweeps
# (benchmarks/results/prefill_sweep_h200_2026-12-01.json; INT8 rows re-swept after the INT8
# changes in prefill_sweep_h200_2026-12-01_int8.json). INT8 K+V at head_dim 128 takes 64-row
# tiles: two CTAs per SM, 20-25% faster there than 128 rows (which spilled then).
TILES = {
    (64, "float"): (128, 64, 8, 3), (64, "int8_k"): (128, 128, 4, 3),
    (64, "int8_kv"): (128, 128, 4, 3),
    (128, "float"): (128, 128, 8, 2), (128, "int8_k"): (128, 128, 8, 3),
    (128, "int8_kv"): (64, 64, 4, 2),
    (256, "float"): (128, 64, 8, 2), (256, "int8_k"): (128, 64, 8, 3),
    (256, "int8_kv"): (128, 64, 8, 2),
}
# (head_dim, cache kind) -> (block_n, num_stages) of the packed tiles of short queries
# (pack x query tokens <= SHORT_ROWS), 4 warps: the fastest at B=64, L=8192, q_len 4 in the
# short-query sweep of prefill_sweep_h200_2026-12-01_int8.json (memory-bound: the widest
# copy in flight wins, except bf16 at head_dim 128 and 256 and INT8 at 256, where 128-key
# tiles need too much shared memory or ran slower).
SHORT_TILES = {
    (64, "float"): (128, 2), (64, "int8_k"): (128, 2), (64, "int8_kv"): (128, 2),
    (128, "float"): (64, 3), (128, "int8_k"): (128, 2), (128, "int8_kv"): (128, 2),
    (256, "float"): (64, 2), (256, "int8_k"): (64, 3), (256, "int8_kv"): (64, 3),
}


SHORT_ROWS = 64  # rows of a tile for short queries: one warpgroup's wgmma M
# key splits for queries of at most SHORT_ROWS tokens: enough programs for this many per SM,
# each split at least MIN_SPLIT_TILES key tiles long
SPLIT_PROGRAMS_PER_SM = 2
MIN_SPLIT_TILES = 8
MAX_SPLITS = 8


@functools.lru_cache(maxsize=256)
def _default_plan(head_dim: int, group: int, query_bound: int, kind: str) -> PrefillPlan:
    """TILES for long queries. Shorter ones pack heads of the GQA group into the rows
    (token-major, any divisor of the group: a 6-head group packs whole) until a tile holds
    the longest query, down to SHORT_ROWS rows and 4 warps."""
    block_m, block_n, warps, stages = TILES[(head_dim, kind)]
    q = min(max(query_bound, 1), block_m)
    pack = max(d for d in range(1, group + 1) if group % d == 0 and d * q <= block_m)
    rows = max(SHORT_ROWS, min(block_m, next_power_of_2(pack * q)))
    if pack * max(query_bound, 1) <= SHORT_ROWS:
        block_n, stages = SHORT_TILES[(head_dim, kind)]
    return PrefillPlan(rows, pack, block_n, warps if rows == block_m else 4, stages)


def default_plan(call: PagedCall) -> PrefillPlan:
    """The main launch's plan (sizes from shapes and hints): benchmarks pin theirs on it."""
    g = call.geometry
    return _default_plan(g.head_dim, g.group, call.query_bound, call.kind)


@functools.lru_cache(maxsize=256)
def _default_plans(head_dim: int, group: int, query_bound: int, kind: str, batch: int,
                   num_q_heads: int, context: int, sms: int,
                   may_split: bool) -> tuple[PrefillPlan, ...]:
    main = _default_plan(head_dim, group, query_bound, kind)
    plans = packed_first(main, _default_plan(head_dim, group, 1, kind)) if batch > 1 else (main,)
    first = plans[0]
    queries = min(query_bound, first.max_q) if first.max_q else query_bound
    # long queries fill the GPU with query tiles; beside a launch for long ones, the merge
    # would read and write partial rows for every token of the batch (measured on the
    # H200 at 8 x 2048 tokens: 0.49 ms, half the attention's own time)
    if not may_split or queries > SHORT_ROWS or len(plans) > 1:
        return plans
    programs = num_q_heads // first.pack * -(-queries // first.tokens) * batch
    splits = 1
    while (splits < MAX_SPLITS and programs * splits * 2 <= SPLIT_PROGRAMS_PER_SM * sms
           and context >= splits * 2 * MIN_SPLIT_TILES * first.block_n):
        splits *= 2
    return (dataclasses.replace(first, splits=splits), *plans[1:])


def packed_first(main: Plan, short: Plan) -> tuple[Plan, ...]:
    """Launches for a batch whose queries may differ in length: the sequences short enough
    for ``short``'s packed tile (decode rows, draft tokens) in a launch of their own, then
    ``main`` for the rest (in main's tiles each short one would fill a few of the rows of
    one head); ``main`` alone where its tiles hold as many tokens. For any plan type with
    ``tokens``, ``min_q`` and ``max_q`` (PrefillPlan, the Gluon kernel's GluonPlan)."""
    if main.tokens <= short.tokens:
        return (main,)
    return (dataclasses.replace(short, max_q=short.tokens),
            dataclasses.replace(main, min_q=short.tokens + 1))


def default_plans(call: PagedCall, min_query_len: int = 0) -> tuple[PrefillPlan, ...]:
    """The launches ``prefill_into`` makes when given no plan, in order: where sequences of
    a few query tokens may share the batch with long ones, a packed launch for the short
    ones first, with key splits where the grid would leave SMs idle (never beside another
    kernel's rows: ``min_query_len`` > 0)."""
    g = call.geometry
    return _default_plans(g.head_dim, g.group, call.query_bound, call.kind, g.batch,
                          g.num_q_heads, call.context_bound, sm_count(call.device),
                          min_query_len == 0)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def capability(device: torch.device) -> tuple[int, int] | None:
    """A CUDA device's compute capability; None where this torch has no CUDA (a support report
    on fake CUDA tensors in a CPU build), which the kernels' checks then name."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


NO_CUDA = "no CUDA device here to ask for its compute capability"


@functools.cache
def sm_count(device: torch.device) -> int:
    """A device's multiprocessors, which the grids are sized by (here, where no kernel
    module is imported; ops/cuda.py uses it too)."""
    if device.type != "cuda":
        return 8  # the Triton interpreter on CPU tensors (tests of the kernels' logic)
    return torch.cuda.get_device_properties(device).multi_processor_count


def may_mix_decode_rows(call: PagedCall) -> bool:
    """Whether ``call``'s sizes leave room for a one-token query beside a longer one: several
    sequences, and fewer tokens than each holding the longest query (sizes a trace made
    dynamic prove nothing either way: no). The prefill backend then gives the one-token
    rows to the CUDA decode where that takes them."""
    g, bound = call.geometry, call.query_bound
    if not all(isinstance(n, int) for n in (g.batch, g.num_tokens, bound)):
        return False
    return g.batch > 1 and bound > 1 and g.num_tokens < g.batch * bound


def prefill_unsupported(call: PagedCall) -> str | None:
    """Why this kernel family cannot run ``call`` (None: it can). Decode calls (at most one
    query token per sequence, known from the hint or the shapes) belong to the decode
    kernels."""
    if not _triton_installed():
        return "Triton is not installed"
    if call.device.type != "cuda" and not INTERPRET:
        return f"device {call.device.type}: the prefill kernels are Triton on CUDA"
    if call.device.type == "cuda":
        cap = capability(call.device)
        if cap is None:
            return NO_CUDA
        if cap < (8, 0):
            return "needs compute capability 8.0 or newer"
    if call.query.dtype not in (torch.bfloat16, torch.float16):
        return f"query dtype {call.query.dtype}: the prefill kernels take bf16 or fp16"
    if not call.scale > 0:
        return f"scale {call.scale}: the prefill kernels fold a positive softmax scale"
    if call.geometry.head_dim not in HEAD_DIMS:
        return f"head_dim {call.geometry.head_dim} not in {HEAD_DIMS}"
    if call.decode:
        return "at most one query token per sequence: a decode call"
    return None


def check_plan(call: PagedCall, plan: PrefillPlan, min_query_len: int = 0) -> None:
    """A plan's shape rules, with the argument named."""
    g = call.geometry
    if plan.pack < 1 or g.group % plan.pack:
        raise ValueError(f"plan: pack {plan.pack} must divide the GQA group {g.group}")
    if plan.block_m < max(16, plan.pack) or plan.block_m & (plan.block_m - 1):
        raise ValueError(f"plan: block_m {plan.block_m} must be a power of two >= 16 and >= "
                         f"pack {plan.pack}")
    if plan.splits < 1 or (plan.splits > 1 and min_query_len > 0):
        raise ValueError(f"plan: splits {plan.splits} must be >= 1, and 1 beside another "
                         f"kernel's rows (min_query_len {min_query_len})")
    if plan.block_n < 16 or plan.block_n & (plan.block_n - 1):
        raise ValueError(f"plan: block_n {plan.block_n} must be a power of two >= 16")
    if plan.pv not in PV_MODES:
        raise ValueError(f"plan: pv {plan.pv!r} not in {PV_MODES}")

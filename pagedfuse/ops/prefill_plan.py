"""Launch planning for the prefill kernels (triton_prefill.py), importable without Triton.

Which calls the prefill kernels take (``prefill_unsupported``), the launch choices of one
call (``PrefillPlan``) and their defaults: a backend registry can ask all of this on a
machine with no GPU and no Triton.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from pagedfuse.ops.call import PagedCall, next_power_of_2

HEAD_DIMS = (64, 128, 256)
PV_MODES = ("half", "int8")
# Triton's interpreter runs these kernels on CPU tensors (tests of the logic, no GPU).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class PrefillPlan:
    """Launch choices for one call: rows per tile (``block_m``), query heads packed into a
    tile's rows (``pack``, a power of two dividing the GQA group), keys per step
    (``block_n``), warps, software-pipeline depth and the INT8 P·V mode (PV_MODES)."""

    block_m: int = 128
    pack: int = 1
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    pv: str = "half"

    @property
    def tokens(self) -> int:
        """Query tokens per tile."""
        return self.block_m // self.pack


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


# (head_dim, cache kind) -> (block_m, block_n, num_warps, num_stages) for q_len >= 128: the
# fastest mean over full 8K prefill and 2K chunks of 16K in the H200 sweep
# (benchmarks/results/prefill_sweep_h200_2026-12-01.json). INT8 K+V at head_dim 128 takes 64-row
# tiles: two CTAs per SM, 20-25% faster there than 128 rows, which spill.
TILES = {
    (64, "float"): (128, 64, 8, 3), (64, "int8_k"): (128, 128, 4, 3),
    (64, "int8_kv"): (128, 128, 4, 3),
    (128, "float"): (128, 128, 8, 2), (128, "int8_k"): (128, 128, 8, 2),
    (128, "int8_kv"): (64, 64, 4, 2),
    (256, "float"): (128, 64, 8, 2), (256, "int8_k"): (128, 64, 8, 2),
    (256, "int8_kv"): (128, 64, 8, 2),
}


@functools.lru_cache(maxsize=256)
def _default_plan(head_dim: int, group: int, query_bound: int, kind: str) -> PrefillPlan:
    """TILES for long queries. Shorter ones pack heads of the GQA group into the rows
    (token-major) until a tile holds the longest query, down to 64 rows and 4 warps (one
    warpgroup's wgmma M)."""
    block_m, block_n, warps, stages = TILES[(head_dim, kind)]
    tokens = next_power_of_2(max(query_bound, 1))
    pack = min(_largest_pow2_divisor(group), max(1, block_m // tokens))
    rows = max(64, min(block_m, tokens * pack))
    return PrefillPlan(rows, pack, block_n, warps if rows == block_m else 4, stages)


def default_plan(call: PagedCall) -> PrefillPlan:
    """The plan ``prefill_into`` takes when given none (sizes from shapes and hints)."""
    g = call.geometry
    return _default_plan(g.head_dim, g.group, call.query_bound, call.kind)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def prefill_unsupported(call: PagedCall) -> str | None:
    """Why this kernel family cannot run ``call`` (None: it can). Decode calls (at most one
    query token per sequence, known from the hint or the shapes) belong to the decode
    kernels."""
    if not _triton_installed():
        return "Triton is not installed"
    if call.device.type != "cuda" and not INTERPRET:
        return f"device {call.device.type}: the prefill kernels are Triton on CUDA"
    if call.device.type == "cuda" and _capability(call.device) < (8, 0):
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


def check_plan(call: PagedCall, plan: PrefillPlan) -> None:
    """A plan's shape rules, with the argument named."""
    g = call.geometry
    if plan.pack < 1 or plan.pack & (plan.pack - 1) or g.group % plan.pack:
        raise ValueError(f"plan: pack {plan.pack} must be a power of two dividing the GQA "
                         f"group {g.group}")
    if plan.block_m % plan.pack or plan.block_m < 16 or plan.block_m & (plan.block_m - 1):
        raise ValueError(f"plan: block_m {plan.block_m} must be a power of two >= 16 and a "
                         f"multiple of pack {plan.pack}")
    if plan.block_n < 16 or plan.block_n & (plan.block_n - 1):
        raise ValueError(f"plan: block_n {plan.block_n} must be a power of two >= 16")
    if plan.pv not in PV_MODES:
        raise ValueError(f"plan: pv {plan.pv!r} not in {PV_MODES}")

"""The window_left / softcap cases that each kernel runs (tests/test_window_kernels.py; the
Triton kernel through helpers/triton_interpret.py): windows of 1, 7, 16, 4096 and longer than
every context, with and without causal, decode and q_len > 1 in one call, and non-finite
inputs placed relative to a window's edges. On the GPU the same cases, decode only and with
q_len > 1, in every cache kind, form a conformance grid (GPU_GRID) for helpers.conformance's
runner.

Non-finite cases use a block table without repeated blocks (helpers.cases.make_case reuses
blocks across and within sequences), so one poisoned slot is exactly one key of one sequence.
"""

from __future__ import annotations

import math

import torch

from helpers.cases import KINDS, OUTSIDE, Case, make_case, poison_kv
from helpers.conformance import GridCase

WINDOWS = (1, 7, 16, 4096, 1_000_000)  # the last is longer than every context
NAN, INF = float("nan"), float("inf")
DECODE = (1, 1, 1)  # q_lens of window_spec's three sequences as a decode call


def window_spec(window: int, causal: bool, **overrides) -> dict:
    """make_case's arguments of three sequences with q_len 3, 5 and 1 (prefill rows and a
    decode row), the first longer than the window where the window is 4096."""
    long = 4500 if window == 4096 else 60
    spec = dict(seq_lens=(long, 37, 20), q_lens=(3, 5, 1), num_q_heads=8, num_kv_heads=2,
                head_dim=64, block_size=16, causal=causal, window_left=window, seed=window)
    return {**spec, **overrides}


def window_case(window: int, causal: bool, **overrides) -> Case:
    return make_case(**window_spec(window, causal, **overrides))


def _gpu_grid() -> list[GridCase]:
    """Every window with and without causal in every cache kind, bf16, as a decode call
    (hinted, so the decode kernels take it) and with q_len > 1; then soft caps with and
    without a window at each head dim, and fp16."""
    grid = []
    for window in WINDOWS:
        for causal in (False, True):
            for kind in KINDS:
                name = f"w{window}-{'causal' if causal else 'noncausal'}-{kind}"
                spec = window_spec(window, causal, kind=kind, dtype=torch.bfloat16)
                grid.append(GridCase(f"decode-{name}", {**spec, "q_lens": DECODE}, "exact"))
                grid.append(GridCase(f"qlen-{name}", spec))
    for head_dim in (64, 128, 256):
        for kind in KINDS:
            for window, cap in ((16, 1.0), (None, 2.0)):
                spec = window_spec(16, True, kind=kind, dtype=torch.bfloat16, head_dim=head_dim,
                                   num_q_heads=12, window_left=window, softcap=cap)
                name = f"d{head_dim}-w{window}-cap{cap}-{kind}"
                grid.append(GridCase(f"decode-{name}", {**spec, "q_lens": DECODE}, "exact"))
                grid.append(GridCase(f"qlen-{name}", spec))
    spec = window_spec(7, False, dtype=torch.float16, softcap=1.0, kind="int8_k")
    grid.append(GridCase("decode-fp16-w7-cap1.0-int8_k", {**spec, "q_lens": DECODE}, "exact"))
    return grid


GPU_GRID = _gpu_grid()


def poisoned_before_windows(case: Case) -> Case:
    """``case`` (distinct blocks, one spare) with every table entry of a page wholly before
    each sequence's first window pointing at a spare block whose K and V (or their scales)
    are NaN: a kernel that located or copied any of those pages, even with weight 0 (NaN
    times 0 in a P·V is NaN), gives NaN rows; one that reads only the windows matches the
    unpoisoned case's reference."""
    table, lens = case.block_table.cpu().long(), case.seq_lens.cpu().tolist()
    starts = case.query_start_loc.cpu().tolist()
    block_size = case.key_cache.shape[1]
    spare = sorted(set(range(case.key_cache.shape[0])) - set(table.flatten().tolist()))[0]
    poisoned = {name: getattr(case, name).clone() for name in
                ("key_cache", "value_cache", "key_scale", "value_scale")
                if getattr(case, name) is not None}
    for t in poisoned.values():
        if t.is_floating_point():
            t[spare] = NAN
    for b, n in enumerate(lens):
        first = n - (starts[b + 1] - starts[b]) + 1 - case.window_left
        table[b, : max(first, 0) // block_size] = spare
    return case.with_(block_table=table.to(case.block_table), **poisoned)


def distinct_blocks(case: Case, seed: int = 0) -> Case:
    """``case`` with a block table whose sequences use distinct blocks of the cache (a
    permutation), and ids outside the cache past each sequence's last block."""
    block_size, num_blocks = case.key_cache.shape[1], case.key_cache.shape[0]
    used = [math.ceil(n / block_size) for n in case.seq_lens.tolist()]
    if sum(used) > num_blocks:
        raise ValueError(f"distinct_blocks: {sum(used)} blocks in use, the cache has "
                         f"{num_blocks}")
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    table = torch.full(case.block_table.shape, num_blocks + OUTSIDE, dtype=torch.int64)
    start = 0
    for b, n in enumerate(used):
        table[b, :n] = perm[start:start + n]
        start += n
    return case.with_(block_table=table.to(case.block_table.dtype))


# (name, where): a non-finite value in sequence 0 (seq_len 60, q_len 3 at positions 57..59,
# window 7, not causal: row t reads keys 51 + t .. 59). "first_row_key" is key 51, which only
# row 0 reads; "before_window" key 50, which no row reads.
POISONS = ("q_inf", "q_neginf", "q_nan", "k_inf", "k_nan", "k_nan_before_window",
           "v_nan_before_window", "v_inf_before_window", "k_nan_first_row_key",
           "v_nan_first_row_key", "bias_posinf", "bias_nan")


def poison_case(where: str, kind: str = "float", softcap: float = 3.0,
                dtype: torch.dtype = torch.float32) -> Case:
    """The case of POISONS with ``where`` placed (a float bias for the bias_* ones)."""
    bias = "float" if where.startswith("bias") else None
    case = make_case(seq_lens=(60, 37, 20), q_lens=(3, 5, 1), num_q_heads=4, num_kv_heads=2,
                     head_dim=64, block_size=4, dtype=dtype, kind=kind, bias=bias,
                     window_left=7, softcap=softcap, num_blocks=40, seed=11)
    case = distinct_blocks(case, seed=11)
    if case.attn_bias is not None:
        case = case.with_(attn_bias=case.attn_bias.clamp(-3, 3))
    case = case.with_(**{name: getattr(case, name).clone() for name in
                         ("query", "key_cache", "value_cache", "key_scale", "value_scale",
                          "attn_bias") if getattr(case, name) is not None})
    value = NAN if "nan" in where else (-INF if "neginf" in where else INF)
    key = 50 if "before_window" in where else (51 if "first_row" in where else 56)
    block_size = case.key_cache.shape[1]
    blk, slot = int(case.block_table[0, key // block_size]), key % block_size
    if where.startswith("q"):
        case.query[1, 1, 7] = value  # sequence 0's row 1, head 1
    elif where[0] in ("k", "v"):
        poison_kv(case, where[0], blk, slot, value)
    else:
        case.attn_bias[0, 2, 0, key] = value
    return case

"""The op-conformance grid and the runner every kernel backend goes through.

The grid is a hand-picked list rather than a product (each GPU case compiles a kernel
specialisation): every value of every axis appears (layouts NHD/HND, dtypes, GQA ratios,
cache kinds, decode and varlen prefill with empty and all-keys queries, pages of 1/16/256,
causal, bool and float biases of each broadcast shape, index dtypes, a strided query,
with and without hints), several in combination. A backend that does not take a case says
why (``registry.reason``); a case it takes must match the float64 reference to
numerics.kernel_tolerance, written into a NaN-filled output, and again through the op with
PAGEDFUSE_BACKEND naming it (where the op serves the head_dim on that device at all).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from helpers.cases import Case, make_case
from pagedfuse import numerics
from pagedfuse.ops.backends import Backend, head_dim_reason, reason


@dataclass(frozen=True)
class GridCase:
    """make_case's arguments plus the hints the call passes: "none", or "exact" (the
    longest sequence and query as max_seq_len / max_query_len)."""

    name: str
    spec: dict = field(default_factory=dict)
    hints: str = "none"

    def build(self, device: str) -> Case:
        return make_case(**self.spec, device=device)

    def hint_args(self, case: Case) -> dict:
        if self.hints == "none":
            return {}
        return dict(max_seq_len=case.longest, max_query_len=case.longest_query)


bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
VARLEN = dict(seq_lens=(50, 19, 33, 70), q_lens=(5, 0, 33, 17))  # one empty, one all-keys
LONG = dict(seq_lens=(2000, 700), num_q_heads=8, num_kv_heads=1, head_dim=128)

GRID = [
    GridCase("decode-f32-gqa4-d64-p16"),
    GridCase("decode-f32-gqa4-d64-p16-hinted", hints="exact"),
    GridCase("decode-bf16-hnd-gqa1-d128-p1", dict(seq_lens=(7, 30), num_q_heads=4,
                                                  num_kv_heads=4, head_dim=128, block_size=1,
                                                  dtype=bf16, layout="HND"), "exact"),
    GridCase("decode-f16-gqa8-d256-p256", dict(seq_lens=(300, 5), num_q_heads=16,
                                               num_kv_heads=2, head_dim=256, block_size=256,
                                               dtype=f16), "exact"),
    GridCase("decode-bf16-gqa5-d128-int64", dict(seq_lens=(1, 15, 16, 17, 129), num_q_heads=10,
                                                 num_kv_heads=2, head_dim=128, dtype=bf16,
                                                 index_dtype=torch.int64), "exact"),
    GridCase("decode-bf16-hnd-gqa6-d256", dict(num_q_heads=12, num_kv_heads=2, head_dim=256,
                                               dtype=bf16, layout="HND")),
    GridCase("decode-f32-gqa16-d64", dict(num_q_heads=16, num_kv_heads=1), "exact"),
    GridCase("decode-bf16-long-splits", dict(**LONG, dtype=bf16), "exact"),
    GridCase("int8kv-bf16-gqa4-d128", dict(num_q_heads=8, head_dim=128, dtype=bf16,
                                           kind="int8_kv"), "exact"),
    GridCase("int8k-bf16-gqa8-d64-p1", dict(seq_lens=(9, 33), num_q_heads=16, block_size=1,
                                            dtype=bf16, kind="int8_k"), "exact"),
    GridCase("int8kv-f16-hnd-gqa6-d256", dict(num_q_heads=12, head_dim=256, dtype=f16,
                                              layout="HND", kind="int8_kv"), "exact"),
    GridCase("int8k-f32-gqa4-d128", dict(head_dim=128, kind="int8_k")),
    GridCase("int8kv-bf16-long-splits", dict(**LONG, dtype=bf16, kind="int8_kv"), "exact"),
    GridCase("prefill-f32-hnd-varlen-causal-strided", dict(**VARLEN, num_q_heads=12,
                                                           layout="HND", causal=True,
                                                           strided_query=True,
                                                           index_dtype=torch.int64)),
    GridCase("prefill-bf16-varlen-causal-hinted", dict(**VARLEN, dtype=bf16, causal=True),
             "exact"),
    GridCase("prefill-bf16-gqa6-noncausal", dict(seq_lens=(40, 53), q_lens=(3, 9),
                                                 num_q_heads=12, dtype=bf16)),
    GridCase("prefill-int8kv-bf16-causal-hnd", dict(seq_lens=(40, 53), q_lens=(6, 3),
                                                    head_dim=128, dtype=bf16, layout="HND",
                                                    kind="int8_kv", causal=True)),
    # head_dim 256 with several query rows per tile: the Triton kernel's largest tiles
    GridCase("prefill-int8kv-bf16-gqa6-d256-causal", dict(seq_lens=(40, 53), q_lens=(8, 3),
                                                          num_q_heads=12, num_kv_heads=2,
                                                          head_dim=256, dtype=bf16,
                                                          kind="int8_kv", causal=True)),
    GridCase("prefill-int8k-f16-causal", dict(seq_lens=(64, 31), q_lens=(16, 4), dtype=f16,
                                              kind="int8_k", causal=True), "exact"),
    GridCase("prefill-int8k-bf16-d128-varlen-causal", dict(**VARLEN, head_dim=128, dtype=bf16,
                                                           kind="int8_k", causal=True),
             "exact"),
    GridCase("bias-bool-full-causal", dict(seq_lens=(45, 20, 64), q_lens=(4, 1, 3),
                                           bias="bool", causal=True)),
    GridCase("bias-float-per-batch-bf16", dict(seq_lens=(45, 20), q_lens=(2, 3), dtype=bf16,
                                               bias="float", bias_shape="per_batch")),
    GridCase("bias-bool-per-head-row-decode", dict(bias="bool", bias_shape="per_head_row"),
             "exact"),
    GridCase("bias-float-3d-d128", dict(seq_lens=(40, 53), q_lens=(6, 2), head_dim=128,
                                        bias="float", bias_shape="3d")),
    GridCase("bias-bool-2d-int8kv", dict(seq_lens=(30, 41), q_lens=(2, 2), kind="int8_kv",
                                         bias="bool", bias_shape="2d")),
    GridCase("decode-f32-d96", dict(head_dim=96)),
    GridCase("prefill-bf16-d32-causal", dict(seq_lens=(40, 9), q_lens=(3, 1), head_dim=32,
                                             dtype=bf16, causal=True)),
    # The options (window_left, softcap): a backend without them declines with its reason.
    GridCase("window-decode-bf16-w16", dict(seq_lens=(45, 9, 70), dtype=bf16,
                                            window_left=16), "exact"),
    GridCase("window-decode-f32-w1-int8kv", dict(head_dim=128, kind="int8_kv",
                                                 window_left=1)),
    GridCase("window-prefill-f32-w7-causal", dict(**VARLEN, causal=True, window_left=7)),
    GridCase("window-prefill-bf16-w7-noncausal-hnd", dict(seq_lens=(40, 53), q_lens=(6, 9),
                                                          dtype=bf16, layout="HND",
                                                          window_left=7)),
    GridCase("window-long-bf16-w4096", dict(seq_lens=(4500, 700), q_lens=(3, 1),
                                            head_dim=128, dtype=bf16, causal=True,
                                            window_left=4096), "exact"),
    GridCase("softcap-decode-bf16-d256", dict(num_q_heads=16, head_dim=256, dtype=bf16,
                                              softcap=50.0), "exact"),
    GridCase("softcap-window-prefill-f16-bias", dict(seq_lens=(45, 20), q_lens=(4, 3),
                                                     dtype=f16, causal=True, bias="float",
                                                     bias_shape="per_batch", window_left=16,
                                                     softcap=5.0)),
    GridCase("window-softcap-prefill-bf16-d256", dict(seq_lens=(45, 20), q_lens=(9, 4),
                                                      num_q_heads=4, head_dim=256, dtype=bf16,
                                                      causal=True, window_left=16,
                                                      softcap=50.0), "exact"),
    GridCase("softcap-int8k-f32-causal", dict(seq_lens=(64, 31), q_lens=(16, 4),
                                              kind="int8_k", causal=True, softcap=2.0)),
]


def run_case(backend: Backend, grid_case: GridCase, device: str,
             monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Check ``backend`` on one grid case; returns why it does not take the case (then
    nothing ran), else None after the checks passed."""
    case = grid_case.build(device)
    hints = grid_case.hint_args(case)
    call = case.call(**hints, capability=False)
    why = reason(backend, call)
    if why is not None:
        return why
    want = case.reference()
    assert want.abs().sum() > 0, "degenerate case: the reference is all zeros"
    tol = numerics.kernel_tolerance(case.query.dtype, call.kind)
    outs = {"run": case.run_backend(backend, **hints)}
    if head_dim_reason(call.op, device, call.geometry.head_dim) is None:  # else the op refuses
        monkeypatch.setenv("PAGEDFUSE_BACKEND", backend.name)
        outs["op"] = case.run_op(**hints)
        monkeypatch.delenv("PAGEDFUSE_BACKEND")
    for how, got in outs.items():
        assert got.dtype == case.query.dtype and got.shape == case.query.shape, how
        err = numerics.rel_err(got, want)
        assert err <= tol, f"{backend.name} via {how}: rel err {err:.3g} > {tol:g}"
    return None

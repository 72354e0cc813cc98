"""The program builders the rewrite tests share (tests/helpers/programs.py), checked against
the op reference (the oracle)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.programs import Spec, attention, make_case

from pagedfuse.numerics import max_rel_err as rel_err
from pagedfuse.ops import paged_attention_reference


@pytest.mark.parametrize("spec", [Spec(), Spec(layout="HND", gqa="repeat_kv"),
                                  Spec(gather="index_select", mask="where"),
                                  Spec(gather="torch_gather", view="permute")],
                         ids=["nhd", "hnd", "index_select", "torch_gather"])
def test_plain_pytorch_spelling_matches_the_op_reference(spec):
    """The builders compute paged attention as the op defines it."""
    case = make_case(spec)
    got = attention(spec)(*case.args())
    kc, vc = (c.transpose(1, 2) if spec.layout == "HND" else c for c in (case.kc, case.vc))
    b, _, q_len, d = case.q.shape
    want = paged_attention_reference(
        case.q.transpose(1, 2).reshape(-1, *case.q.shape[1::2]), kc, vc, case.bt, case.sl,
        torch.arange(b + 1) * q_len, 1 / math.sqrt(d), False)
    assert rel_err(got.transpose(1, 2).reshape(want.shape), want) < 1e-5

"""Hugging Face continuous-batching attention as a graph test that needs no transformers.

transformers keeps one flat per-token slot cache per layer (a paged cache with block size 1),
writes the new K/V into it and reads every key of the packed batch back through a per-token
slot index, inside the same graph: 4.57 spells it `cache[write_index, :, :] = k` /
`cache[read_index, :, :]`, 5.12 `index_copy_` / `torch.index_select`. All requests are packed
into batch 1 with a host-built additive block-diagonal mask, plus padding tokens that write to
a trash slot and whose mask rows are all masked. pagedfuse must rewrite that site, keep the
cache write before the fused read, and give the numbers eager gives.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from helpers.capture import Capture, count_calls

import pagedfuse

HQ, HKV, HEAD_DIM = 8, 2, 32
NUM_SLOTS = 64  # cache rows, fixed like transformers' preallocated cache
SCALE = 0.2
# How each spelling writes the cache, as the FX node target Dynamo records for it.
WRITE_TARGETS = {"setitem": operator.setitem, "index_copy_": "index_copy_"}


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """The Hugging Face GQA expansion: [1, Hkv, L, D] -> [1, Hkv * n_rep, L, D]."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class SlotCacheAttention(torch.nn.Module):
    """One attention step of transformers' `paged|sdpa` continuous batching."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v, k_cache, v_cache, write_index, read_index, mask):
        k = k.transpose(1, 2).squeeze(0)
        v = v.transpose(1, 2).squeeze(0)
        if self.spelling == "setitem":
            k_cache[write_index, :, :] = k
            v_cache[write_index, :, :] = v
            k_all = k_cache[read_index, :, :]
            v_all = v_cache[read_index, :, :]
        else:
            k_cache.index_copy_(0, write_index, k)
            v_cache.index_copy_(0, write_index, v)
            k_all = torch.index_select(k_cache, 0, read_index)
            v_all = torch.index_select(v_cache, 0, read_index)
        k_all = repeat_kv(k_all.transpose(0, 1).unsqueeze(0), HQ // HKV)
        v_all = repeat_kv(v_all.transpose(0, 1).unsqueeze(0), HQ // HKV)
        out = F.scaled_dot_product_attention(
            q.contiguous(), k_all.contiguous(), v_all.contiguous(),
            attn_mask=mask, dropout_p=0.0, scale=SCALE, is_causal=False,
        )
        return out.transpose(1, 2).contiguous()


def packed_batch(requests: list[tuple[int, int]], pad_q: int, pad_k: int, seed: int):
    """Inputs as transformers builds them for `requests` = [(past_len, new_len), ...].

    The keys of request r are its past slots then its new slots; the mask is block diagonal,
    bottom-right causal per block, `finfo.min` elsewhere (padding rows fully masked). Padding
    queries write to the trash slot, padding keys read it. The slots the step writes are
    poisoned with NaN, so a fused read placed before the write cannot go unnoticed.
    """
    g = torch.Generator().manual_seed(seed)
    trash = NUM_SLOTS - 2
    slots = torch.randperm(trash, generator=g)
    write, read, offset = [], [], 0
    for past, new in requests:
        seq = slots[offset : offset + past + new]
        offset += past + new
        read.append(seq)
        write.append(seq[past:])
    write_index = torch.cat(write + [torch.full((pad_q,), trash)])
    read_index = torch.cat(read + [torch.full((pad_k,), trash)])
    num_q, num_k = write_index.numel(), read_index.numel()
    masked = torch.finfo(torch.float32).min
    mask = torch.full((1, 1, num_q, num_k), masked)
    q0 = k0 = 0
    for past, new in requests:
        block = torch.full((new, past + new), masked).triu(diagonal=past + 1)
        mask[0, 0, q0 : q0 + new, k0 : k0 + past + new] = block
        q0, k0 = q0 + new, k0 + past + new
    k_cache = torch.randn(NUM_SLOTS, HKV, HEAD_DIM, generator=g)
    v_cache = torch.randn(NUM_SLOTS, HKV, HEAD_DIM, generator=g)
    k_cache[write_index] = float("nan")
    v_cache[write_index] = float("nan")
    q = torch.randn(1, HQ, num_q, HEAD_DIM, generator=g)
    k = torch.randn(1, HKV, num_q, HEAD_DIM, generator=g)
    v = torch.randn(1, HKV, num_q, HEAD_DIM, generator=g)
    if pad_q:  # padding tokens are all alike (token 0 at position 0), so duplicate writes agree
        k[:, :, num_q - pad_q :] = k[:, :, num_q - 1 :]
        v[:, :, num_q - pad_q :] = v[:, :, num_q - 1 :]
    return [q, k, v, k_cache, v_cache, write_index, read_index, mask]


def run_both(module, compiled, args):
    """Eager and compiled results (output, k_cache, v_cache) on separate copies of `args`."""
    eager_args = [a.clone() for a in args]
    compiled_args = [a.clone() for a in args]
    eager_out = module(*eager_args)
    compiled_out = compiled(*compiled_args)
    return (eager_out, *eager_args[3:5]), (compiled_out, *compiled_args[3:5])


def assert_matches_eager(eager, compiled):
    eager_out, eager_k, eager_v = eager
    out, k_cache, v_cache = compiled
    assert torch.isfinite(eager_out).all()
    torch.testing.assert_close(out, eager_out, rtol=1e-4, atol=1e-4)
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v), "cache write lost"


def assert_every_site_rewritten(report, num_sites: int):
    assert report.num_sites == num_sites, str(report)
    assert report.num_rewritten == num_sites, str(report)
    assert all(site.rewritten for site in report.sites), str(report)


def assert_fused_graph(gm: torch.fx.GraphModule, write_target) -> None:
    """One fused op, no SDPA left, both cache writes kept and ordered before the fused read."""
    assert count_calls(gm, torch.ops.pagedfuse.paged_attention) == 1, gm.code
    assert count_calls(gm, F.scaled_dot_product_attention) == 0, gm.code
    assert count_calls(gm, write_target) == 2, gm.code
    order = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    fused = next(i for i, n in enumerate(order)
                 if getattr(n.target, "overloadpacket", n.target)
                 is torch.ops.pagedfuse.paged_attention)
    writes = [i for i, n in enumerate(order) if n.target == write_target]
    assert max(writes) < fused, gm.code


@pytest.mark.parametrize("spelling", WRITE_TARGETS)
def test_packed_step_is_rewritten_and_matches_eager(spelling):
    torch._dynamo.reset()
    pagedfuse.clear_reports()
    module = SlotCacheAttention(spelling)
    inner = Capture()
    compiled = torch.compile(module, backend=pagedfuse.backend(inner=inner), dynamic=False)
    args = packed_batch([(5, 3), (0, 6), (9, 1)], pad_q=2, pad_k=4, seed=1)

    eager, fused = run_both(module, compiled, args)

    assert_matches_eager(eager, fused)
    assert len(inner.graphs) == 1
    assert_fused_graph(inner.graphs[0], WRITE_TARGETS[spelling])
    assert_every_site_rewritten(pagedfuse.last_report(), num_sites=1)


@pytest.mark.parametrize("spelling", WRITE_TARGETS)
def test_changing_lengths_share_one_dynamic_rewritten_graph(spelling):
    """Like transformers' padded-interval batches: the second shape recompiles with automatic
    dynamic Q and L, and that graph then serves every later length."""
    torch._dynamo.reset()
    pagedfuse.clear_reports()
    module = SlotCacheAttention(spelling)
    inner = Capture()
    compiled = torch.compile(module, backend=pagedfuse.backend(inner=inner))
    batches = [
        packed_batch([(4, 4), (7, 1)], pad_q=3, pad_k=2, seed=2),
        packed_batch([(12, 1), (3, 1), (0, 9)], pad_q=1, pad_k=5, seed=3),
        packed_batch([(20, 2)], pad_q=0, pad_k=0, seed=4),
        packed_batch([(2, 5), (6, 1), (1, 1), (0, 3)], pad_q=5, pad_k=7, seed=5),
    ]

    for args in batches:
        assert_matches_eager(*run_both(module, compiled, args))

    assert len(inner.graphs) == 2, "a new graph per length"
    dynamic_graph = inner.graphs[1]
    mask_node = [n for n in dynamic_graph.graph.nodes if n.op == "placeholder"][-1]
    assert any(isinstance(d, torch.SymInt) for d in mask_node.meta["example_value"].shape)
    assert len(pagedfuse.reports()) == 2
    for gm, report in zip(inner.graphs, pagedfuse.reports(), strict=True):
        assert_fused_graph(gm, WRITE_TARGETS[spelling])
        assert_every_site_rewritten(report, num_sites=1)

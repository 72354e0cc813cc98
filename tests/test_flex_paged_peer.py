"""The benchmark's FlexAttention peer (benchmarks/flex_paged.py) on the CPU: it must compute
the same paged decode as the reference, reading the cache in place, before its GPU timings
mean anything."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from pagedfuse.ops.reference import paged_attention_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
flex_paged = pytest.importorskip("flex_paged")


@pytest.mark.parametrize("window", [None, 1, 7, 40])  # the sliding-window mask (bench_window)
@pytest.mark.parametrize(("hq", "hkv", "d", "page"),
                         [(8, 2, 64, 16), (6, 6, 32, 4), (6, 2, 32, 16)])  # groups 4, 1, 3
def test_flex_peer_matches_the_reference(hq, hkv, d, page, window):
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.tensor([37, 1, 64, 50])
    batch, n = len(seq_lens), math.ceil(64 / page)
    blocks = batch * n + 3
    key = torch.randn(blocks, page, hkv, d, generator=gen)
    value = torch.randn(blocks, page, hkv, d, generator=gen)
    table = torch.randperm(blocks, generator=gen)[: batch * n].view(batch, n).int()
    query = torch.randn(batch, hq, d, generator=gen)
    call = flex_paged.paged_flex_call(query, key, value, table, seq_lens, d ** -0.5,
                                      window_left=window)
    ref = paged_attention_reference(query, key, value, table, seq_lens,
                                    torch.arange(batch + 1), d ** -0.5, False, None,
                                    compute_dtype=torch.float64, window_left=window)
    out = call()
    assert out.shape == query.shape
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_the_peer_reads_the_cache_in_place():
    cache = torch.randn(5, 16, 2, 64)
    pages = flex_paged.physical_pages(cache)
    assert pages.shape == (1, 2, 80, 64) and pages.data_ptr() == cache.data_ptr()
    assert torch.equal(pages[0, 1, 16 * 3 + 7], cache[3, 7, 1])
    with pytest.raises(ValueError, match="do not merge"):
        flex_paged.physical_pages(cache.transpose(1, 2).contiguous().transpose(1, 2))

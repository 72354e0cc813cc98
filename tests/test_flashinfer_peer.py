"""The benchmark's FlashInfer peer (benchmarks/flashinfer_paged.py) on the CPU: the page lists
it hands FlashInfer must name exactly the keys the block table names, in order, before its
GPU timings mean anything (FlashInfer itself runs on the GPU only)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from helpers.prefill import paged_call

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import flashinfer_paged  # noqa: E402


def test_page_lists_name_the_block_tables_keys():
    gen = torch.Generator().manual_seed(0)
    page, width = 4, 5
    seq_lens = torch.tensor([1, 4, 17, 20, 9], dtype=torch.int32)  # one key; whole pages; tails
    q_lens = [1, 3, 17, 2, 9]
    batch = len(seq_lens)
    blocks = batch * width + 3
    cache = torch.randn(blocks, page, 2, 8, generator=gen)
    table = torch.randperm(blocks, generator=gen)[: batch * width].view(batch, width).int()
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), 4, 8, generator=gen)
    call = paged_call(query, cache, cache, table, seq_lens, starts, 0.1, True)
    lists = flashinfer_paged.page_lists(call)
    assert torch.equal(lists["qo_indptr"], starts)
    indptr, indices, last = (lists[k] for k in ("paged_kv_indptr", "paged_kv_indices",
                                                "paged_kv_last_page_len"))
    assert indptr.tolist()[-1] == len(indices)
    for b, length in enumerate(seq_lens.tolist()):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        assert 1 <= int(last[b]) <= page
        listed = cache[pages].flatten(0, 1)[: (len(pages) - 1) * page + int(last[b])]
        assert torch.equal(listed, cache[table[b].long()].flatten(0, 1)[:length])

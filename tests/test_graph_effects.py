"""The generic graph helpers the checks stand on (pagedfuse/graph): which nodes write which
memory, when two look-alike nodes hold one value, and the named checks built on them."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from helpers.differential import differential

import pagedfuse
from pagedfuse.graph.effects import GraphEffects, node_storages, same_value, written_args
from pagedfuse.patterns import PAGED_SDPA
from pagedfuse.patterns.paged_sdpa import preconditions, sdpa_semantics
from pagedfuse.rewrite.engine import rewrite_graph


def dynamo_graph(fn, *args) -> torch.fx.GraphModule:
    """The graph Dynamo records for ``fn(*args)`` (fake values in node.meta)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    return graphs[0]


@torch.library.custom_op("pagedfuse_test::scatter_rows_", mutates_args=("cache",))
def scatter_rows_(cache: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
    cache[index] = rows


@scatter_rows_.register_fake
def _scatter_rows_fake(cache, rows, index) -> None:
    return None


@torch._dynamo.allow_in_graph
def opaque(x: torch.Tensor) -> torch.Tensor:
    """A user function Dynamo puts in the graph without looking inside."""
    return x + 1


def _writes(fn, *args) -> dict[str, list[str] | None]:
    """What each call node writes, by the names of the nodes written."""
    gm = dynamo_graph(fn, *args)
    found = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            written = written_args(node)
            found[node.name] = None if written is None else sorted(
                w.name for w in written if isinstance(w, torch.fx.Node))
    return found


def test_every_form_of_write_names_what_it_writes():
    def fn(cache, rows, index, lengths):
        cache.narrow(0, 0, 1).mul_(2.0)
        cache *= 0.5
        torch.add(cache, 1.0, out=cache)
        cache[0] = rows[0]
        scatter_rows_(cache, rows, index)
        F.relu(cache, inplace=True)
        lengths += 1
        return opaque(cache).sum() + cache.clone().sum()

    writes = _writes(fn, torch.randn(8, 4), torch.randn(2, 4), torch.tensor([1, 5]),
                     torch.tensor([3, 4]))
    assert writes["mul_"] == ["narrow"]
    assert writes["cache"] == ["l_cache_"]  # operator.imul (the node takes the name)
    assert writes["add"] == ["cache"]  # out=
    assert writes["setitem"] == ["cache"]
    assert writes["scatter_rows__default"] == ["cache"]  # mutates_args, from the schema
    assert writes["relu"] == ["cache"]  # inplace=True
    assert writes["lengths"] == ["l_lengths_"]
    assert writes["opaque"] is None  # unknown effects: may write anything
    assert writes["clone"] == [] and writes["sum_1"] == []


def test_views_share_storage_with_their_base_and_copies_do_not():
    def fn(kv, table):
        k = kv[0]
        piece = k.unbind(0)[1]
        copy = k.contiguous().clone()
        strided = kv.as_strided((4,), (2,))
        return piece.sum() + copy.sum() + strided.sum() + table.long().sum()

    gm = dynamo_graph(fn, torch.randn(2, 4, 3), torch.tensor([1, 2]))
    nodes = {n.name: n for n in gm.graph.nodes}
    base = node_storages(nodes["l_kv_"])
    assert node_storages(nodes["k"]) == base == node_storages(nodes["piece"])
    assert node_storages(nodes["strided"]) == base
    assert node_storages(nodes["copy"]).isdisjoint(base)
    assert node_storages(nodes["long"]) == node_storages(nodes["l_table_"])  # int64 already


def test_look_alike_reads_are_one_value_only_without_a_write_between():
    def fn(table, other):
        first = table.to(torch.int32)
        second = table.to(torch.int32)
        other.add_(1)
        third = other.to(torch.int32)
        table[0] = 3
        fourth = table.to(torch.int32)
        fifth = other.to(torch.int32)
        return first, second, third, fourth, fifth

    gm = dynamo_graph(fn, torch.tensor([1, 2]), torch.tensor([5, 6]))
    casts = [n for n in gm.graph.nodes if n.target == "to"]
    first, second, third, fourth, fifth = casts
    assert same_value(first, second)
    assert not same_value(second, fourth)  # table written in between
    assert same_value(third, fifth)  # other's write came before both
    assert not same_value(first, third)  # other arguments


def test_inputs_written_by_a_graph():
    def fn(a, b, c):
        a[0] = 1.0
        b.t().mul_(2.0)
        return c * 2

    gm = dynamo_graph(fn, torch.randn(3), torch.randn(2, 2), torch.randn(3))
    assert GraphEffects(gm.graph).written_inputs() == [0, 1]


B, HQ, HKV, D, BS, M, N = 2, 4, 2, 64, 4, 3, 12


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HQ, 1, D, generator=g), torch.randn(N, BS, HKV, D, generator=g),
            torch.randn(N, BS, HKV, D, generator=g),
            torch.randperm(N, generator=g)[:B * M].view(B, M))


def _bhld(pages):
    return pages.flatten(1, 2).transpose(1, 2)


def _kept(outcome, check: str, reason: str) -> None:
    outcome.check()
    failed = outcome.report.sites[0].first_failure
    assert not outcome.rewritten and failed.name == check and reason in failed.reason, failed


def test_a_call_with_unknown_effects_between_gather_and_attention_is_a_hazard():
    def fn(q, kc, vc, bt):
        k, v = _bhld(kc[bt]), _bhld(vc[bt])
        q = opaque(q)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    _kept(differential(fn, _inputs()), "cache writes", "its effects are unknown")

    def before(q, kc, vc, bt):
        q = opaque(q)
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]),
                                              enable_gqa=True)

    outcome = differential(before, _inputs())
    outcome.check()
    assert outcome.rewritten


def test_mask_rewritten_in_place_after_it_was_read_is_not_a_length_mask():
    def fn(q, kc, vc, bt, sl):
        valid = torch.arange(M * BS) < sl[:, None]
        valid[0, 1:] = False  # eager's mask hides keys the lengths would keep
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]),
                                              attn_mask=valid[:, None, None, :], enable_gqa=True)

    _kept(differential(fn, (*_inputs(), torch.tensor([M * BS, 5]))), "cache writes",
          "writes valid")


def test_scales_of_another_geometry_are_a_named_check():
    def fn(q, kc, vc, bt, ks, vs):
        k = _bhld(kc[bt].float() * ks[bt][..., None])
        v = _bhld(vc[bt].float() * vs[bt][..., None])
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    q, *_, bt = _inputs()
    g = torch.Generator().manual_seed(1)
    kc, vc = (torch.randint(-127, 128, (N, BS, HKV, D), generator=g, dtype=torch.int8)
              for _ in range(2))
    ks = torch.rand(N + 4, BS, HKV, generator=g) * 0.02  # scales for more blocks than kc
    vs = torch.rand(N, BS, HKV, generator=g) * 0.02
    _kept(differential(fn, (q, kc, vc, bt, ks, vs), tolerance=5e-2), "scales",
          "key scale is (16, 4, 2), not one value per token and head of the key cache "
          "(12, 4, 2)")


def test_one_query_row_over_many_key_value_rows_is_a_named_check():
    def fn(q, kc, vc, bt):
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), enable_gqa=True)

    q, kc, vc, bt = _inputs()
    _kept(differential(fn, (q[:1], kc, vc, bt)), "batch",
          "one query batch row is broadcast over a K/V batch of 2")


def test_a_table_on_another_device_is_a_named_check():
    """Eager indexes a cache with a table on another device (a CUDA cache, a host table);
    the op cannot. Shown with the table's recorded value moved to the meta device."""

    def fn(q, kc, vc, bt):
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), enable_gqa=True)

    gm = dynamo_graph(fn, *_inputs())
    table = next(n for n in gm.graph.nodes if n.name == "l_bt_")
    value = table.meta["example_value"]
    table.meta["example_value"] = value.fake_mode.from_tensor(
        torch.empty(value.shape, dtype=value.dtype, device="meta"), static_shapes=True)
    report, swaps = rewrite_graph(gm, [PAGED_SDPA])
    failed = report.sites[0].first_failure
    assert swaps == [] and failed.name == "devices", failed
    assert failed.reason.startswith("block table l_bt_ is on meta, the query on cpu")


def test_sdpa_on_the_cpu_gives_fully_masked_rows_zeros_as_the_op_does():
    for dtype in (torch.float32, torch.bfloat16):
        for mask_dtype in (torch.bool, dtype):
            assert sdpa_semantics.fully_masked_rows(torch.device("cpu"), dtype,
                                                    mask_dtype) == "zeros"


def test_where_sdpa_gives_fully_masked_rows_other_values_masked_sites_are_kept(monkeypatch):
    monkeypatch.setattr(preconditions, "fully_masked_rows", lambda *args: "NaN")

    def masked(q, kc, vc, bt, sl):
        mask = (torch.arange(M * BS) < sl[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), attn_mask=mask,
                                              enable_gqa=True)

    _kept(differential(masked, (*_inputs(), torch.tensor([5, 9]))), "masked rows",
          "SDPA on cpu gives a fully masked row NaN, the op zeros")

    def unmasked(q, kc, vc, bt, sl):
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), enable_gqa=True)

    assert differential(unmasked, (*_inputs(), torch.tensor([5, 9]))).rewritten


def test_a_user_who_states_every_row_sees_a_key_gets_masked_sites_fused(monkeypatch):
    """Where SDPA gives a fully masked row other values than the op, the kept site's reason
    names PAGEDFUSE_ASSUME_VISIBLE_KEY; with it set the site is fused (and equals eager on
    lengths that leave every row a key), the report saying what was assumed."""
    monkeypatch.setattr(preconditions, "fully_masked_rows", lambda *args: "other values")

    def masked(q, kc, vc, bt, sl):
        mask = (torch.arange(M * BS) < sl[:, None])[:, None, None, :]
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), attn_mask=mask,
                                              enable_gqa=True)

    args = (*_inputs(seed=5), torch.tensor([1, 11]))
    _kept(differential(masked, args), "masked rows", "set PAGEDFUSE_ASSUME_VISIBLE_KEY=1")
    monkeypatch.setenv("PAGEDFUSE_ASSUME_VISIBLE_KEY", "1")
    torch._dynamo.reset()
    outcome = differential(masked, args)
    outcome.check()
    assert outcome.rewritten
    check = next(c for c in outcome.report.sites[0].checks if c.name == "masked rows")
    assert check.passed and "PAGEDFUSE_ASSUME_VISIBLE_KEY=1" in check.reason


class CacheModule(torch.nn.Module):
    """Caches as buffers written in place, with a graph break between two attentions."""

    def __init__(self):
        super().__init__()
        _, kc, vc, _ = _inputs(seed=3)
        self.register_buffer("kc", kc)
        self.register_buffer("vc", vc)

    def forward(self, q, bt, new):
        self.kc[bt[:, 0]] = new
        h = F.scaled_dot_product_attention(q, _bhld(self.kc[bt]), _bhld(self.vc[bt]),
                                           enable_gqa=True)
        torch._dynamo.graph_break()
        self.vc.mul_(0.5)
        return F.scaled_dot_product_attention(h, _bhld(self.kc[bt]), _bhld(self.vc[bt]),
                                              enable_gqa=True)


def test_explain_leaves_module_buffers_untouched_across_graph_breaks():
    torch._dynamo.reset()
    module = CacheModule()
    kc, vc = module.kc.clone(), module.vc.clone()
    q, *_, bt = _inputs()
    new = torch.randn(B, BS, HKV, D)
    for _ in range(3):
        report = pagedfuse.explain(module, q, bt, new)
        assert report.num_sites == 2 and all(s.checks[0].passed for s in report.sites)
    assert torch.equal(module.kc, kc) and torch.equal(module.vc, vc)


@pytest.mark.parametrize("target", [operator.setitem, "index_copy_"])
def test_writes_before_the_gather_are_not_hazards(target):
    """The usual cache update (write the new token, then read every page) still fuses."""

    def fn(q, kc, vc, bt, new, slots):
        if target is operator.setitem:
            kc[slots] = new
        else:
            kc.index_copy_(0, slots, new)
        return F.scaled_dot_product_attention(q, _bhld(kc[bt]), _bhld(vc[bt]), enable_gqa=True)

    q, kc, vc, bt = _inputs()
    outcome = differential(fn, (q, kc, vc, bt, torch.randn(2, BS, HKV, D), bt[:, 0].clone()))
    outcome.check()
    assert outcome.rewritten

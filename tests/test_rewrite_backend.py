"""The backend end to end: inner compilers, entry point by name, options, dynamic shapes,
fullgraph and graph breaks, report/explain/logging, the registry, verify mode."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers.capture import Capture, count_calls
from helpers.programs import (
    INT8_TOL,
    PAGED,
    SDPA,
    TOL,
    Spec,
    attention,
    make_case,
)

import pagedfuse
from pagedfuse.numerics import max_rel_err as rel_err
from pagedfuse.patterns import PAGED_SDPA, Match, Pattern, Precondition, unregister_pattern

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.mark.parametrize("spec", [Spec(), Spec(dequant="to_mul", gqa="repeat_kv", mask="where")],
                         ids=["float", "int8"])
def test_inductor_inner_compiles_the_rewritten_graph(spec):
    case = make_case(spec)
    fn = attention(spec)
    got = torch.compile(fn, backend=pagedfuse.backend())(*case.args())
    assert pagedfuse.last_report().num_rewritten == 1
    assert rel_err(got, fn(*case.args())) < (INT8_TOL if spec.dequant != "none" else 1e-4)


_BY_NAME = """
import sys, torch
import torch.nn.functional as F

def fn(q, kc, vc, bt):
    k = kc[bt].flatten(1, 2).transpose(1, 2)
    v = vc[bt].flatten(1, 2).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

args = (torch.randn(2, 4, 1, 64), torch.randn(8, 4, 2, 64), torch.randn(8, 4, 2, 64),
        torch.tensor([[0, 3], [5, 1]]))
got = torch.compile(fn, backend="pagedfuse", options={"fallback_random": True})(*args)
assert "pagedfuse" in sys.modules  # loaded by Dynamo through the entry point, not by us
import pagedfuse
print(pagedfuse.last_report().num_rewritten, float((got - fn(*args)).abs().max()))
"""


def test_backend_by_name_needs_no_import():
    """The torch_dynamo_backends entry point (installed by `make setup`)."""
    assert "pagedfuse" in torch._dynamo.list_backends()
    run = subprocess.run([sys.executable, "-c", _BY_NAME], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rewritten, err = run.stdout.split()
    assert rewritten == "1" and float(err) < 1e-5


def test_extra_keyword_arguments_are_accepted():
    capture = Capture()
    backend = pagedfuse.backend(inner=capture, mode="default", fullgraph=True, dynamic=False)
    case = make_case(Spec())
    torch.compile(attention(Spec()), backend=backend)(*case.args())
    assert capture.count(*PAGED) == 1


def test_unknown_inner_or_mode_is_rejected_up_front():
    with pytest.raises(ValueError, match="inner"):
        pagedfuse.backend(inner="tvm")
    with pytest.raises(RuntimeError, match="mode=fastest"):
        pagedfuse.backend(mode="fastest")


class PagedModel(torch.nn.Module):
    """Caches as buffers (static shapes even under dynamic=True), batch and length vary."""

    def __init__(self, spec: Spec):
        super().__init__()
        case = make_case(spec, num_blocks=48)
        for name in ("kc", "vc", "ks", "vs"):
            self.register_buffer(name, getattr(case, name))
        self.fn = attention(spec)

    def forward(self, q, bt, sl):
        return self.fn(q, self.kc, self.vc, bt, sl, self.ks, self.vs, None, None)


@pytest.mark.parametrize("how,inner", [("dynamic_true", "capture"), ("mark_dynamic", "capture"),
                                       ("mark_dynamic", "inductor")])
def test_dynamic_batch_and_length_do_not_recompile_per_value(how, inner):
    spec = Spec(gqa="repeat_kv", dequant="to_mul" if inner == "inductor" else "none")
    model = PagedModel(spec)
    capture = Capture()
    compiled = torch.compile(model, backend=pagedfuse.backend(
        inner=capture if inner == "capture" else inner),
        dynamic=True if how == "dynamic_true" else None)
    g = torch.Generator().manual_seed(1)
    compiles = []
    for batch, blocks in [(3, 5), (4, 6), (6, 3), (5, 7)]:
        q = torch.randn(batch, 8, 1, 64, generator=g)
        bt = torch.randperm(48, generator=g)[:batch * blocks].view(batch, blocks)
        sl = torch.randint(1, blocks * 4 + 1, (batch,), generator=g)
        if how == "mark_dynamic":
            for t, dims in ((q, (0,)), (bt, (0, 1)), (sl, (0,))):
                for d in dims:
                    torch._dynamo.mark_dynamic(t, d)
        got = compiled(q, bt, sl)
        assert rel_err(got, model(q, bt, sl)) < (INT8_TOL if spec.dequant != "none" else 1e-4)
        compiles.append(len(pagedfuse.reports()))
    assert compiles[1:] == compiles[:1] * 3  # nothing compiled after the first shape
    assert all(r.num_rewritten == 1 for r in pagedfuse.reports())
    if inner == "capture":
        assert len(capture.graphs) == 1
        assert capture.count(*PAGED) == 1 and capture.count(SDPA) == 0


def test_fullgraph():
    capture = Capture()
    case = make_case(Spec(mask="masked_fill"))
    fn = attention(Spec(mask="masked_fill"))
    got = torch.compile(fn, backend=pagedfuse.backend(inner=capture), fullgraph=True)(
        *case.args())
    assert capture.count(*PAGED) == 1 and rel_err(got, fn(*case.args())) < 1e-4


def test_every_graph_of_a_graph_break_is_rewritten():
    layer = attention(Spec())

    def two_layers(q, kc, vc, bt, sl, *rest):
        h = layer(q, kc, vc, bt, sl, *rest)
        torch._dynamo.graph_break()
        return layer(h, kc, vc, bt, sl, *rest)

    capture = Capture()
    case = make_case(Spec())
    got = torch.compile(two_layers, backend=pagedfuse.backend(inner=capture))(*case.args())
    assert len(capture.graphs) == 2 and capture.count(*PAGED) == 2 and capture.count(SDPA) == 0
    assert [r.num_rewritten for r in pagedfuse.reports()] == [1, 1]
    assert rel_err(got, two_layers(*case.args())) < 1e-4


def test_explain_reports_without_compiling():
    spec = Spec(dequant="to_mul")
    case = make_case(spec, head_dim=96)
    report = pagedfuse.explain(attention(spec), *case.args())
    assert report.num_sites == 1 and report.num_rewritten == 0
    site = report.sites[0]
    assert site.pattern == "paged_sdpa" and site.replacement is None
    head_dim = next(c for c in site.checks if c.name == "head_dim")
    assert not head_dim.passed
    assert head_dim.reason == "head_dim 96 not in {64, 128, 256} for paged_attention_int8 on cpu"
    assert "FAIL head_dim" in str(report) and "programs.py:" in site.site  # the user's source line
    d = report.to_dict()
    assert d["num_sites"] == 1 and d["sites"][0]["checks"][0]["name"] == "match"


def test_last_report_and_reports():
    case = make_case(Spec())
    torch.compile(attention(Spec()), backend=pagedfuse.backend(inner="eager"))(*case.args())
    report = pagedfuse.last_report()
    assert pagedfuse.reports() == [report]
    assert report.sites[0].rewritten and report.sites[0].replacement == "pagedfuse.paged_attention"
    assert all(c.passed for c in report.sites[0].checks)
    pagedfuse.clear_reports()
    assert pagedfuse.last_report() is None


def test_zero_rewrites_log_a_warning_naming_the_first_failed_check(caplog):
    spec = Spec(dropout=0.25)
    case = make_case(spec)
    with caplog.at_level(logging.INFO, logger="pagedfuse"):
        torch.compile(attention(spec), backend=pagedfuse.backend(inner="eager"))(*case.args())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "check 'dropout' failed" in warnings[0].getMessage()
    assert any(r.levelno == logging.INFO and "pagedfuse report" in r.getMessage()
               for r in caplog.records)


def _double_output_pattern(name: str) -> Pattern:
    """A pattern from outside the package: it takes the built-in match but swaps in SDPA
    times two (its own check and replacement), so its effect is visible and wrong."""

    def replace(graph, match: Match):
        with graph.inserting_before(match.anchor):
            twice = graph.call_function(torch.mul, (match.anchor.args[0], 0.0))
            sdpa = graph.call_function(SDPA, match.anchor.args, dict(match.anchor.kwargs))
            return graph.call_function(torch.add, (sdpa, sdpa if twice else twice))

    return Pattern(name=name, match=PAGED_SDPA.match, replace=replace,
                   preconditions=(Precondition("always", lambda m: None, lambda m: "fine"),))


def test_user_pattern_is_applied_and_reported():
    pagedfuse.register_pattern(_double_output_pattern("double"), first=True)
    try:
        capture = Capture()
        case = make_case(Spec())
        fn = attention(Spec())
        got = torch.compile(fn, backend=pagedfuse.backend(inner=capture))(*case.args())
    finally:
        unregister_pattern("double")
    site = pagedfuse.last_report().sites[0]
    assert site.pattern == "double" and site.rewritten
    assert [c.name for c in site.checks] == ["match", "always"]
    assert capture.count(*PAGED) == 0 and capture.count(SDPA) == 1
    assert rel_err(got, 2 * fn(*case.args())) < 1e-6


def test_patterns_entry_point_group_is_loaded(monkeypatch):
    from importlib.metadata import EntryPoint

    from pagedfuse.patterns import registry

    ep = EntryPoint("double_ep", "test_rewrite_backend:_entry_point_patterns",
                    "pagedfuse.patterns")
    monkeypatch.setattr(registry, "entry_points",
                        lambda group: [ep] if group == "pagedfuse.patterns" else [])
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    try:
        names = [p.name for p in pagedfuse.patterns.registered_patterns()]
    finally:
        unregister_pattern("double_ep")
    assert names == ["paged_sdpa", "double_ep"]


def _entry_point_patterns():
    return [_double_output_pattern("double_ep")]


@pytest.mark.parametrize("spec", [Spec(), Spec(dtype=torch.bfloat16),
                                  Spec(dequant="to_mul", gqa="repeat_interleave")],
                         ids=["fp32", "bf16", "int8"])
def test_verify_records_the_error_per_site(spec):
    case = make_case(spec)
    fn = attention(spec)
    got = torch.compile(fn, backend=pagedfuse.backend(inner="eager", verify=True))(*case.args())
    site = pagedfuse.last_report().sites[0]
    limit = INT8_TOL if spec.dequant != "none" else TOL[spec.dtype]
    assert site.verify_error is not None and 0 <= site.verify_error < limit
    assert rel_err(got, fn(*case.args())) < limit


def test_verify_raises_on_a_wrong_replacement():
    backend = pagedfuse.backend(inner="eager", verify=True,
                                patterns=[_double_output_pattern("double")])
    case = make_case(Spec())
    with pytest.raises(pagedfuse.VerificationError, match="site scaled_dot_product_attention"):
        torch.compile(attention(Spec()), backend=backend)(*case.args())
    assert pagedfuse.last_report().sites[0].verify_error == pytest.approx(1.0, rel=1e-5)


def test_verify_replays_on_clones_so_cache_writes_run_once():
    def step(q, kc, vc, bt, sl, new_k):
        kc[bt[:, 0], 0] += new_k  # in-place cache write before the read
        k = kc[bt].flatten(1, 2).transpose(1, 2)
        v = vc[bt].flatten(1, 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    case = make_case(Spec())
    new_k = torch.randn(3, 2, 64)
    eager_kc = case.kc.clone()
    want = step(case.q, eager_kc, case.vc, case.bt, case.sl, new_k)
    compiled = torch.compile(step, backend=pagedfuse.backend(inner="eager", verify=True))
    got = compiled(case.q, case.kc, case.vc, case.bt, case.sl, new_k)
    assert torch.equal(case.kc, eager_kc)  # written exactly once
    assert pagedfuse.last_report().num_rewritten == 1
    assert rel_err(got, want) < 1e-4


def test_replacement_of_the_wrong_shape_is_rolled_back():
    """The engine traces every replacement with fake tensors before swapping it in."""

    def wrong_shape(graph, match: Match):
        with graph.inserting_before(match.anchor):
            return graph.call_method("transpose", (match.anchor.args[0], 1, 2))

    case = make_case(Spec())
    fn = attention(Spec())
    runs = {}
    for name, patterns in (("bad", [Pattern("bad", PAGED_SDPA.match, wrong_shape)]),
                           ("none", [])):
        torch._dynamo.reset()
        capture = Capture()
        torch.compile(fn, backend=pagedfuse.backend(inner=capture, patterns=patterns))(
            *case.args())
        runs[name] = (capture.code(), pagedfuse.last_report())
    failed = runs["bad"][1].sites[0].first_failure
    assert failed.name == "replace" and "the replacement gives (3, 1, 8, 64)" in failed.reason
    assert runs["bad"][0] == runs["none"][0]


def test_cache_sizes_only_the_op_relates_are_unified_by_a_guard():
    """Under automatic dynamic shapes the K cache, the V cache and their scales get a size
    symbol each (the program never relates them). The op needs their block counts equal:
    where they are equal in the trace a guard keeps them so, and the site is rewritten; a
    later call where they differ recompiles, keeps the site as written, and equals eager."""
    spec = Spec(dequant="to_mul")
    fn = attention(spec)
    capture = Capture()
    compiled = torch.compile(fn, backend=pagedfuse.backend(inner=capture))
    for num_blocks in (16, 24):  # the second call compiles a graph with dynamic sizes
        case = make_case(spec, num_blocks=num_blocks, seed=num_blocks)
        got = compiled(*case.args())
        assert rel_err(got, fn(*case.args())) < INT8_TOL
    assert len(capture.graphs) == 2
    assert [count_calls(gm, *PAGED) for gm in capture.graphs] == [1, 1]

    uneven = make_case(spec, num_blocks=20, seed=3)
    more = make_case(spec, num_blocks=28, seed=4)
    uneven.vc, uneven.vs = more.vc, more.vs  # the table's ids index both
    got = compiled(*uneven.args())
    assert rel_err(got, fn(*uneven.args())) < INT8_TOL
    assert len(capture.graphs) == 3 and count_calls(capture.graphs[-1], *PAGED) == 0
    assert "value cache" in pagedfuse.last_report().table()

"""docs/extending.md's four recipes, run from the document itself: a new spelling, a
precondition, a kernel backend, a pattern published through the entry-point group."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.capture import Capture
from helpers.programs import PAGED, SDPA, Spec, attention, make_case

import pagedfuse
from pagedfuse import numerics
from pagedfuse.ops import backends
from pagedfuse.patterns import registry, unregister_pattern

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def recipe(name: str) -> str:
    """The python block after ``<!-- test: name -->`` in docs/extending.md."""
    found = re.search(rf"<!-- test: {name} -->\n```python\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"docs/extending.md has no block marked test: {name}"
    return found[1]


def run_recipe(name: str) -> dict:
    namespace = {"torch": torch, "__name__": f"extending_{name.replace('-', '_')}"}
    exec(compile(recipe(name), f"docs/extending.md ({name})", "exec"), namespace)
    return namespace


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_a_new_layout_spelling_is_followed(monkeypatch):
    from pagedfuse.graph import layout

    def program(q, kc, vc, bt):
        k = kc[bt].flatten(1, 2).movedim(2, 1)
        v = vc[bt].flatten(1, 2).movedim(2, 1)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    case = make_case(Spec(mask="none"))
    args = (case.q, case.kc, case.vc, case.bt)
    want = program(*args)
    before = pagedfuse.explain(program, *args)
    assert before.num_rewritten == 0 and "movedim" in str(before)

    rules = dict(layout.LAYOUT_RULES)
    monkeypatch.setattr(layout, "LAYOUT_RULES", rules)
    run_recipe("spelling")
    torch._dynamo.reset()
    capture = Capture()
    got = torch.compile(program, backend=pagedfuse.backend(inner=capture))(*args)
    assert (capture.count(*PAGED), capture.count(SDPA)) == (1, 0)
    assert numerics.max_rel_err(got, want) <= 1e-4


def test_a_precondition_keeps_a_site_and_says_why():
    run_recipe("precondition")
    try:
        short = make_case(Spec(), blocks=3, block_size=4)
        long = make_case(Spec(), blocks=33, block_size=128, num_blocks=100)
        for case, fused in ((short, True), (long, False)):
            torch._dynamo.reset()
            fn = attention(Spec())
            got = torch.compile(fn, backend=pagedfuse.backend(inner="eager"))(*case.args())
            site = pagedfuse.last_report().sites[0]
            check = next(c for c in site.checks if c.name == "short context")
            assert site.rewritten == fused
            assert check.passed == fused
            if not fused:
                assert check.reason == ("context of 4224 keys: this deployment fuses at most "
                                        "4096")
            assert numerics.max_rel_err(got, fn(*case.args())) <= 1e-4
    finally:
        pagedfuse.register_pattern(pagedfuse.patterns.PAGED_SDPA)
    assert pagedfuse.patterns.registered_patterns()[0] is pagedfuse.patterns.PAGED_SDPA


def test_a_kernel_backend_is_chosen():
    namespace = run_recipe("backend")
    try:
        case = make_case(Spec(mask="none"), batch=3, head_dim=64)
        q = case.q[:, :, 0]
        lens = torch.full((3,), case.kc.shape[1] * case.bt.shape[1], dtype=torch.int32)
        starts = torch.arange(4, dtype=torch.int32)
        args = (q, case.kc, case.vc, case.bt, lens, starts)
        report = backends.support_report("paged_attention", *args)
        assert str(report) == "would run demo_sdpa; cpu: ok"
        out = torch.ops.pagedfuse.paged_attention(*args, 0.125, False)
        ref = pagedfuse.ops.paged_attention_reference(
            *(t.double() if t.is_floating_point() else t for t in args), 0.125, False)
        assert numerics.rel_err(out, ref) <= numerics.KERNEL_RTOL[torch.float32]
        causal = backends.support_report("paged_attention", *args, causal=True)
        assert str(causal) == "would run cpu; demo_sdpa: no attn_bias, no causal"
        assert namespace["DEMO"] is backends.get_backend("demo_sdpa")
    finally:
        backends.unregister_backend("demo_sdpa")


def test_a_pattern_published_through_the_entry_point_group_is_loaded(tmp_path, monkeypatch):
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "patterns.py").write_text(recipe("entry-point"))
    info = tmp_path / "my_package-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-package\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [pagedfuse.patterns]
        my_attention = my_package.patterns:patterns
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    try:
        names = [p.name for p in pagedfuse.patterns.registered_patterns()]
        assert names[-1] == "my_attention" and "paged_sdpa" in names
        unregister_pattern("paged_sdpa")
        case = make_case(Spec())
        torch.compile(attention(Spec()), backend=pagedfuse.backend(inner="eager"))(
            *case.args())
        site = pagedfuse.last_report().sites[0]
        assert site.pattern == "my_attention" and site.rewritten
    finally:
        unregister_pattern("my_attention")
        pagedfuse.register_pattern(pagedfuse.patterns.PAGED_SDPA, first=True)
        sys.modules.pop("my_package.patterns", None)
        sys.modules.pop("my_package", None)

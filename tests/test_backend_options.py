"""The backend's settings: through ``torch.compile(..., options=...)`` and ``pagedfuse.backend``,
inductor's passed on, misspelt names refused with the valid ones listed, patterns by name; and
``pagedfuse.explain`` on many calls of one function."""

from __future__ import annotations

import pytest
import torch
from helpers.capture import Capture
from helpers.programs import PAGED, SDPA, Spec, attention, make_case

import pagedfuse
from pagedfuse.numerics import max_rel_err

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def test_pagedfuse_settings_through_torch_compile_options():
    """verify=True through options runs verify mode: the site's error against the original
    is recorded (the inductor config error this used to raise would stop the compile)."""
    case = make_case(Spec())
    fn = attention(Spec())
    got = torch.compile(fn, backend="pagedfuse",
                        options={"verify": True, "inner": "eager"})(*case.args())
    site = pagedfuse.last_report().sites[0]
    assert site.rewritten and site.verify_error is not None and site.verify_error < 1e-4
    assert max_rel_err(got, fn(*case.args())) < 1e-4


def test_inductor_options_pass_through_beside_pagedfuse_settings(monkeypatch):
    from torch._inductor import compile_fx

    seen = {}

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen["patches"] = config_patches
        seen["paged"] = sum(1 for n in gm.graph.nodes if n.target in PAGED)
        return gm.forward

    monkeypatch.setattr(compile_fx, "compile_fx", fake_compile_fx)
    case = make_case(Spec())
    torch.compile(attention(Spec()), backend="pagedfuse",
                  options={"verify": False, "fallback_random": True,
                           "patterns": ["paged_sdpa"]})(*case.args())
    assert seen == {"patches": {"fallback_random": True}, "paged": 1}


@pytest.mark.parametrize("kwargs, message", [
    (dict(verfy=True), "'verfy': did you mean 'verify'"),
    (dict(options={"inerr": "eager"}), "'inerr': did you mean 'inner'"),
    (dict(options={"not_an_inductor_option": 1}), "unknown option 'not_an_inductor_option'"),
    (dict(verify=True, options={"verify": False}), "verify given both as an argument"),
    (dict(inner="eager", options={"fallback_random": True}),
     r"inductor settings \(fallback_random\) given, but inner"),
    (dict(inner="eager", mode="max-autotune"), r"inductor settings \(mode\)"),
    (dict(patterns=["paged_sdpa", "no_such"]), "no pattern named 'no_such'"),
    (dict(inner="tvm"), "inner: expected"),
])
def test_bad_settings_raise_naming_what_is_valid(kwargs, message):
    with pytest.raises(ValueError, match=message) as exc:
        pagedfuse.backend(**kwargs)
    if "unknown" in message or "did you mean" in message:
        for name in ("inner", "verify", "patterns", "mode", "options"):
            assert f"{name}:" in str(exc.value)


def test_misspelt_option_through_torch_compile_stops_the_compile():
    case = make_case(Spec())
    compiled = torch.compile(attention(Spec()), backend="pagedfuse", options={"verfy": True})
    with pytest.raises(Exception, match="did you mean 'verify'"):
        compiled(*case.args())


def test_patterns_by_name_and_an_empty_list():
    case = make_case(Spec())
    for patterns, paged in ((["paged_sdpa"], 1), ("paged_sdpa", 1), ([], 0)):
        torch._dynamo.reset()
        capture = Capture()
        torch.compile(attention(Spec()),
                      backend=pagedfuse.backend(inner=capture, patterns=patterns))(*case.args())
        assert (capture.count(*PAGED), capture.count(SDPA)) == (paged, 1 - paged)


def test_dynamo_arguments_handed_to_the_factory_are_accepted():
    """transformers' CompileConfig may hand torch.compile's own arguments on."""
    capture = Capture()
    backend = pagedfuse.backend(inner=capture, fullgraph=True, dynamic=False)
    case = make_case(Spec())
    torch.compile(attention(Spec()), backend=backend)(*case.args())
    assert capture.count(*PAGED) == 1


def test_explain_keeps_reporting_past_dynamos_recompile_limit():
    """Twelve calls of one function, each with another dtype or head_dim (a recompile each):
    every report is the one a first compile of those inputs gives, not a dynamic head_dim,
    and none is empty (Dynamo's limit is 8 recompiles per function)."""
    fn = attention(Spec())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_dim in (32, 64, 128, 256):
            report = pagedfuse.explain(fn, *make_case(Spec(dtype=dtype),
                                                      head_dim=head_dim).args())
            checks = {c.name: c for c in report.sites[0].checks} if report.sites else {}
            assert (report.num_sites, report.num_rewritten) == (1, 1), (dtype, head_dim)
            assert checks["head_dim"].reason == f"head_dim {head_dim}"


def test_explain_after_a_real_compile_of_the_same_function():
    fn = attention(Spec())
    case = make_case(Spec())
    torch.compile(fn, backend=pagedfuse.backend(inner="eager"))(*case.args())
    for _ in range(10):
        assert pagedfuse.explain(fn, *case.args()).num_rewritten == 1

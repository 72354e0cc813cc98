"""The report's lines agree with each other: a site whose head_dim has no kernel is not also
reported as one a kernel would run (the kernel check and the head_dim check ask one registry)."""

from __future__ import annotations

import pytest
import torch
from helpers.programs import Spec, attention, make_case

import pagedfuse


@pytest.mark.parametrize("spec, head_dim", [(Spec(dequant="to_mul"), 96), (Spec(), 48),
                                            (Spec(), 64)],
                         ids=["int8-96", "float-48", "float-64"])
def test_head_dim_and_kernel_checks_agree(spec, head_dim):
    torch._dynamo.reset()
    report = pagedfuse.explain(attention(spec), *make_case(spec, head_dim=head_dim).args())
    checks = {c.name: c for c in report.sites[0].checks}
    assert checks["head_dim"].passed == checks["kernel"].passed == report.sites[0].rewritten
    lines = str(report).splitlines()
    kernel_line = next(line for line in lines if line.strip().split()[1:2] == ["kernel"])
    if checks["head_dim"].passed:
        assert kernel_line.strip().startswith("ok") and "would run cpu" in kernel_line
    else:
        assert kernel_line.strip().startswith("FAIL") and f"head_dim {head_dim}" in kernel_line

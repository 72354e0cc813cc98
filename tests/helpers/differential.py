"""Run a program eagerly and through pagedfuse on separate copies of its inputs and compare
everything it leaves behind: its outputs and every input it wrote in place."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map

import pagedfuse
from pagedfuse.numerics import INT8_SITE_RTOL as INT8_TOLERANCE
from pagedfuse.numerics import SITE_RTOL as TOLERANCES

__all__ = ["INT8_TOLERANCE", "Outcome", "differential", "mismatch"]


def clone_inputs(args: object) -> object:
    """Fresh leaves with the same values, dtypes and requires_grad (pytree of tensors)."""
    return tree_map(lambda a: a.detach().clone().requires_grad_(a.requires_grad)
                    if isinstance(a, torch.Tensor) else a, args)


def mismatch(got: object, want: object, tolerance: float | None = None) -> str | None:
    """Why ``got`` differs from ``want`` (None when equal within tolerance: max |got - want| /
    max |want| over the finite values, verify mode's tolerance per dtype; NaN == NaN)."""
    if not isinstance(want, torch.Tensor):
        return None if got == want else f"{got!r} != {want!r}"
    if not isinstance(got, torch.Tensor):
        return f"got {type(got).__name__}, want a tensor"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    if got.requires_grad != want.requires_grad:
        return f"requires_grad {got.requires_grad}, eager {want.requires_grad}"
    g, w = got.detach().double(), want.detach().double()
    if not want.dtype.is_floating_point:
        return None if torch.equal(g, w) else "integer values differ"
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        return f"NaN in {int(nan_g.sum())} places, eager in {int(nan_w.sum())}"
    keep = ~nan_w
    if not bool(keep.any()):
        return None
    same_inf = (g[keep] == w[keep]) | ~torch.isinf(w[keep])
    if not bool(same_inf.all()):
        return "infinities differ"
    finite = keep & torch.isfinite(w)
    if not bool(finite.any()):
        return None
    err = float((g - w)[finite].abs().max() / w[finite].abs().max().clamp_min(1e-30))
    limit = TOLERANCES.get(want.dtype, 2e-2) if tolerance is None else tolerance
    return None if err <= limit else f"max relative error {err:.3g} > {limit:g}"


@dataclass
class Outcome:
    """What eager and the compiled program did with the same inputs."""

    report: pagedfuse.Report
    eager_error: BaseException | None = None
    compiled_error: BaseException | None = None
    mismatches: list[str] = field(default_factory=list)

    @property
    def rewritten(self) -> bool:
        return self.report.num_rewritten > 0

    def reasons(self) -> list[str]:
        return [f"{c.name}: {c.reason}" for s in self.report.sites for c in s.checks
                if not c.passed]

    def check(self) -> None:
        """The differential oracle: where eager runs, the compiled program runs too and leaves
        the same outputs and inputs behind; a site left as written says why."""
        if self.eager_error is not None:
            return
        assert self.compiled_error is None, f"compiled raised where eager ran: " \
            f"{self.compiled_error!r}\n{self.report}"
        assert not self.mismatches, f"{self.mismatches}\n{self.report}"
        for site in self.report.sites:
            assert site.rewritten or site.first_failure is not None, site


def differential(fn: Callable, args: tuple, *, tolerance: float | None = None,
                 backward: bool = False, **backend_kwargs: object) -> Outcome:
    """Run ``fn(*args)`` eagerly and compiled by pagedfuse (eager inner compiler) on clones of
    ``args``; compare outputs, every input tensor afterwards and, with ``backward``, the
    gradients of the inputs that require grad."""
    eager_args, compiled_args = clone_inputs(args), clone_inputs(args)
    want = got = None
    try:
        want = fn(*eager_args)
    except Exception as exc:  # eager's own error: the compiled program may do anything
        return Outcome(pagedfuse.Report(), eager_error=exc)
    torch._dynamo.reset()
    pagedfuse.clear_reports()
    backend = pagedfuse.backend(**{"inner": "eager", **backend_kwargs})
    outcome = Outcome(pagedfuse.Report())
    try:
        got = torch.compile(fn, backend=backend)(*compiled_args)
        if backward:
            _backward(got)
    except Exception as exc:
        outcome.compiled_error = exc
    outcome.report = pagedfuse.Report.merged(pagedfuse.reports())
    if outcome.compiled_error is not None:
        return outcome
    if backward:
        _backward(want)
    pairs = [("output", got, want)]
    pairs += [(f"input {i}", g, w) for i, (g, w) in
              enumerate(zip(tree_flatten(compiled_args)[0], tree_flatten(eager_args)[0],
                            strict=True))]
    if backward:
        pairs += [(f"grad of input {i}", g.grad, w.grad) for i, (g, w) in
                  enumerate(zip(tree_flatten(compiled_args)[0], tree_flatten(eager_args)[0],
                                strict=True)) if isinstance(w, torch.Tensor) and w.requires_grad]
    for what, g, w in pairs:
        for j, (gi, wi) in enumerate(zip(tree_flatten(g)[0], tree_flatten(w)[0], strict=True)):
            why = mismatch(gi, wi, tolerance)
            if why:
                outcome.mismatches.append(f"{what}[{j}]: {why}")
    return outcome


def _backward(out: object) -> None:
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
               and t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])

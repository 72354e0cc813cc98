"""Error measures and tolerances: the one place that says how close is close enough.

Two measures, both computed in float64 on the CPU:
- ``rel_err``: ||got - want|| / ||want|| over the whole tensor. Kernels are held to it
  against the float64 reference of the same op (``kernel_tolerance``).
- ``max_rel_err``: max |got - want| / max |want|, the worst element. Verify mode holds a
  rewritten site to it against the subgraph it replaced (``site_tolerance``).
A NaN in ``got`` makes either measure NaN, which fails every ``<=`` comparison.
"""

from __future__ import annotations

import torch

# rel_err of a kernel's output against the float64 reference of the same op: the output's
# own rounding plus the kernels' 16-bit P (softmax weights) for 16-bit queries.
KERNEL_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# INT8 K+V: a kernel may quantize P per row for an int8 P·V (the CUDA kernels do).
INT8_PV_RTOL = 3e-2
# INT8 kernels that keep scores exact in integers and P in fp32 (the CPU kernels): only the
# fp32 rounding differs from the reference, which quantizes the query the same way.
EXACT_INT8_RTOL = 1e-5
# rel_err of the INT8 ops against attention over the caches before quantization: per-row
# int8 of Gaussian data costs about 0.8-1.2% (head_dim 256 with int8 V is closest).
QUANTIZATION_RTOL = 1.2e-2
# max_rel_err of a rewritten site against the subgraph it replaced (verify mode).
SITE_RTOL = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 2e-2,
             torch.float16: 2e-2}
INT8_SITE_RTOL = 5e-2


def _pair(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return got.detach().cpu().double(), want.detach().cpu().double()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||: the whole-tensor relative error."""
    got, want = _pair(got, want)
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def max_rel_err(got: torch.Tensor, want: torch.Tensor, skip_nan_reference: bool = False
                ) -> float:
    """max |got - want| / max |want|. ``skip_nan_reference``: leave out the elements where
    ``want`` is NaN (rows SDPA leaves NaN when every key is masked; 0 if all are)."""
    got, want = _pair(got, want)
    if skip_nan_reference:
        keep = ~torch.isnan(want)
        if not bool(keep.any()):
            return 0.0
        got, want = got[keep], want[keep]
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def kernel_tolerance(dtype: torch.dtype, kind: str = "float") -> float:
    """rel_err bound of a kernel with ``dtype`` queries against the float64 reference;
    ``kind`` is PagedCall.kind ("float", "int8_k" or "int8_kv")."""
    tol = KERNEL_RTOL[dtype]
    return max(tol, INT8_PV_RTOL) if kind == "int8_kv" else tol


def site_tolerance(dtype: torch.dtype, int8: bool = False) -> float:
    """max_rel_err bound of a rewritten site whose output has ``dtype``."""
    return INT8_SITE_RTOL if int8 else SITE_RTOL.get(dtype, SITE_RTOL[torch.bfloat16])

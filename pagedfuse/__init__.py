"""pagedfuse: a torch.compile backend that swaps paged-KV attention for fused kernels."""

__version__ = "0.1.0"  # the one place: pyproject.toml reads it from here (doctor imports it)

from pagedfuse import ops
from pagedfuse.doctor import PagedfuseWarning, warn_if_degraded
from pagedfuse.patterns import Check, Match, Pattern, Precondition, register_pattern
from pagedfuse.rewrite import (
    Report,
    SiteReport,
    VerificationError,
    backend,
    clear_reports,
    explain,
    last_report,
    reports,
)

warn_if_degraded(check_arch=False)  # the GPU's own check waits for the first compile on it

__all__ = [
    "Check",
    "Match",
    "PagedfuseWarning",
    "Pattern",
    "Precondition",
    "Report",
    "SiteReport",
    "VerificationError",
    "__version__",
    "backend",
    "clear_reports",
    "explain",
    "last_report",
    "ops",
    "register_pattern",
    "reports",
]

"""pagedfuse: a torch.compile backend that swaps paged-KV attention for fused kernels."""

from pagedfuse import ops
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

__version__ = "0.1.0"

__all__ = [
    "Check",
    "Match",
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

"""The backend: anchors, the rewrite engine, reports, verify mode."""

from pagedfuse.rewrite.backend import backend, explain, pagedfuse_backend
from pagedfuse.rewrite.report import Report, SiteReport, clear_reports, last_report, reports
from pagedfuse.rewrite.verify import VerificationError

__all__ = [
    "Report",
    "SiteReport",
    "VerificationError",
    "backend",
    "clear_reports",
    "explain",
    "last_report",
    "pagedfuse_backend",
    "reports",
]

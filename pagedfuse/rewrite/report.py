"""The report of a compile: each SDPA site, the pattern tried, its checks, the swap.

Reports are kept per graph (a model with graph breaks yields several) and logged through
``logging.getLogger("pagedfuse")``: the table at INFO, and a WARNING when a graph has
attention sites but none was rewritten, naming the first failed check.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from pagedfuse.patterns.base import Check

log = logging.getLogger("pagedfuse")


@dataclass
class SiteReport:
    site: str
    pattern: str | None
    checks: list[Check] = field(default_factory=list)
    replacement: str | None = None
    rewritten: bool = False
    verify_error: float | None = None

    @property
    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if not c.passed), None)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Report:
    sites: list[SiteReport] = field(default_factory=list)
    graph: str = ""

    @property
    def num_sites(self) -> int:
        return len(self.sites)

    @property
    def num_rewritten(self) -> int:
        return sum(s.rewritten for s in self.sites)

    def to_dict(self) -> dict:
        return {"graph": self.graph, "num_sites": self.num_sites,
                "num_rewritten": self.num_rewritten, "sites": [s.to_dict() for s in self.sites]}

    def table(self) -> str:
        head = (f"pagedfuse report{' (' + self.graph + ')' if self.graph else ''}: "
                f"{self.num_sites} attention site(s), {self.num_rewritten} rewritten")
        lines = [head]
        for s in self.sites:
            swap = s.replacement if s.rewritten else "kept as written"
            err = "" if s.verify_error is None else f"  verify max rel err {s.verify_error:.2e}"
            lines.append(f"- {s.site}  [{s.pattern or 'no pattern'}] -> {swap}{err}")
            for c in s.checks:
                lines.append(f"    {'ok  ' if c.passed else 'FAIL'} {c.name:<15} {c.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    @classmethod
    def merged(cls, reports: list[Report]) -> Report:
        """One report over several graphs (e.g. the pieces of a function with graph breaks)."""
        return cls([s for r in reports for s in r.sites], ", ".join(r.graph for r in reports))


_reports: list[Report] = []


def record(report: Report) -> None:
    """Keep ``report`` and log it."""
    _reports.append(report)
    log.info("%s", report.table())
    if report.num_sites and not report.num_rewritten:
        site = report.sites[0]
        failed = site.first_failure
        why = f"check '{failed.name}' failed: {failed.reason}" if failed else "no pattern ran"
        log.warning("pagedfuse: %d attention site(s) in %s, none rewritten; first: %s: %s",
                    report.num_sites, report.graph or "the graph", site.site, why)


def last_report() -> Report | None:
    """The report of the most recently compiled graph."""
    return _reports[-1] if _reports else None


def reports() -> list[Report]:
    """Every graph's report since the last ``clear_reports()``."""
    return list(_reports)


def clear_reports() -> None:
    _reports.clear()

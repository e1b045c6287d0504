"""The pre-flight's report (``trainer_agent/diagnostics/preflight.py`` runs the checks): each check's
result, the report with its log and table forms, its wire form for the controller, the failure that
a ``fatal`` pre-flight raises, and the exception that ends a script under ``trainguard preflight``."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from trainguard.protocol.wire import PreflightCheck, PreflightResult

log = logging.getLogger(__name__)

__all__ = ["Status", "Check", "PreflightReport", "PreflightOnly", "PREFLIGHT_ONLY_ENV", "raise_if_fatal", "to_wire"]

#: How a check ended (``skip``: not applicable).
Status = Literal["pass", "warn", "fail", "skip"]


#: Set (to 1) by ``trainguard preflight``: ``Agent.preflight`` ends the process's script right
#: after the checks by raising :class:`PreflightOnly`, before any training step.
PREFLIGHT_ONLY_ENV = "TRAINGUARD_PREFLIGHT_ONLY"


class PreflightOnly(BaseException):
    """Raised by ``Agent.preflight`` under ``trainguard preflight``: carries the report out of the
    user's script (a ``BaseException``, so the script's ``except Exception`` does not catch it;
    its ``finally`` blocks, e.g. ``agent.close()``, still run)."""

    def __init__(self, report: PreflightReport | None, rank: int) -> None:
        super().__init__("trainguard preflight: the checks ran; training is not started" if report is not None else
                         "trainguard preflight: the script started training without calling agent.preflight")
        self.report, self.rank = report, rank  # report None: an optimizer step came first


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: Status
    detail: str
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PreflightReport:
    checks: tuple[Check, ...]
    seconds: float

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    @property
    def warned(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    def status(self, name: str) -> Status:
        return next(c.status for c in self.checks if c.name == name)

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "checks": [asdict(c) for c in self.checks]}

    def summary(self) -> str:
        lines = [f"{c.status.upper():4} {c.name}: {c.detail}" for c in self.checks]
        return "\n".join(lines)

    def table(self) -> str:
        """The checks as a table, with a count per status on the last line."""
        width = max((len(c.name) for c in self.checks), default=5)
        lines = [f"{'CHECK':<{width}}  STATUS  DETAIL"]
        lines += [f"{c.name:<{width}}  {c.status.upper():<6}  {c.detail}" for c in self.checks]
        counts = {s: sum(c.status == s for c in self.checks) for s in ("pass", "warn", "fail", "skip")}
        lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({self.seconds:.2f} s)")
        return "\n".join(lines)

def raise_if_fatal(report: PreflightReport, fatal: bool | Iterable[str]) -> None:
    """``RuntimeError`` when a check named in ``fatal`` (every check for True) failed."""
    ran = {c.name for c in report.checks}
    names = ran if fatal is True else set(fatal or ())
    if names - ran:  # a misspelt name would never fail the run: say so
        log.warning("trainguard pre-flight: preflight_fatal names %s, which this pre-flight did not run (it ran: %s)",
                    ", ".join(sorted(names - ran)), ", ".join(sorted(ran)))
    failed = [c for c in report.failed if c.name in names]
    if failed:
        raise RuntimeError("trainguard pre-flight failed: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))


def to_wire(report: PreflightReport, rank: int) -> PreflightResult:
    return PreflightResult(rank=rank, seconds=report.seconds,
                           checks=[PreflightCheck(name=c.name, status=c.status, detail=c.detail[:2000])
                                   for c in report.checks])

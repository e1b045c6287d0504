"""One report through the rules: the evaluate → decide → record sequence, without I/O.

The live controller (:class:`service.ingest.ReportIngest`) and the replay
(:func:`service.engine.simulate`: ``POST /v1/rules/test``, ``trainguard rules test``) both call
:func:`evaluate_report`, so a replayed report sequence fires, resolves, changes the desired state
and moves the incidents exactly as the running controller does. The caller then persists and
publishes (ingest) or records a :class:`~service.engine.SimStep` (simulate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from trainguard.service.engine import AlertBook, Outcome, decide
from trainguard.service.evaluate import Finding, evaluate
from trainguard.service.incidents import RecoveryChange, RunRecovery
from trainguard.service.window import RunWindow
from trainguard.protocol.wire import DesiredState, Report

__all__ = ["StepResult", "evaluate_report"]


@dataclass(slots=True)
class StepResult:
    """What one report caused, before anything is written."""

    findings: list[Finding]
    outcome: Outcome
    """The rules' alerts fired, resolved and suppressed, and the desired state their actions lead to."""
    changes: list[RecoveryChange]
    """The recovery's own changes after the rules (escalation rungs, LR ramp steps), newest last."""
    incidents: list[tuple[dict[str, Any] | None, dict[str, Any]]]
    """Each incident the report opened or changed: (before, None for a new one; now), as dicts."""
    recovery_saved: dict[str, Any]
    """The recovery state before the report (``RunRecovery.restore`` takes the report back)."""

    @property
    def desired(self) -> DesiredState:
        """The desired state after the report: the recovery's last change, else the rules'."""
        return self.changes[-1].desired if self.changes else self.outcome.desired


def evaluate_report(
    report: Report, ranks: dict[str, np.ndarray], now: float, *, rules: tuple[Any, ...], window: RunWindow,
    book: AlertBook, recovery: RunRecovery, desired: DesiredState, rank_hosts: list[dict[str, Any]] | tuple[()] = (),
    gap: Outcome | None = None,
) -> StepResult:
    """Append ``report`` (received at ``now``, its per-rank ``ranks`` already checked) to
    ``window``, evaluate ``rules``, let ``recovery`` decide the cause, decide the alerts from
    ``desired`` with ``book``, and feed ``recovery`` the result. ``gap``: the absence rules'
    outcome decided at ``now`` before the report (the replay's stand-in for the ticker): its
    desired state is the one the rules decide from and its alerts count as fired with the
    report's. ``rank_hosts``: the run's registered ranks (hardware evidence for the cause)."""
    saved = recovery.save()
    window.append_raw(report.values, ranks, report.step_last, now)
    window.desync = tuple(report.desync)
    recovery.before_decide(report.values)
    findings = evaluate(rules, window, now)
    recovery.consider(findings, window, ranks=rank_hosts)
    outcome = decide(findings, book, desired if gap is None else gap.desired, now, complete=True, ctx=recovery)
    fired = (*gap.fired, *outcome.fired) if gap is not None else outcome.fired
    changes = recovery.after_report(step=report.step_last, values=report.values, findings=findings, before=desired,
                                    desired=outcome.desired,
                                    fired=[(fa.finding.rule.name, fa.desired) for fa in fired if fa.desired is not None],
                                    now=now)
    return StepResult(findings, outcome, changes, recovery.changed_incidents(saved), saved)

"""Recording what the rules decided (:class:`~service.engine.Outcome`): the alerts fired and
resolved, the desired-state changes, the recovery's own changes and the incidents that changed,
written in one transaction and published, and counted in the controller's metrics. The report
path and the absence ticker both record through it."""

from __future__ import annotations

import sqlite3
from typing import Any, Callable

from trainguard.service import statements as sql
from trainguard.service.committer import Commit
from trainguard.service.config import Settings
from trainguard.service.engine import Outcome
from trainguard.service.incidents import RecoveryChange
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.rank_nodes import rank_nodes
from trainguard.service.runstate import RunState, action_names
from trainguard.service.transaction import Transaction, Written, record_fired, record_incident, record_resolved
from trainguard.service.webhooks import IncidentUpdate
from trainguard.protocol.wire import DesiredState

__all__ = ["OutcomeRecorder", "firing_entry"]


def firing_entry(alert: dict[str, Any], *, kind: str) -> dict[str, Any]:
    """A firing alert as ``RunState.firing`` holds it, from its stored row."""
    return {
        "id": alert["id"], "rule": alert["rule"], "kind": kind, "severity": alert["severity"],
        "summary": alert["summary"], "starts_at": alert["starts_at"], "values": alert["values"],
        "diagnosis": alert["diagnosis"], "fingerprint": alert["fingerprint"],
    }


class OutcomeRecorder:
    """Writes and publishes a decision's outcome (:meth:`record`); counts actions and suppressions."""

    def __init__(self, settings: Settings, metrics: ControllerMetrics, commit: Commit) -> None:
        self.settings = settings
        self.metrics = metrics
        self.commit = commit

    def count_suppressed(self, outcome: Outcome) -> None:
        """Findings a cooldown or cap held back (they may come with nothing else to commit)."""
        for f, why in outcome.suppressed:
            self.metrics.suppressed.labels(f.rule.name, why).inc()

    async def record(self, st: RunState, outcome: Outcome, now: float, tx: Transaction,
                     extra: Callable[[sqlite3.Connection], Any] | None = None, *,
                     changes: list[RecoveryChange] | None = None,
                     incidents: list[tuple[dict[str, Any], IncidentUpdate]] | None = None) -> None:
        """Write the alerts, desired-state changes, events and outbox rows of ``outcome`` (which
        has fired or resolved something), and the recovery's own ``changes`` (escalation rungs,
        LR ramp) and ``incidents`` that changed (each with its change: an event and the webhooks'
        messages), in one transaction with ``extra``, then publish them."""
        self.count_suppressed(outcome)
        tx.on_rollback(lambda: st.book.undo(outcome.book_prior))
        before = st.desired
        changes, incidents = changes or [], incidents or []
        final = changes[-1].desired if changes else outcome.desired
        tx.assign(st, desired=final)
        run_id, run, job, external = st.id, st.run, st.job, self.settings.external_url
        nodes = rank_nodes(st.ranks)
        step = st.window.last_step  # the step of the report that fired (absence: the last one seen)

        def op(c: sqlite3.Connection) -> Written:
            if extra is not None:
                extra(c)
            hooks = sql.active_webhooks(c)
            out = Written(value=[])
            for fa in outcome.fired:
                alert = record_fired(c, run_id, run, fa, now, step=step, hooks=hooks, external_url=external, out=out,
                                     nodes=nodes)
                out.value.append(alert | {"kind": fa.finding.rule.kind})
            for name in outcome.resolved:
                record_resolved(c, run_id, name, now, actor=f"rule:{name}", reason="condition cleared",
                                hooks=hooks, external_url=external, out=out)
            for ch in changes:
                sql.update_desired(c, run_id, ch.desired)
                out.events.append(sql.insert_event(c, run_id, now=now, kind="desired", actor=ch.actor,
                                                   reason=ch.desired.reason, generation=ch.desired.generation,
                                                   data={"desired": ch.desired.model_dump()}))
            for inc, change in incidents:
                record_incident(c, run_id, run, job, inc, change, now, hooks=hooks, external_url=external, out=out)
            return out

        await self.commit(tx, op, after=lambda w: self._published(st, w, outcome, before, changes, incidents, final))

    def _published(self, st: RunState, w: Written, outcome: Outcome, before: DesiredState, changes: list[RecoveryChange],
                   incidents: list[tuple[dict[str, Any], IncidentUpdate]], final: DesiredState) -> None:
        """After :meth:`record`'s commit: the firing alerts in memory, the counters, and ``final``
        published to the agents."""
        for alert in w.value:
            st.firing[alert["rule"]] = firing_entry(alert, kind=alert["kind"])
            self.metrics.alerts.labels(alert["rule"], alert["severity"]).inc()
        for name in outcome.resolved:
            st.firing.pop(name, None)
        prev = before
        for fa in outcome.fired:
            if fa.desired is not None:
                self.count_actions(prev, fa.desired, "rule")
                prev = fa.desired
        for ch in changes:
            self.count_actions(prev, ch.desired, "recovery")
            prev = ch.desired
        for _, change in incidents:
            self.metrics.count_incident(change)
        st.publish(final)

    def count_actions(self, before: DesiredState, after: DesiredState, source: str) -> None:
        for action in action_names(before, after):
            self.metrics.actions.labels(action, source).inc()

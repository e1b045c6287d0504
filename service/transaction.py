"""One change of the controller's state as one transaction.

Every change follows the same path: the in-memory state changes first, synchronously on the event
loop (so that the next report, command or tick already sees it); one store operation writes the
change with everything it implies (audit events, alerts, resolved alerts, webhook outbox rows) in
one transaction; and only after the commit is anything published (events to the SSE stream,
outbox rows to the webhook worker, the desired state to the agents, by the caller). If the commit
fails, every in-memory change is taken back, so the state is exactly what it was before: a report
that got a 503 is not in the rule window, an alert that could not be recorded has not fired (the
rule fires again on the next report), a command that could not be written did not happen.

A :class:`Transaction` collects the in-memory changes with their undos;
:meth:`service.committer.Committer.commit` runs the operation and publishes or takes back. An operation returns a
:class:`Written`. :func:`record_fired` and :func:`record_resolved` write the alerts of a decision,
:func:`record_incident` a change of an incident.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Any, Callable

from trainguard.service import statements as sql
from trainguard.service.diagnosis import DIAGNOSES
from trainguard.service.engine import FiredAlert
from trainguard.service.rank_nodes import with_nodes
from trainguard.service.webhooks import (
    SEVERITY_RANK, IncidentUpdate, fingerprint, incident_wanted, render, render_incident,
)

__all__ = ["Transaction", "Written", "record_fired", "record_resolved", "record_incident"]


@dataclass(slots=True)
class Written:
    """What a transaction's store operation wrote."""

    events: list[int] = field(default_factory=list)
    """Audit events (ids): published to the event stream after the commit."""
    outbox: int = 0
    """Webhook outbox rows: the webhook worker is woken for them after the commit."""
    value: Any = None
    """Whatever else the caller needs back (ids, rows)."""
    published: list[dict[str, Any]] = field(default_factory=list)
    """The events read back inside the transaction (filled in by the controller's commit)."""


class Transaction:
    """In-memory changes made ahead of a commit, each with its undo.

    :meth:`assign` sets attributes and remembers their old values; :meth:`on_rollback` registers
    any other undo. :meth:`rollback` runs the undos newest first. An attribute is restored only
    while it still holds the value this transaction gave it: a later change (committed) wins.
    """

    __slots__ = ("_undo",)

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def assign(self, obj: Any, **values: Any) -> None:
        before = {name: getattr(obj, name) for name in values}
        for name, value in values.items():
            setattr(obj, name, value)

        def undo() -> None:
            for name, value in values.items():
                if getattr(obj, name) is value:
                    setattr(obj, name, before[name])
        self._undo.append(undo)

    def on_rollback(self, undo: Callable[[], Any]) -> None:
        self._undo.append(undo)

    def rollback(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def record_resolved(c: sqlite3.Connection, run_id: int, rule: str, now: float, *, actor: str, reason: str,
                    hooks: list[dict[str, Any]], external_url: str, out: Written) -> None:
    """Resolve ``rule``'s firing alerts of a run: a "resolved" audit event each, and a resolved
    message to every webhook that wants one (added to ``out``)."""
    for alert_id in sql.resolve_alerts(c, run_id, rule, now):
        alert = sql.get_alert(c, alert_id)
        out.events.append(sql.insert_event(c, run_id, now=now, kind="resolved", actor=actor, reason=reason,
                                           generation=None, data={"alert_id": alert_id, "rule": rule}))
        if alert["notify"]:
            for h in hooks:
                if h["send_resolved"] and SEVERITY_RANK[alert["severity"]] >= SEVERITY_RANK[h["min_severity"]]:
                    sql.insert_outbox(c, webhook_id=h["id"], alert_id=alert_id,
                                      body=render(h["format"], alert, external_url=external_url), now=now)
                    out.outbox += 1


def record_fired(c: sqlite3.Connection, run_id: int, run: str, fa: FiredAlert, now: float, *, step: int | None,
                 hooks: list[dict[str, Any]], external_url: str, out: Written,
                 nodes: dict[int, str] | None = None) -> dict[str, Any]:
    """Write one fired alert: the alert row, its audit event, the desired state its actions led
    to (and that event), and a message to every webhook whose severity it meets. ``nodes``: the
    run's rank -> node, named beside the ranks the finding names. Returns the alert as stored."""
    rule = fa.finding.rule
    gen = fa.desired.generation if fa.desired else None
    said, values = with_nodes(fa.finding.summary, fa.finding.values, nodes or {})
    summary = said
    if fa.desired is not None and " — " in fa.desired.reason:  # what a measured action did (e.g. a refused rollback)
        summary = f"{summary} — {fa.desired.reason.split(' — ', 1)[1]}"
    elif fa.note:  # why its actions changed nothing (e.g. the run did not opt in)
        summary = f"{summary} — {fa.note}"
    alert_id = sql.insert_alert(
        c, run_id, rule=rule.name, severity=rule.severity, summary=summary, values=values,
        diagnosis=DIAGNOSES[rule.diagnosis].as_dict(), actions=[a.model_dump(exclude_none=True) for a in rule.actions],
        generation=gen, notify=fa.notify, now=now, fingerprint=fingerprint(run, rule.name, now),
    )
    alert = sql.get_alert(c, alert_id)
    out.events.append(sql.insert_event(
        c, run_id, now=now, kind="alert", actor=f"rule:{rule.name}", reason=said, generation=gen,
        data={"alert_id": alert_id, "rule": rule.name, "severity": rule.severity, "values": values, "step": step}))
    if fa.desired is not None:
        sql.update_desired(c, run_id, fa.desired)
        out.events.append(sql.insert_event(
            c, run_id, now=now, kind="desired", actor=f"rule:{rule.name}", reason=fa.desired.reason,
            generation=fa.desired.generation, data={"desired": fa.desired.model_dump(), "alert_id": alert_id}))
    if fa.notify:
        for h in hooks:
            if SEVERITY_RANK[rule.severity] >= SEVERITY_RANK[h["min_severity"]]:
                sql.insert_outbox(c, webhook_id=h["id"], alert_id=alert_id,
                                  body=render(h["format"], alert, external_url=external_url), now=now)
                out.outbox += 1
    return alert


def record_incident(c: sqlite3.Connection, run_id: int, run: str, job: str, incident: dict[str, Any],
                    change: IncidentUpdate, now: float, *, hooks: list[dict[str, Any]], external_url: str,
                    out: Written) -> None:
    """Write one change of an incident (``incident`` as it is now, ``change`` from
    :func:`~service.webhooks.incident_update`): its ``incident`` audit event and a message to
    every webhook that wants it (:func:`~service.webhooks.incident_wanted`)."""
    reason = f"incident {incident['id']}: {change.update}" + (f" ({', '.join(change.rungs)})" if change.rungs else "")
    out.events.append(sql.insert_event(c, run_id, now=now, kind="incident", actor="recovery", reason=reason,
                                       generation=None, data={"incident": incident, "update": change.update}))
    for h in hooks:
        if incident_wanted(h, incident):
            sql.insert_outbox(c, webhook_id=h["id"], alert_id=None, now=now, body=render_incident(
                h["format"], incident, run=run, job=job, update=change.update, external_url=external_url))
            out.outbox += 1

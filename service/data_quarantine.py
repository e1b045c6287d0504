"""The samples a data skip left out, named on the data incident (``POST /v1/runs/{run}/quarantine``).

The leader's agent sends them when its loader quarantined a skipped batch (every rank's samples, by
shard: ``TokenLoader.located_last``). :meth:`RunRecovery.note_quarantine` adds them to the data
incident that skipped that step; the change is recorded as an incident change ``quarantined`` (an
``incident`` audit event, the event stream, the webhooks that want the incident), so an operator
can take those samples out of the data for good.
"""

from __future__ import annotations

import sqlite3
from typing import Any, Callable

from trainguard.service import statements as sql
from trainguard.service.runstate import RunState
from trainguard.service.transaction import Transaction, Written, record_incident
from trainguard.service.webhooks import IncidentUpdate
from trainguard.protocol.wire import QuarantineReport

__all__ = ["record_quarantine"]

#: The incident change a quarantine report makes (``IncidentUpdate.update``).
QUARANTINED = IncidentUpdate("quarantined", False, (), None)


async def record_quarantine(st: RunState, report: QuarantineReport, *, now: float, external_url: str,
                            commit: Callable[..., Any]) -> dict[str, Any]:
    """Name ``report``'s samples on run ``st``'s data incident and record the change; ``named``
    False (nothing written) when no data incident skipped that step or the samples were named."""
    rec = st.recovery
    saved = rec.save()
    samples: dict[str, list[int]] = {}
    for s in report.samples:
        samples.setdefault(s.shard, []).extend(s.indices)
    changed = rec.note_quarantine(report.step, samples)
    if changed is None:
        return {"run": st.run, "named": False}
    inc = changed[1]
    tx = Transaction()
    tx.on_rollback(lambda: rec.restore(saved))
    run_id, run, job = st.id, st.run, st.job

    def op(c: sqlite3.Connection) -> Written:
        out = Written()
        record_incident(c, run_id, run, job, inc, QUARANTINED, now, hooks=sql.active_webhooks(c),
                        external_url=external_url, out=out)
        return out

    await commit(tx, op)
    return {"run": run, "named": True, "incident": inc["id"]}

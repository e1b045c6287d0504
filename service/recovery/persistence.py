"""What a run's recovery state saves and takes back: everything a report may change, for its undo
(``Transaction.on_rollback``), the incidents a report opened or changed (the controller persists
them), and the incidents a restarted controller reads back. A mixin of
:class:`~service.incidents.RunRecovery`."""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any

from trainguard.service.adaptive_lr import LrRamp
from trainguard.service.recovery.baselines import HealthyBaselines
from trainguard.service.recovery.incident import Incident, incident_from_dict
from trainguard.service.recovery.reading import ReportReading, RungWindow
from trainguard.service.recovery.snapshots import Snapshots


class SavedRecovery:
    """The save and restore of :class:`~service.incidents.RunRecovery`'s state."""

    open: Incident | None
    incidents: deque[Incident]
    window: RungWindow
    reading: ReportReading
    snapshot_book: Snapshots
    baselines: HealthyBaselines
    ramp: LrRamp

    _SCALARS = ("_last_step", "_verdict", "_revised", "_opened_now")

    def save(self) -> dict[str, Any]:
        """Everything a report may change, for an undo (``Transaction.on_rollback``). Called on
        every report, so it copies only what can change: closed incidents never do, the open one
        and the snapshots' health counts may."""
        open_ = self.open
        return {
            "scalars": {k: getattr(self, k) for k in self._SCALARS},
            "window": replace(self.window),
            "reading": self.reading.save(),
            "snapshots": self.snapshot_book.save(),
            "incidents": list(self.incidents),
            "open": None if open_ is None else (open_, open_.as_dict()),
            "baselines": self.baselines.save(),
            "ramp": self.ramp.copy(),
        }

    def restore(self, saved: dict[str, Any]) -> None:
        for k, v in saved["scalars"].items():
            setattr(self, k, v)
        self.window = replace(saved["window"])
        self.reading.restore(saved["reading"])
        self.snapshot_book.restore(saved["snapshots"])
        self.incidents = deque(saved["incidents"], maxlen=self.incidents.maxlen)
        self.open = None
        if saved["open"] is not None:
            self.open, d = saved["open"]
            self.open.take_back(d)
        self.baselines.restore(saved["baselines"])
        self.ramp = saved["ramp"]

    def restore_incidents(self, incidents: list[dict[str, Any]]) -> None:
        """Take back the incidents a controller recorded before it restarted (oldest first, as
        :func:`~service.statements.recent_incidents` reads them). An incident that was still open
        stays open: its ladder resumes with a fresh window from its last rung."""
        self.incidents = deque((incident_from_dict(d) for d in incidents), maxlen=self.incidents.maxlen)
        self.open = None
        last = self.incidents[-1] if self.incidents else None
        if last is not None and last.outcome == "open":
            self.open = last
            self.window.restart(int(last.rungs[-1]["step"]) if last.rungs else last.onset_step)
            self.window.healthy_in_a_row = 0

    def changed_incidents(self, saved: dict[str, Any]) -> list[tuple[dict[str, Any] | None, dict[str, Any]]]:
        """The incidents opened or changed since :meth:`save` returned ``saved``: (the incident
        before, None for a new one; the incident now), as dicts."""
        known = {id(i) for i in saved["incidents"]}
        was_open, before = saved["open"] if saved["open"] is not None else (None, None)
        out: list[tuple[dict[str, Any] | None, dict[str, Any]]] = []
        for inc in self.incidents:
            if id(inc) not in known:
                out.append((None, inc.as_dict()))
            elif inc is was_open and (now := inc.as_dict()) != before:
                out.append((before, now))
        return out

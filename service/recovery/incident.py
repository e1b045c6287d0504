"""The incident record (one anomaly of a run, from its onset to its outcome), its dict form (the
API's, and the one the database persists: a restarted controller reads it back with
:func:`incident_from_dict`), the incident ids, and the desired-state change recovery asks for."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from trainguard.protocol.base import NON_FINITE_STRINGS
from trainguard.protocol.commands import REGISTRY
from trainguard.protocol.wire import DesiredState

_ids = itertools.count(1)
#: The most quarantined samples one incident names (the loader's own skip list keeps them all).
QUARANTINE_LIMIT = 65536


def continue_ids_after(last: int) -> None:
    """Number new incidents after ``last`` (the highest id a restarted controller read back)."""
    global _ids
    _ids = itertools.count(max(last + 1, next(_ids)))


def new_id() -> int:
    """The next incident's id."""
    return next(_ids)


@dataclass(slots=True)
class Incident:
    """One anomaly of a run, from its onset to its outcome."""

    id: int
    onset_step: int
    onset_time: float
    trigger: str
    rungs: list[dict[str, Any]] = field(default_factory=list)
    outcome: str = "open"
    """``open``, ``recovered`` or ``escalated`` (a human was paged, or the run stopped for a restart)."""
    closed_step: int | None = None
    closed_time: float | None = None
    cause: str = "unknown"
    """The verdict's cause (``service/cause.py``), decided before the incident's first action."""
    verdict: dict[str, Any] = field(default_factory=dict)
    """The verdict: ``summary``, ``evidence`` (what was read and what it points at), ``ranks`` and
    ``hosts`` (hardware), and ``revised`` (later evidence that changed the cause, with its step)."""
    experiment: dict[str, Any] | None = None
    """An incident of unknown cause: the troubleshooting experiment and its outcome."""
    data_skipped: list[int] | None = None
    """A data incident: [first, last] step whose optimizer steps the ranks skipped for its data."""
    replay: dict[str, Any] | None = None
    """An LR jump of the user's schedule, rolled back: the restored scheduler asks for it again.
    ``kind`` ``over`` (the jump began and ended inside one report interval): the rollback's scale
    ``lr_scale_after`` until ``guard_from`` (the last report at least one interval before the
    restored schedule reaches the jump's step again), then ``lr_scale``, 1/``ratio`` of it, until
    ``until_step`` (the restored run past the jump), then ``lr_scale_after`` again (``guarding``:
    the step the guard began, None before); ``lasting``: the restored schedule is healthy until the jump, so the
    rollback's factor of the ceiling until ``until_step`` (the last report before it), then the
    rollback's scale ``lr_scale_after``. ``released``: the step it changed."""
    quarantined: dict[str, list[int]] | None = None
    """A data incident: the samples of the skipped batches (every rank's), by shard: ``{shard base
    path: [index in the shard]}``, as the agent's loader reported them (``QuarantineReport``)."""

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "onset_step": self.onset_step, "onset_time": self.onset_time, "trigger": self.trigger,
                "rungs": list(self.rungs), "outcome": self.outcome, "closed_step": self.closed_step,
                "closed_time": self.closed_time, "cause": self.cause, "verdict": copy_record(self.verdict),
                "experiment": copy_record(self.experiment), "data_skipped": None if self.data_skipped is None else list(self.data_skipped),
                "quarantined": None if self.quarantined is None else {k: list(v) for k, v in self.quarantined.items()},
                "replay": copy_record(self.replay)}

    def take_back(self, d: dict[str, Any]) -> None:
        """Undo every change since :meth:`as_dict` returned ``d`` (``RunRecovery.restore``)."""
        self.rungs = list(d["rungs"])
        self.outcome, self.closed_step, self.closed_time = d["outcome"], d["closed_step"], d["closed_time"]
        self.cause, self.verdict, self.experiment = d["cause"], d["verdict"], d["experiment"]
        self.data_skipped, self.quarantined, self.replay = d["data_skipped"], d["quarantined"], d["replay"]

    def add_quarantined(self, samples: dict[str, list[int]]) -> bool:
        """Name the quarantined ``samples`` (``{shard: [index]}``), at most ``QUARANTINE_LIMIT``
        in all; whether any was new."""
        kept = {k: set(v) for k, v in (self.quarantined or {}).items()}
        room = QUARANTINE_LIMIT - sum(len(v) for v in kept.values())
        for shard, indices in samples.items():
            new = sorted(set(int(i) for i in indices) - kept.get(shard, set()))[:max(room, 0)]
            if new:
                kept.setdefault(shard, set()).update(new)
                room -= len(new)
        now = {k: sorted(v) for k, v in kept.items()}
        if now == (self.quarantined or {}):
            return False
        self.quarantined = now
        return True


def incident_from_dict(d: dict[str, Any]) -> Incident:
    """The incident :meth:`Incident.as_dict` wrote (as the database keeps it)."""
    return Incident(int(d["id"]), int(d["onset_step"]), float(d["onset_time"]), str(d["trigger"]),
                    rungs=[dict(r) for r in d.get("rungs", [])], outcome=str(d.get("outcome", "open")),
                    closed_step=d.get("closed_step"), closed_time=d.get("closed_time"),
                    cause=str(d.get("cause") or "unknown"), verdict=copy_record(d.get("verdict")) or {},
                    experiment=copy_record(d.get("experiment")), data_skipped=d.get("data_skipped"),
                    quarantined=copy_record(d.get("quarantined")), replay=copy_record(d.get("replay")))


def finite_or_text(x: float) -> float | str:
    """A report value for an incident dict (NaN/Inf as the wire spells them)."""
    return float(x) if math.isfinite(x) else ("NaN" if x != x else "Infinity" if x > 0 else "-Infinity")


def number(x: Any) -> float | None:
    """The value of a number :func:`finite_or_text` wrote (None: none)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return NON_FINITE_STRINGS.get(x) if isinstance(x, str) else None


def copy_record(d: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy deep enough that a later change of the incident does not change an earlier dict."""
    if d is None:
        return None
    return {k: ([dict(x) if isinstance(x, dict) else x for x in v] if isinstance(v, list) else
                dict(v) if isinstance(v, dict) else v) for k, v in d.items()}


@dataclass(frozen=True, slots=True)
class RecoveryChange:
    """A desired state the recovery logic asks for, and what to record with it."""

    desired: DesiredState
    actor: str
    """``recovery:ladder`` or ``recovery:ramp``."""


def then(changes: list[RecoveryChange], desired: DesiredState, change: RecoveryChange | None) -> DesiredState:
    """Append ``change`` (if any) to ``changes``; the desired state in force after it."""
    if change is None:
        return desired
    changes.append(change)
    return change.desired


def rungs_of(before: DesiredState, after: DesiredState) -> list[str]:
    """The ladder rungs a desired-state change amounts to."""
    out = []
    if after.lr_scale < before.lr_scale and after.rollback_seq == before.rollback_seq:
        out.append("adaptive_lr")
    if after.rollback_seq > before.rollback_seq:
        out.append("rollback")
    if after.paused and not before.paused:
        out.append("pause")
    out.extend(c.name for c in REGISTRY if c.remedy and c.changed(before, after))
    return out

"""Recovery without a human: the snapshots a run holds, the health of its reports, incidents and
their escalation ladder, and the LR ramp. Pure: :class:`RunRecovery` is fed each report after the
rules have decided, and answers the desired-state changes to make; the controller commits them.

**Healthy report.** No rule that acts (one with an action other than ``notify``) is active on it,
nor one of the policy's ``health_rules`` (by default ``loss_spike``: a loss far above its recent
level says the weights were hurt, although the rule itself only notifies), the loss is finite, and the
agent's spike guard has not skipped ``skip_limit`` steps in a row. While an incident is open, the
signals are *back* when the report is healthy and the ``metric`` (the update ratio) is not above
``degrade_ratio`` x its baseline. The baseline is the median of the metric over the last
``baseline_reports`` healthy reports taken outside incidents at ``lr_scale`` 1.0 (the run as its
user set it up): so it stays the pre-onset value while a reduced scale is in force.

**Snapshots.** Every report carries ``trainguard_snapshot_step``, the agent's newest in-memory
snapshot. The controller keeps the steps the agent keeps: ``snapshot_keep`` of them (the run's
registration config), spaced out by ``trainguard/protocol/retention.py`` as the agent spaces
them. A snapshot becomes *good* after ``snapshot_confirm_reports``
healthy reports following the one that first carried it; an unhealthy report before then taints
it for good (the anomaly may have begun before it was taken). A rollback goes to the newest good
snapshot: taken before the onset by construction. With none, it is refused with the reason.

**Incidents and the ladder** (``recovery`` section of the rules file). An incident opens when a
rule's actions change the desired state, or when a report shows the agent's spike guard skipping
steps in a row (the ladder's first rung, ``skip``, taken by the agent itself). While it is open,
each rung gets ``window_reports`` unhealthy reports and ``window_steps`` steps to work (whichever
is later: a run reporting every step still gets ``window_steps`` steps), counted from when the rung
stops working (a data skip while its data rules still fire, an experiment that has not ended:
the steps after them show whether it helped); then the next rung of the ladder is
taken: ``adaptive_lr`` (scale from the measurement), ``rollback`` (with ``rollback_lr_factor``),
``pause`` (and a human is paged: the incident ends *escalated*). ``recover_reports`` healthy
reports in a row end it *recovered*. Every rung is a desired-state change with its reason.

**Ramp.** Outside incidents, ``service/adaptive_lr.LrRamp`` brings a ``lr_scale`` that rules or
rungs reduced back up while the reports stay healthy: up to the scale an operator set last
(:attr:`RunRecovery.ceiling`, 1.0 until an operator sets one), never above it. An operator's
``lr_scale`` is theirs to change; recovery only undoes its own reductions.

The record is in memory (and in the audit events the controller writes for every rung and
outcome); a controller restart starts it afresh.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainguard.protocol.commands import BY_NAME, REGISTRY
from trainguard.protocol.retention import retained
from trainguard.protocol.wire import EXIT_HARDWARE_FAULT, LR_SCALE_MAX, LR_SCALE_MIN, DesiredState
from trainguard.service.adaptive_lr import LrRamp, ScheduleBaseline, baseline, corrected_scale
from trainguard.service.cause import (
    DATA_DIAGNOSES, HARDWARE_DIAGNOSES as _HARDWARE, LR_RATIO, SCHEDULE_PEAK_MARGIN, Verdict, judge, refusal,
)
from trainguard.service.engine import apply_actions
from trainguard.service.rules import (
    AdaptiveLrAction, CheckpointAction, LrScaleAction, PauseAction, RecoveryPolicy, RollbackAction, StopAction,
)

__all__ = ["Incident", "RunRecovery", "RecoveryChange", "continue_ids_after", "rungs_of", "snapshot_policy"]

_ids = itertools.count(1)
#: The most quarantined samples one incident names (the loader's own skip list keeps them all).
QUARANTINE_LIMIT = 65536
#: Evidence signals of an LR beyond the schedule's range (``service/cause.py``).
_LR_SIGNALS = frozenset({"trainguard_scheduler_lr", "trainguard_scheduler_lr_ratio"})
#: The LR factor of the troubleshooting experiment (the guide: lower the LR 10x and watch).
_EXPERIMENT_LR_FACTOR = 0.1
#: The reason a hardware incident's ``stop`` rung gives; the stop carries
#: ``EXIT_HARDWARE_FAULT`` (``Agent.exit_code``: a launcher restarts the job without the named node).
HARDWARE_STOP_REASON = "stopped for a restart without the suspect node"


def continue_ids_after(last: int) -> None:
    """Number new incidents after ``last`` (the highest id a restarted controller read back)."""
    global _ids
    _ids = itertools.count(max(last + 1, next(_ids)))


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
                "closed_time": self.closed_time, "cause": self.cause, "verdict": _copy(self.verdict),
                "experiment": _copy(self.experiment), "data_skipped": None if self.data_skipped is None else list(self.data_skipped),
                "quarantined": None if self.quarantined is None else {k: list(v) for k, v in self.quarantined.items()},
                "replay": _copy(self.replay)}


def _finite_or_text(x: float) -> float | str:
    """A report value for an incident dict (NaN/Inf as the wire spells them)."""
    return float(x) if math.isfinite(x) else ("NaN" if x != x else "Infinity" if x > 0 else "-Infinity")


def _number(x: Any) -> float | None:
    """The value of a number :func:`_finite_or_text` wrote (None: none)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(x) if isinstance(x, str) else None


def _largest_measured(rows: np.ndarray) -> float | None:
    """The largest value of the newest row that is not NaN (NaN: not measured), None when none is."""
    if len(rows) == 0:
        return None
    row = rows[-1]
    measured = row[~np.isnan(row)]
    return float(measured.max()) if measured.size else None


def _copy(d: dict[str, Any] | None) -> dict[str, Any] | None:
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


def snapshot_policy(config: dict[str, Any]) -> tuple[int | None, int]:
    """(every, keep) of a run's snapshots, from its registration config (the agent sends its
    own; ``every`` None when it is not known)."""
    every, keep = config.get("snapshot_every"), config.get("snapshot_keep")
    return (every if type(every) is int and 1 <= every <= 1 << 40 else None,
            keep if type(keep) is int and 1 <= keep <= 1024 else 3)


#: The metrics whose healthy median a command's fold reads (``CommandSpec.measures``).
_MEASURED = tuple(dict.fromkeys((*(m for c in REGISTRY for m in c.measures), "trainguard_loss")))


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


#: Rule actions that are not a response to trouble: ``notify``, and ``accumulation`` (the adaptive
#: batch size follows the gradient variance of a healthy run). A rule that takes only these does not
#: make a report unhealthy (no snapshot is tainted, no incident opens on it).
_NOT_TROUBLE = frozenset({"notify", "accumulation"})


def _acts_on_trouble(rule: Any) -> bool:
    """Whether ``rule`` takes an action that responds to trouble."""
    return any(a.type not in _NOT_TROUBLE for a in rule.actions)


@dataclass(slots=True)
class _Snap:
    step: int
    healthy_after: int = 0
    tainted: bool = False

    def good(self, confirm: int) -> bool:
        return not self.tainted and self.healthy_after >= confirm


class RunRecovery:
    """The recovery state of one run (see the module docstring)."""

    def __init__(self, policy: RecoveryPolicy | None = None, *, snapshot_every: int | None = None,
                 snapshot_keep: int = 3, ceiling: float = 1.0, skips_nonfinite: bool = False) -> None:
        self.policy = policy or RecoveryPolicy()
        self.snapshot_every = snapshot_every
        self.snapshot_keep = max(int(snapshot_keep), 1)
        self.ceiling = ceiling
        self.skips_nonfinite = skips_nonfinite
        """The agent skips steps with non-finite gradients (its registration config says so)."""
        self._own_accumulation: int | None = None
        """The run's own accumulation steps when it lets the controller change them (its registration config)."""
        """The ``lr_scale`` an operator set last: the ramp climbs back to it, never above."""
        self._rung_step = 0
        self._skipped_total = 0.0
        self._skipped_now = 0
        self.snapshots: deque[_Snap] = deque()
        self.incidents: deque[Incident] = deque(maxlen=100)
        self.open: Incident | None = None
        self._healthy_metric: deque[float] = deque(maxlen=self.policy.baseline_reports)
        #: The same for each metric a command's fold measures (``healthy_median``).
        self._healthy_measures: dict[str, deque[float]] = {m: deque(maxlen=self.policy.baseline_reports) for m in _MEASURED}
        self._reports_since_rung = 0
        self._healthy_in_a_row = 0
        self._incident_losses: tuple[float, ...] = ()
        """The open incident's losses of its last ``recover_reports`` reports with the signals back (``_loss_hurt``)."""
        self._last_step: int | None = None
        self._measured: float | None = None
        self._measured_scale: float | None = None
        self._lr: float | None = None
        self._healthy_lr: deque[float] = deque(maxlen=self.policy.baseline_reports)
        #: The update per unit of LR and the schedule's envelope, healthy (``service/adaptive_lr.py``).
        self.schedule = ScheduleBaseline(reports=self.policy.baseline_reports, tolerance=self.policy.degrade_ratio)
        self._values: dict[str, float] = {}
        self._lr_peak: float | None = None
        """The highest scheduled LR of a healthy report (the schedule's range so far)."""
        self._lr_fault_peak: float | None = None
        """After a verdict of an LR beyond the schedule's range: that range (the schedule's highest
        LR before the fault), raised by the healthy reports since (None: no LR fault seen)."""
        self._verdict: Verdict | None = None
        """The cause of what the newest report shows (:meth:`consider`), while no incident is open."""
        self._data_active = False
        self._float32_now: float | None = None  # the newest report's float32 recompute (largest over the ranks)
        """A data-quality rule fires on the newest report."""
        self._data_checks: list[tuple[str, str | None, str, Any, bool]] = []
        """Each data-quality rule on the newest report: (name, metric, op, threshold, firing)."""
        self._revised = False
        """The newest report revised the open incident's cause to hardware."""
        self._opened_now = False
        self._scale_before_experiment = 1.0
        self.ramp = self._new_ramp()

    @classmethod
    def for_config(cls, config: dict[str, Any], *, ceiling: float = 1.0) -> "RunRecovery":
        """The recovery state of a run registered with ``config``. ``ceiling``: the ``lr_scale``
        in force when the state is (re)built, e.g. after a controller restart (who set it is not
        known then, so recovery never raises the scale above it)."""
        rec = cls(ceiling=ceiling)
        rec.configure(config)
        return rec

    def configure(self, config: dict[str, Any]) -> None:
        """Take the snapshot policy and the skipping of a run's registration ``config`` (the
        agent sends its own; a re-registration may change them)."""
        self.snapshot_every, self.snapshot_keep = snapshot_policy(config)
        self.skips_nonfinite = config.get("skip_nonfinite") is True or config.get("skip_spikes") is True
        steps = config.get("accumulation_steps")
        self._own_accumulation = steps if type(steps) is int and steps >= 1 else None

    def _new_ramp(self) -> LrRamp:
        p = self.policy
        return LrRamp(ramp_steps=p.ramp_steps, stable_reports=p.stable_reports, degrade_ratio=p.degrade_ratio)

    def set_policy(self, policy: RecoveryPolicy) -> None:
        if policy != self.policy:
            self.policy = policy
            self._healthy_metric = deque(self._healthy_metric, maxlen=policy.baseline_reports)
            self._healthy_measures = {m: deque(v, maxlen=policy.baseline_reports) for m, v in self._healthy_measures.items()}
            kept = self.schedule
            self.schedule = ScheduleBaseline(reports=policy.baseline_reports, tolerance=policy.degrade_ratio)
            self.schedule.per_lr.extend(kept.per_lr)
            self.schedule.update.extend(kept.update)
            self.schedule.envelope = kept.envelope
            self._healthy_lr = deque(self._healthy_lr, maxlen=policy.baseline_reports)
            self.ramp = self._new_ramp()

    _SCALARS = ("_reports_since_rung", "_rung_step", "_skipped_total", "_skipped_now", "_healthy_in_a_row",
                "_last_step", "_measured", "_measured_scale", "_lr", "_verdict", "_data_active", "_lr_peak", "_revised",
                "_opened_now", "_lr_fault_peak", "_data_checks", "_incident_losses")

    def save(self) -> dict[str, Any]:
        """Everything a report may change, for an undo (``Transaction.on_rollback``). Called on
        every report, so it copies only what can change: closed incidents never do, the open one
        and the snapshots' health counts may."""
        open_ = self.open
        return {
            "scalars": {k: getattr(self, k) for k in self._SCALARS},
            "snapshots": [(snap, snap.healthy_after, snap.tainted) for snap in self.snapshots],
            "incidents": list(self.incidents),
            "open": None if open_ is None else (open_, open_.as_dict()),
            "healthy_metric": list(self._healthy_metric),
            "healthy_measures": {m: list(v) for m, v in self._healthy_measures.items()},
            "healthy_lr": list(self._healthy_lr),
            "ramp": self.ramp.copy(),
            "schedule": self.schedule.copy(),
        }

    def restore(self, saved: dict[str, Any]) -> None:
        for k, v in saved["scalars"].items():
            setattr(self, k, v)
        for snap, healthy_after, tainted in saved["snapshots"]:
            snap.healthy_after, snap.tainted = healthy_after, tainted
        self.snapshots = deque(snap for snap, _, _ in saved["snapshots"])
        self.incidents = deque(saved["incidents"], maxlen=self.incidents.maxlen)
        self.open = None
        if saved["open"] is not None:
            self.open, d = saved["open"]
            self.open.rungs = list(d["rungs"])
            self.open.outcome, self.open.closed_step, self.open.closed_time = d["outcome"], d["closed_step"], d["closed_time"]
            self.open.cause, self.open.verdict, self.open.experiment = d["cause"], d["verdict"], d["experiment"]
            self.open.data_skipped, self.open.quarantined, self.open.replay = d["data_skipped"], d["quarantined"], d["replay"]
        self._healthy_metric = deque(saved["healthy_metric"], maxlen=self._healthy_metric.maxlen)
        self._healthy_measures = {m: deque(v, maxlen=self.policy.baseline_reports) for m, v in saved["healthy_measures"].items()}
        self._healthy_lr = deque(saved["healthy_lr"], maxlen=self._healthy_lr.maxlen)
        self.ramp = saved["ramp"]
        self.schedule = saved["schedule"]

    def restore_incidents(self, incidents: list[dict[str, Any]]) -> None:
        """Take back the incidents a controller recorded before it restarted (oldest first, as
        :func:`~service.statements.recent_incidents` reads them). An incident that was still open
        stays open: its ladder resumes with a fresh window from its last rung."""
        self.incidents = deque(maxlen=self.incidents.maxlen)
        self.open = None
        for d in incidents:
            inc = Incident(int(d["id"]), int(d["onset_step"]), float(d["onset_time"]), str(d["trigger"]),
                           rungs=[dict(r) for r in d.get("rungs", [])], outcome=str(d.get("outcome", "open")),
                           closed_step=d.get("closed_step"), closed_time=d.get("closed_time"),
                           cause=str(d.get("cause") or "unknown"), verdict=_copy(d.get("verdict")) or {},
                           experiment=_copy(d.get("experiment")), data_skipped=d.get("data_skipped"),
                           quarantined=_copy(d.get("quarantined")), replay=_copy(d.get("replay")))
            self.incidents.append(inc)
        last = self.incidents[-1] if self.incidents else None
        if last is not None and last.outcome == "open":
            self.open = last
            self._rung_step = int(last.rungs[-1]["step"]) if last.rungs else last.onset_step
            self._reports_since_rung = 0
            self._healthy_in_a_row = 0

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

    def note_quarantine(self, step: int, samples: dict[str, list[int]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The agent's loader left ``samples`` (``{shard: [index]}``) of the batch of ``step`` out:
        the data incident that skipped that step names them (the open one, else the newest whose
        skipped steps hold ``step``). Returns (the incident before, after) as dicts, or None when
        no data incident skipped that step or nothing new was named. At most
        ``QUARANTINE_LIMIT`` samples are kept per incident."""
        inc = self.open if self.open is not None and self.open.cause == "data" else next(
            (i for i in reversed(self.incidents) if i.cause == "data" and i.data_skipped is not None
             and i.data_skipped[0] <= step <= i.data_skipped[1]), None)
        if inc is None:
            return None
        before = inc.as_dict()
        kept = {k: set(v) for k, v in (inc.quarantined or {}).items()}
        room = QUARANTINE_LIMIT - sum(len(v) for v in kept.values())
        for shard, indices in samples.items():
            new = sorted(set(int(i) for i in indices) - kept.get(shard, set()))[:max(room, 0)]
            if new:
                kept.setdefault(shard, set()).update(new)
                room -= len(new)
        now = {k: sorted(v) for k, v in kept.items()}
        if now == (inc.quarantined or {}):
            return None
        inc.quarantined = now
        return before, inc.as_dict()

    # ------------------------------------------------------------------ ActionContext

    def baseline(self) -> float | None:
        return baseline(self._healthy_metric)

    def healthy_median(self, metric: str) -> float | None:
        """The median of ``metric`` over the last ``baseline_reports`` healthy reports taken outside
        incidents at the run's own ``lr_scale`` (so before the open incident's onset), as the
        adaptive LR's baseline is; None without one, or for a metric no command measures."""
        if metric == self.policy.metric:
            return self.baseline()
        kept = self._healthy_measures.get(metric)
        return None if kept is None else baseline(kept)

    def adaptive_scale(self, action: AdaptiveLrAction, current: float) -> tuple[float | None, str]:
        if action.metric == self.policy.metric:
            # In the schedule's terms when the agent reports them: the healthy update per unit of
            # LR, with the schedule's LR within its envelope (a constant: the schedule keeps its shape).
            needed, note = self.schedule.needed(self._values)
            if needed is not None:
                return min(max(needed * self.ceiling, action.min), action.max, current), note
        base, measured = self.baseline(), self._measured
        # The measurement was made at the scale the agent reported (several actions on one report
        # must not compound: each computes from that scale, and none raises the current one).
        at = self._measured_scale if self._measured_scale is not None else current
        new = corrected_scale(at, measured, base, lo=action.min, hi=action.max)
        if new is not None:
            return min(new, current), f"update ratio {measured:.3g} at lr_scale {at:.4g} vs healthy baseline {base:.3g}"
        # No usable update ratio (e.g. the step of the report was skipped): the LR the user's own
        # schedule set, against its healthy level, says how far the LR itself jumped.
        lr_base = baseline(self._healthy_lr)
        lr_new = corrected_scale(1.0, self._lr, lr_base, lo=action.min, hi=action.max)
        if lr_new is not None and lr_new < 1.0:
            return min(lr_new, current), f"the schedule's LR {self._lr:.3g} vs its healthy level {lr_base:.3g}"
        return None, "no healthy baseline of the update ratio yet" if base is None else "no finite update ratio"

    def own_accumulation(self) -> int | None:
        return self._own_accumulation

    def rollback_target(self) -> tuple[int | None, str]:
        confirm = self.policy.snapshot_confirm_reports
        for snap in reversed(self.snapshots):
            if snap.good(confirm):
                return snap.step, f"snapshot of step {snap.step}"
        if not self.snapshots:
            return None, "the run reports no snapshot (AgentConfig.snapshot_every is not set, or none taken yet)"
        return None, (f"no snapshot was followed by {confirm} healthy reports: the anomaly may predate every "
                      f"snapshot held (steps {', '.join(str(s.step) for s in self.snapshots)})")

    # ------------------------------------------------------------------ the cause

    def cause(self) -> str | None:
        """The cause the actions on the newest report must fit: the open incident's, else the
        verdict on the newest report (None: nothing alarming)."""
        if self.open is not None:
            return self.open.cause
        return self._verdict.cause if self._verdict is not None else None

    def refusal(self, action: Any) -> str | None:
        """Why a rule's ``action`` is not taken (it does not fit the cause, or it changes the batch
        size while an incident is open), or None."""
        if action.type == "accumulation" and self.open is not None:
            return f"accumulation refused: incident {self.open.id} is open"
        return refusal(self.cause(), action)

    def _alarming(self, findings: list[Any]) -> bool:
        """Whether the newest report would open an incident (or shows a hardware fault)."""
        if self._skipped_now:
            return True
        signals = self.policy.health_rules
        for f in findings:
            if f.active and f.rule.kind != "absence" and (
                    f.rule.name in signals or _acts_on_trouble(f.rule)
                    or f.rule.diagnosis in _HARDWARE):
                return True
        return False

    def consider(self, findings: list[Any], window: Any, *, ranks: list[dict[str, Any]] | tuple[()] = ()) -> None:
        """Decide the cause of what the newest report shows, after the rules evaluated it and
        before their actions are taken (:meth:`refusal`). While an incident is open its cause
        stands, except that hardware evidence revises it."""
        self._float32_now = _largest_measured(window.rank_history("verify_float32", 1))
        self._data_active = any(f.active and f.rule.diagnosis in DATA_DIAGNOSES for f in findings)
        self._data_checks = [(f.rule.name, getattr(f.rule, "metric", None), getattr(f.rule, "op", ""),
                              getattr(f.rule, "value", None), bool(f.active))
                             for f in findings if f.rule.diagnosis in DATA_DIAGNOSES]
        self._verdict = None
        if not self.policy.enabled:
            return
        if self.open is not None and (self.open.cause == "hardware"
                                      or not any(f.active and f.rule.diagnosis in _HARDWARE for f in findings)):
            return
        if self.open is None and not self._alarming(findings):
            return
        peak = window.latest("trainguard_scheduler_lr_peak")  # the agent's own record of the schedule's range
        if peak is None or not math.isfinite(peak) or peak <= 0:
            peak = self._lr_peak
        elif self._lr_fault_peak is not None:
            # The agent's record holds every LR the run took, the faulty ones too: after an LR fault
            # (replayed by a rollback that restores the user's scheduler) the range is the healthy one.
            peak = min(peak, self._lr_fault_peak)
        verdict = judge(findings, window, skipped=self._skipped_now, lr_healthy=list(self._healthy_lr), lr_peak=peak,
                        metric=self.policy.metric, metric_baseline=self.baseline(),
                        hosts={int(r["rank"]): str(r["host"]) for r in ranks})
        if self.open is None:
            self._verdict = verdict
            if verdict.cause == "optimizer" and peak is not None and any(
                    e["points_to"] == "optimizer" and e["signal"] in _LR_SIGNALS for e in verdict.evidence):
                self._lr_fault_peak = peak if self._lr_fault_peak is None else min(self._lr_fault_peak, peak)
        elif verdict.cause == "hardware":
            inc = self.open
            inc.verdict = dict(inc.verdict, revised={"from": inc.cause, "step": window.last_step,
                                                     "summary": verdict.summary}, ranks=list(verdict.ranks),
                               hosts=list(verdict.hosts), evidence=list(inc.verdict.get("evidence", [])) + list(
                                   e for e in verdict.as_dict()["evidence"] if e["points_to"] == "hardware"))
            inc.cause = "hardware"
            self._revised = True

    def ladder(self) -> tuple[str, ...]:
        """The rungs of the open incident's cause (the optimizer's: ``ladder``)."""
        cause = self.open.cause if self.open is not None else "optimizer"
        return tuple(getattr(self.policy.ladders, cause)) if cause in ("data", "hardware", "unknown") else self.policy.optimizer_ladder

    # ------------------------------------------------------------------ feeding

    def skipped_now(self) -> int:
        return self._skipped_now

    def before_decide(self, values: dict[str, float]) -> None:
        """The report's measurement, for the actions the rules take on it."""
        # Steps the agent did not take since the last report: non-finite ones (when the run skips
        # them: its registration says so) and the spike guard's run of skips at the report step.
        nonfinite = values.get("trainguard_nonfinite_steps_total")
        rose = 0
        if nonfinite is not None and math.isfinite(nonfinite):
            rose = max(int(nonfinite - self._skipped_total), 0) if self.skips_nonfinite else 0
            self._skipped_total = nonfinite
        spikes = values.get("trainguard_consecutive_skipped_steps", 0.0)
        self._skipped_now = max(rose, int(spikes) if math.isfinite(spikes) else 0)
        v = values.get(self.policy.metric)
        self._measured = None if v is None else float(v)
        self._values = values
        lr = values.get("trainguard_scheduler_lr")
        self._lr = float(lr) if lr is not None and math.isfinite(lr) and lr > 0 else None
        at = values.get("trainguard_lr_scale")
        self._measured_scale = float(at) if at is not None and math.isfinite(at) and at > 0 else None

    def healthy(self, values: dict[str, float], findings: list[Any]) -> bool:
        """See the module docstring."""
        signals = self.policy.health_rules
        for f in findings:  # the rules that act, and the health rules: a notify-only rule (e.g. data quality) informs
            if f.active and f.rule.kind != "absence" and (
                    f.rule.name in signals or _acts_on_trouble(f.rule)):
                return False
        loss = values.get("trainguard_loss")
        if loss is not None and not math.isfinite(loss):
            return False
        if values.get("trainguard_consecutive_skipped_steps", 0.0) >= self.policy.skip_limit:
            return False
        if self._data_active and self.open is not None and self.open.cause == "data":
            return False  # a data incident is over when its data is back in bounds
        return True

    def _loss_hurt(self, values: dict[str, float]) -> bool:
        """An optimizer incident's signals are back but not its loss: the median loss of its last
        ``recover_reports`` reports with the signals back is above ``loss_recovered_ratio`` x the loss's healthy median
        before the onset. Only while the ladder's rollback is still ahead and a good snapshot
        exists: the steps taken at the faulty LR moved the weights (one step at x100 left a small
        GPT 1.2x above its healthy loss 190 steps later, at the right LR), and the rollback restores
        them. Without a snapshot the run trains back on its own: no rung for the loss alone."""
        inc, p = self.open, self.policy
        loss = values.get("trainguard_loss")
        if inc is None or loss is None or not math.isfinite(loss):
            return False
        self._incident_losses = (*self._incident_losses, float(loss))[-p.recover_reports:]
        if (inc.cause != "optimizer" or len(self._incident_losses) < p.recover_reports or not math.isfinite(p.loss_recovered_ratio)
                or "rollback" not in self.ladder() or any(r["rung"] == "rollback" for r in inc.rungs)
                or not any(s.good(p.snapshot_confirm_reports) for s in self.snapshots)):
            return False
        base = self.healthy_median("trainguard_loss")
        recent = baseline(self._incident_losses)
        return base is not None and recent is not None and recent > p.loss_recovered_ratio * base

    def degraded(self) -> bool:
        """The metric of the last report is non-finite or above degrade_ratio x its baseline (the
        update per unit of LR, when the agent reports it: the schedule does not move that one;
        then the update itself must also be above degrade_ratio x its own healthy median,
        ``ScheduleBaseline.small_update``), or the update per unit of LR below 1 / (2 x
        degrade_ratio) of its baseline (the optimizer's state still holds the fault: the run
        trains at a fraction of its LR)."""
        base, measured = self._ramp_measure()
        if base is None or measured is None:
            return False
        if not math.isfinite(measured):
            return True
        if ScheduleBaseline.PER_LR not in self._values:  # the policy's metric: above its baseline
            return measured > self.policy.degrade_ratio * base
        if measured < base / (2 * self.policy.degrade_ratio):
            # Far below per unit of LR: the fault's gradients inflated Adam's second moment, which
            # remembers them for ~1/(1 - beta2) steps, so the run trains at a fraction of its LR
            # (0.2x for 200 steps after 5 steps at x200) while its loss stays above where it was.
            # Not recovered: the ladder goes on (a rollback restores the optimizer state too).
            return True
        # High per unit of LR, but is the update itself large? While the LR in force is far below
        # the one the baseline was measured at (a rollback's guard, adaptive LR), Adam's normalised
        # step m/sqrt(v) grows towards 1 as the weights stop moving (successive gradients agree):
        # 2.5-5x its healthy value at lr_scale 5e-4, with an update 100x smaller than healthy.
        # That is the cut LR, not a hurt run; judged by it, such a run is paused after its guard.
        return measured > self.policy.degrade_ratio * base and not self.schedule.small_update(self._values)

    def after_report(self, *, step: int, values: dict[str, float], findings: list[Any], before: DesiredState,
                     desired: DesiredState, fired: list[tuple[str, DesiredState]], now: float) -> list[RecoveryChange]:
        """Feed one report after the rules decided. ``before``/``desired``: the desired state
        before and after the rules' actions; ``fired``: (rule, desired state) of each alert whose
        actions changed it. Returns the further changes to commit (newest last)."""
        p = self.policy
        self._opened_now = False
        healthy = self.healthy(values, findings)
        self._track_snapshots(values, healthy)
        measured = self._measured
        changes: list[RecoveryChange] = []
        prev_desired = before
        for rule, new in fired:
            rungs = rungs_of(prev_desired, new)
            if rungs and self.open is None:
                self._open(step, now, f"rule:{rule}")
            if self.open is not None:
                for rung in rungs:
                    self._rung(rung, step, now, f"rule:{rule}", new)
            if new.rollback_seq > prev_desired.rollback_seq:
                self._drop_snapshots_after(new.rollback_step)
            prev_desired = new
        verdict = self._verdict
        ladder = self.ladder() if self.open is not None else (
            tuple(getattr(p.ladders, verdict.cause)) if verdict is not None and verdict.cause in ("data", "hardware", "unknown")
            else p.optimizer_ladder)
        if p.enabled and not healthy and self._skipped_now and "skip" in ladder and not desired.paused:
            # (a paused run is a human's: no incident opens on the reports it sends while paused)
            why = f"the agent skipped {self._skipped_now} step(s) it did not trust"
            if self.open is None:
                self._open(step, now, "skip")
                self._rung("skip", step, now, "agent", None, why)
            elif not self.open.rungs or self.open.rungs[-1]["rung"] != "skip":  # noted; the controller's rung keeps its window
                self._rung("skip", step, now, "agent", None, why, restart_window=False)
        opened = False
        if (p.enabled and self.open is None and verdict is not None and verdict.cause in ("data", "hardware")
                and not desired.paused and (not healthy or verdict.cause == "hardware")):
            # The cause refused the rules' own actions (an LR cut for data): its rungs act instead.
            self._open(step, now, f"cause:{verdict.cause}")
            opened = True
        elif self._opened_now:
            opened = True  # opened by this report's rules or skips
        if self.open is not None and p.enabled and (opened or self._revised):
            for change in self._first_rungs(step, now, desired):
                changes.append(change)
                desired = change.desired
        self._revised = False
        if self.open is not None and self.open.cause == "data" and self._data_active and p.enabled:
            change = self._extend_data_skip(step, desired)
            if change is not None:
                changes.append(change)
                desired = change.desired
        replay = self.open.replay if self.open is not None else None
        if (replay is not None and replay.get("released") is None and p.enabled and replay["kind"] == "over"
                and replay.get("guarding", step) is None and step >= replay["guard_from"]):
            change = self._guard_replayed_jump(step, desired)
            changes.append(change)
            desired = change.desired
        if replay is not None and replay.get("released") is None and p.enabled and (
                step > replay["until_step"] or (replay["kind"] == "lasting" and step >= replay["until_step"])):
            change = self._release_replay(step, values, desired)
            if change is not None:
                changes.append(change)
                desired = change.desired
        experiment = self.open.experiment if self.open is not None else None
        if experiment is not None and experiment.get("outcome") is None and p.enabled:
            if self._float32_now is not None and step > experiment["from_step"]:
                seen = _number(experiment.get("float32_rel_diff"))
                worst = self._float32_now if seen is None else max(seen, self._float32_now)
                experiment = dict(experiment, float32_rel_diff=_finite_or_text(worst))
                self.open.experiment = experiment  # type: ignore[union-attr]
            if step >= experiment["until_step"]:
                change = self._conclude_experiment(step, healthy and not self.degraded(), desired)
                if change is not None:
                    changes.append(change)
                    desired = change.desired
        if self.open is not None:
            if fired or changes:
                self._healthy_in_a_row = 0
            elif self._working(experiment):
                # The rung in force is still working (data skipped, the experiment running): its
                # window opens when that ends, so the run gets window_reports/window_steps on good
                # data to show its signals back. Counted from the rung's decision instead, a long
                # burst used the window up and the first unhealthy reports after it escalated.
                self._reports_since_rung = 0
                self._rung_step = step
            elif healthy and not self.degraded() and not self._loss_hurt(values):
                self._healthy_in_a_row += 1
                if self._healthy_in_a_row >= p.recover_reports:
                    self._close("recovered", step, now)
            else:
                self._healthy_in_a_row = 0
                self._reports_since_rung += 1
                if (p.enabled and self._reports_since_rung >= p.window_reports
                        and step - self._rung_step >= p.window_steps):
                    change = self._escalate(step, now, desired)
                    if change is not None:
                        changes.append(change)
                        desired = change.desired
            self.ramp.reset()
        elif p.enabled and not fired:
            needed, note = self.schedule.needed(values)
            base, now_measured = self._ramp_measure()
            ramp = self.ramp.observe(step, healthy=healthy, measured=now_measured, base=base,
                                     scale=desired.lr_scale, ceiling=self.ceiling,
                                     needed=None if needed is None else needed * self.ceiling, needed_note=note)
            if ramp is not None:
                new = desired.model_copy(update={"generation": desired.generation + 1, "reason": ramp.reason,
                                                 "lr_scale": min(max(ramp.scale, LR_SCALE_MIN), LR_SCALE_MAX)})
                changes.append(RecoveryChange(new, "recovery:ramp"))
        elif fired:
            self.ramp.reset()
        if healthy and self.open is None and desired.lr_scale == self.ceiling and not changes:
            if measured is not None and math.isfinite(measured) and measured > 0:
                self._healthy_metric.append(measured)
            for name, kept in self._healthy_measures.items():
                v = values.get(name)
                if v is not None and math.isfinite(v) and v > 0:
                    kept.append(float(v))
            self.schedule.add_healthy(values)
            if self._lr is not None:
                self._healthy_lr.append(self._lr)
                self._lr_peak = self._lr if self._lr_peak is None else max(self._lr_peak, self._lr)
            top = values.get("trainguard_scheduler_lr_max", self._lr)
            if self._lr_fault_peak is not None and top is not None and math.isfinite(top):
                self._lr_fault_peak = max(self._lr_fault_peak, float(top))
        self._last_step = step
        return changes

    # ------------------------------------------------------------------ rungs per cause

    def _working(self, experiment: dict[str, Any] | None) -> bool:
        """A rung in force that must not be judged yet: a data skip while the data is still out
        of bounds, an experiment that has not ended."""
        if experiment is not None and experiment.get("outcome") is None:
            return True
        if self.open is not None and self.open.replay is not None and self.open.replay.get("released") is None:
            return True  # the restored schedule has not passed the LR jump again
        return self.open is not None and self.open.cause == "data" and self._data_active

    def _first_rungs(self, step: int, now: float, desired: DesiredState) -> list[RecoveryChange]:
        """The rungs the cause takes at once when the incident opens (or its cause is revised):
        a data incident whose data rules fire skips its batches; a hardware incident takes its
        whole ladder (checkpoint, then pause or stop)."""
        assert self.open is not None
        inc, out = self.open, []
        if inc.cause == "data" and self._data_active and "data_skip" in self.ladder() and \
                not any(r["rung"] == "data_skip" for r in inc.rungs):
            new = self._rung_state("data_skip", desired, step, why=self._why_cause())
            if new is not None:
                self._rung("data_skip", step, now, "recovery:cause", new)
                out.append(RecoveryChange(new, "recovery:ladder"))
        elif inc.cause == "hardware":
            for rung in self.ladder():
                if self.open is None or any(r["rung"] == rung for r in inc.rungs):
                    continue
                new = self._rung_state(rung, desired, step, why=self._why_cause())
                if new is None:
                    continue
                self._rung(rung, step, now, "recovery:cause", new)
                if rung == "stop":
                    self._close("escalated", step, now)
                out.append(RecoveryChange(new, "recovery:ladder"))
                desired = new
        return out

    def _why_cause(self) -> str:
        assert self.open is not None
        return (f"incident {self.open.id} (onset step {self.open.onset_step}), cause {self.open.cause}: "
                f"{self.open.verdict.get('summary', '')}")

    def _extend_data_skip(self, step: int, desired: DesiredState) -> RecoveryChange | None:
        """Skip further ahead while the data rules still fire, within ``data_skip_max_steps``."""
        inc, p = self.open, self.policy
        assert inc is not None
        if inc.data_skipped is None or desired.data_skip_until - step > p.data_skip_steps // 2:
            return None
        first = inc.data_skipped[0]
        until = min(step + p.data_skip_steps, first + p.data_skip_max_steps - 1)
        if until <= desired.data_skip_until:
            return None  # the budget is spent: the change lasts, it is the data's new normal
        inc.data_skipped = [first, until]
        reason = f"{self._why_cause()}: the data rules still fire, skipping the batches up to step {until}"
        return RecoveryChange(desired.model_copy(update={"generation": desired.generation + 1, "data_skip_until": until,
                                                         "reason": reason[:2000]}), "recovery:ladder")

    def _conclude_experiment(self, step: int, back: bool, desired: DesiredState) -> RecoveryChange | None:
        """The troubleshooting experiment ended: did the symptom follow the LR?"""
        inc = self.open
        assert inc is not None and inc.experiment is not None
        exp = dict(inc.experiment)
        exp["data_rules_firing"] = self._data_active
        exp["sampling"] = self._sampling_check()
        amp = self._amp_check(exp.get("amp_skipped_at_start"))
        if amp is not None:
            exp["amp"] = amp
        exp["float32_recompute"] = float32 = self._float32_check(exp.pop("float32_rel_diff", None))
        numerics = float32["outcome"] == "differs"
        if back:
            exp["outcome"] = "followed"
            exp["conclusion"] = ("the symptom went away with the LR 10x lower: the LR is the cause; the optimizer's "
                                 "rungs go on from here")
            inc.cause = "optimizer"
            inc.experiment = exp
            return None
        exp["outcome"] = "not_followed"
        amp_skips = amp is not None and (amp.get("skipped_steps") or 0) > 0
        exp["conclusion"] = ("the symptom stayed with the LR 10x lower: not the LR" +
                             ("; the data rules fire: the data" if self._data_active else
                              f"; mixed precision skipped {amp['skipped_steps']} step(s) meanwhile: its numerics"
                              if amp_skips else
                              f"; the step recomputed in float32 moves its gradient by {float32['rel_diff']:.3g} of a "
                              f"layer's norm (limit {self.policy.float32_rel_tol:g}): the mixed-precision numerics"
                              if numerics and isinstance(float32["rel_diff"], float) else
                              "; the step recomputed in float32 has a finite gradient where the mixed-precision one "
                              "had none: its numerics" if numerics else "") +
                             "; the LR goes back to where it was")
        if self._data_active:
            inc.cause = "data"
        elif amp_skips or numerics:
            inc.cause = "optimizer"
        inc.experiment = exp
        before = float(exp["lr_scale_before"])
        self._reports_since_rung = 0
        self._rung_step = step
        if desired.lr_scale == before:
            return None
        return RecoveryChange(desired.model_copy(update={"generation": desired.generation + 1, "lr_scale": before,
                                                         "reason": f"{self._why_cause()}: {exp['conclusion']}"[:2000]}),
                              "recovery:ladder")

    def _lr_jump_over(self) -> float | None:
        """The ratio of an LR jump that opened this optimizer incident and was over by its report
        (the verdict's ``trainguard_scheduler_lr_ratio`` evidence), the schedule back within the
        range it had before the jump now; None otherwise."""
        inc = self.open
        if inc is None or inc.cause != "optimizer":
            return None
        ratio = next((e["value"] for e in inc.verdict.get("evidence", []) if e["signal"] == LR_RATIO
                      and e["points_to"] == "optimizer" and isinstance(e["value"], (int, float))), None)
        if ratio is None or not ratio > 1:
            return None
        now = self._values.get(LR_RATIO)
        if now is not None and math.isfinite(now) and now > SCHEDULE_PEAK_MARGIN:
            return None  # the schedule is jumping now
        peak = self._lr_fault_peak
        if self._lr is not None and peak is not None and self._lr > SCHEDULE_PEAK_MARGIN * peak:
            return None  # the jump lasts: adaptive LR's
        return float(ratio)

    def _guard_replay(self, step: int, ratio: float, new: DesiredState) -> DesiredState:
        """A rollback over an LR jump that is over: the restored scheduler will ask for the jump
        again at the same point of its schedule, so around that point the rollback's scale is
        1/``ratio`` of the usual: from the last report at least one interval before the restored
        run reaches the jump's first possible step (the incident's onset) until one interval past
        the report that saw it. Before that, the rollback's scale: the restored schedule is the
        healthy one (guarded from the rollback on, 5 steps at x200 cost a run 68 steps at 1/400 of
        its LR)."""
        inc = self.open
        assert inc is not None
        seen = int(inc.rungs[0]["step"]) if inc.rungs else inc.onset_step
        interval = step - self._last_step if self._last_step is not None and self._last_step < step else 1
        until = step + max(seen - new.rollback_step, 0) + interval
        guard_from = step + (inc.onset_step - new.rollback_step) - interval - 1
        after = new.lr_scale
        guard = max(after / ratio, LR_SCALE_MIN)
        guarding = step if guard_from <= step else None
        inc.replay = {"kind": "over", "ratio": ratio, "from_step": step + 1, "guard_from": max(guard_from, step),
                      "guarding": guarding, "until_step": until, "lr_scale": guard, "lr_scale_after": after,
                      "released": None}
        if guarding is None:
            reason = (f"{new.reason}; then lr_scale {guard:.4g} (1/{ratio:.4g} of {after:.4g}) from the report at step "
                      f"{guard_from} to step {until}, where the restored schedule asks for the LR jump again")
            return new.model_copy(update={"reason": reason[:2000]})
        reason = (f"{new.reason}; lr_scale {guard:.4g} (1/{ratio:.4g} of {after:.4g}) until step {until}: the restored "
                  f"schedule asks for the LR jump again")
        return new.model_copy(update={"lr_scale": guard, "reason": reason[:2000]})

    def _guard_replayed_jump(self, step: int, desired: DesiredState) -> RecoveryChange:
        """The restored run nears the step of the LR jump: 1/``ratio`` of the rollback's scale until
        it is past it."""
        inc = self.open
        assert inc is not None and inc.replay is not None
        replay = inc.replay = dict(inc.replay, guarding=step)
        scale = min(replay["lr_scale"], desired.lr_scale)
        reason = (f"{self._why_cause()}: the restored schedule nears the LR jump (x{replay['ratio']:.4g}): lr_scale "
                  f"{scale:.4g} until step {replay['until_step']}")
        return RecoveryChange(desired.model_copy(update={"generation": desired.generation + 1, "lr_scale": scale,
                                                         "reason": reason[:2000]}), "recovery:ladder")

    def _lr_jump_lasts(self) -> bool:
        """This optimizer incident opened on the scheduled LR beyond the schedule's range, and it
        still is (a lasting fault of the user's schedule)."""
        inc, peak = self.open, self._lr_fault_peak
        if inc is None or inc.cause != "optimizer" or peak is None or self._lr is None:
            return False
        return self._lr > SCHEDULE_PEAK_MARGIN * peak and any(
            e["signal"] in _LR_SIGNALS and e["points_to"] == "optimizer" for e in inc.verdict.get("evidence", []))

    def _before_replay(self, step: int, new: DesiredState) -> DesiredState:
        """A rollback over a lasting LR jump: the rollback's scale is meant for the jumped schedule,
        but the restored one is healthy until it reaches the jump again. Until the last report
        before that point, the rollback's factor of the ceiling; then the rollback's scale."""
        inc = self.open
        assert inc is not None
        interval = step - self._last_step if self._last_step is not None and self._last_step < step else 1
        until = step + (inc.onset_step - new.rollback_step) - interval - 1
        before = min(self.policy.rollback_lr_factor * self.ceiling, LR_SCALE_MAX)
        if until <= step or before <= new.lr_scale:
            return new
        inc.replay = {"kind": "lasting", "from_step": step + 1, "until_step": until, "lr_scale": before,
                      "lr_scale_after": new.lr_scale, "released": None}
        reason = (f"{new.reason}; lr_scale {before:.4g} until step {until} (the restored schedule is the healthy one "
                  f"until it reaches the LR jump again), then {new.lr_scale:.4g}")
        return new.model_copy(update={"lr_scale": before, "reason": reason[:2000]})

    def _release_replay(self, step: int, values: dict[str, float], desired: DesiredState) -> RecoveryChange | None:
        """The restored run is past the LR jump: the scale the rollback meant (``lr_scale_after``),
        lower if the schedule's terms still need it (``ScheduleBaseline.needed``)."""
        inc = self.open
        assert inc is not None and inc.replay is not None
        replay = dict(inc.replay, released=step)
        inc.replay = replay
        self._reports_since_rung = 0
        self._rung_step = step
        if replay["kind"] == "lasting":
            scale = replay["lr_scale_after"]
            if scale == desired.lr_scale:
                return None
            reason = f"{self._why_cause()}: the restored schedule reaches the LR jump again: lr_scale {scale:.4g}"
            return RecoveryChange(desired.model_copy(update={"generation": desired.generation + 1, "lr_scale": scale,
                                                             "reason": reason[:2000]}), "recovery:ladder")
        needed, note = self.schedule.needed(values)
        scale = replay["lr_scale_after"] if needed is None else min(replay["lr_scale_after"], needed * self.ceiling)
        scale = min(max(scale, LR_SCALE_MIN), LR_SCALE_MAX)
        if scale <= desired.lr_scale:
            return None
        reason = f"{self._why_cause()}: the restored schedule is past the LR jump: lr_scale {scale:.4g} ({note})"
        return RecoveryChange(desired.model_copy(update={"generation": desired.generation + 1, "lr_scale": scale,
                                                         "reason": reason[:2000]}), "recovery:ladder")

    def _sampling_check(self) -> dict[str, Any]:
        """The sampling distribution at the end of the experiment: each data-quality rule's value
        (the agent's data monitor) against its threshold."""
        checks = []
        for name, metric, op, limit, active in self._data_checks:
            v = self._values.get(metric)
            checks.append({"rule": name, "metric": metric, "value": None if v is None else _finite_or_text(v),
                           "limit": f"{op} {limit}" if limit is not None else None, "out_of_bounds": bool(active)})
        reported = [c for c in checks if c["value"] is not None]
        outcome = ("not_reported" if not reported else
                   "out_of_bounds" if any(c["out_of_bounds"] for c in checks) else "in_bounds")
        return {"outcome": outcome, "checks": checks}

    def _float32_check(self, rel_diff: Any) -> dict[str, Any]:
        """The float32 recompute the experiment asked for on its first step (``verify_float32``):
        the largest relative difference any rank measured between its mixed-precision gradient and
        the same step's in float32, against ``float32_rel_tol``."""
        limit, rel_diff = self.policy.float32_rel_tol, _number(rel_diff)
        if rel_diff is None:
            return {"outcome": "not_measured", "limit": f"<= {limit:g}",
                    "why": "no rank recomputed a step in float32: the run trains without autocast, its loop does not "
                           "call agent.verify_step, or its parameters are sharded"}
        return {"outcome": "agrees" if rel_diff <= limit else "differs", "rel_diff": _finite_or_text(rel_diff),
                "limit": f"<= {limit:g}"}

    def _amp_check(self, skipped_at_start: float | None) -> dict[str, Any] | None:
        """Mixed precision during the experiment (None: the run reports no loss scale): the
        GradScaler's scale now and the steps it skipped since the experiment began. The float32
        recompute is ``experiment.float32_recompute`` (:meth:`_float32_check`)."""
        scale = self._values.get("trainguard_loss_scale")
        if scale is None:
            return None
        now = self._values.get("trainguard_amp_skipped_steps_total")
        skipped = (int(now - skipped_at_start) if now is not None and skipped_at_start is not None
                   and math.isfinite(now) and math.isfinite(skipped_at_start) else None)
        return {"loss_scale": _finite_or_text(scale), "skipped_steps": skipped}

    # ------------------------------------------------------------------ internals

    def _ramp_measure(self) -> tuple[float | None, float | None]:
        """(baseline, measurement) the ramp and the incident judge the update by: per unit of LR
        when the agent reports it and it has a healthy baseline, else the policy's metric."""
        per_lr = self._values.get(ScheduleBaseline.PER_LR)
        base = baseline(self.schedule.per_lr)
        if per_lr is not None and base is not None:
            return base, float(per_lr)
        return self.baseline(), self._measured

    def _track_snapshots(self, values: dict[str, float], healthy: bool) -> None:
        confirm = self.policy.snapshot_confirm_reports
        for snap in self.snapshots:
            if not snap.good(confirm):
                if healthy:
                    snap.healthy_after += 1
                else:
                    snap.tainted = True
        v = values.get("trainguard_snapshot_step")
        if v is None or not math.isfinite(v):
            return
        newest = int(v)
        self._drop_snapshots_after(newest)
        if not self.snapshots or self.snapshots[-1].step < newest:
            self.snapshots.append(_Snap(newest))
            if self.snapshot_every is not None:
                keep = set(retained((s.step for s in self.snapshots), every=self.snapshot_every, keep=self.snapshot_keep))
                self.snapshots = deque(s for s in self.snapshots if s.step in keep)
            while len(self.snapshots) > self.snapshot_keep:
                self.snapshots.popleft()

    def _drop_snapshots_after(self, step: int) -> None:
        while self.snapshots and self.snapshots[-1].step > step:
            self.snapshots.pop()

    def _open(self, step: int, now: float, trigger: str) -> None:
        onset = self._last_step + 1 if self._last_step is not None else step
        self.open = Incident(next(_ids), onset, now, trigger)
        v = self._verdict
        if v is not None:  # decided on this report, before any action (``consider``)
            self.open.cause = v.cause
            self.open.verdict = v.as_dict()
        else:
            self.open.verdict = {"summary": "no verdict: the incident opened without an alarming report",
                                 "evidence": [], "ranks": [], "hosts": []}
        self._opened_now = True
        self.incidents.append(self.open)
        self._healthy_in_a_row = 0
        self._incident_losses = ()
        self._reports_since_rung = 0
        self._rung_step = step

    def _rung(self, rung: str, step: int, now: float, actor: str, desired: DesiredState | None, reason: str = "",
              *, restart_window: bool = True) -> None:
        assert self.open is not None
        self.open.rungs.append({"rung": rung, "step": step, "time": now, "actor": actor,
                                "reason": desired.reason if desired is not None else reason,
                                "generation": desired.generation if desired is not None else None})
        if restart_window:
            self._reports_since_rung = 0
            self._rung_step = step
        if rung == "data_skip" and desired is not None:
            self.open.data_skipped = [step + 1, desired.data_skip_until]
        if rung == "experiment" and desired is not None:
            self.open.experiment = {"lr_factor": _EXPERIMENT_LR_FACTOR, "from_step": step,
                                    "until_step": step + self.policy.experiment_steps,
                                    "lr_scale_before": self._scale_before_experiment, "outcome": None,
                                    "amp_skipped_at_start": self._values.get("trainguard_amp_skipped_steps_total")}
        if rung == "pause":
            self._close("escalated", step, now)

    def _close(self, outcome: str, step: int, now: float) -> None:
        assert self.open is not None
        self.open.outcome, self.open.closed_step, self.open.closed_time = outcome, step, now
        self.open = None
        self._healthy_in_a_row = 0

    def _escalate(self, step: int, now: float, desired: DesiredState) -> RecoveryChange | None:
        """Take the ladder's next rung after the highest one this incident took."""
        assert self.open is not None
        ladder = self.ladder()
        taken = [ladder.index(r["rung"]) for r in self.open.rungs if r["rung"] in ladder]
        exp = self.open.experiment
        jump = self._lr_jump_over()
        for rung in ladder[(max(taken) + 1 if taken else 0):]:
            if rung == "adaptive_lr" and exp is not None and exp.get("outcome") == "not_followed":
                continue  # the experiment showed that the LR is not the cause
            if rung == "adaptive_lr" and jump is not None:
                continue  # the LR is back on the schedule: the jump's damage is the rollback's to repair
            new = self._rung_state(rung, desired, step)
            if new is None:
                continue  # a rung that changes nothing (e.g. adaptive LR at its baseline): the next
            if rung == "rollback" and new.rollback_seq > desired.rollback_seq:
                if jump is not None:
                    new = self._guard_replay(step, jump, new)
                elif self._lr_jump_lasts():
                    new = self._before_replay(step, new)
            self._rung(rung, step, now, "recovery:ladder", new)
            if rung == "stop" and self.open is not None:
                self._close("escalated", step, now)
            if rung == "rollback" and new.rollback_seq > desired.rollback_seq:
                self._drop_snapshots_after(new.rollback_step)
            elif rung == "rollback" and new.paused:  # refused: paused instead
                if self.open is not None:
                    self._close("escalated", step, now)
            return RecoveryChange(new, "recovery:ladder")
        return None

    def _rung_state(self, rung: str, d: DesiredState, step: int, *, why: str | None = None) -> DesiredState | None:
        inc = self.open
        why = why or (f"incident {inc.id if inc else '?'} (onset step {inc.onset_step if inc else '?'}, cause "
                      f"{inc.cause if inc else '?'}): signals not back after {self.policy.window_reports} reports")
        if rung == "adaptive_lr":
            return apply_actions(d, (AdaptiveLrAction(metric=self.policy.metric),), f"{why}: adaptive LR", self)
        if rung == "rollback":
            # A data fault is rolled back with the LR as it is (the batches, not the LR, did the harm).
            factor = 1.0 if inc is not None and inc.cause == "data" else self.policy.rollback_lr_factor
            return apply_actions(d, (RollbackAction(lr_factor=factor),), f"{why}: rollback", self)
        if rung == "pause":
            return apply_actions(d, (PauseAction(),), f"{why}: paused, a human is needed{self._where()}", self)
        if rung == "checkpoint":
            return apply_actions(d, (CheckpointAction(),), f"{why}: checkpoint{self._where()}", self)
        if rung == "stop":
            new = apply_actions(d, (StopAction(),), f"{why}: {HARDWARE_STOP_REASON}{self._where()}", self)
            code = EXIT_HARDWARE_FAULT if inc is not None and inc.cause == "hardware" else 0
            return None if new is None else new.model_copy(update={"stop_exit_code": code})
        if rung == "data_skip":
            until = max(d.data_skip_until, step + self.policy.data_skip_steps)
            return d.model_copy(update={"generation": d.generation + 1, "data_skip_until": until,
                                        "reason": f"{why}: skipping the batches of steps {step + 1}-{until} on every rank, "
                                                  f"the LR untouched"[:2000]})
        spec = BY_NAME.get(rung)
        if spec is not None and spec.remedy:  # an optimizer remedy: its rule action with the defaults
            return apply_actions(d, (spec.rule_action(),), f"{why}: {rung.replace('_', ' ')}", self)
        if rung == "experiment":
            self._scale_before_experiment = d.lr_scale
            new = apply_actions(d, (LrScaleAction(factor=_EXPERIMENT_LR_FACTOR),),
                                f"{why}: experiment: the LR 10x lower for {self.policy.experiment_steps} steps, to see "
                                f"whether the symptom follows it, and the next step recomputed in float32 (mixed "
                                f"precision off) to see whether the numerics change its gradient", self)
            return None if new is None else new.model_copy(update={"verify_float32_seq": d.verify_float32_seq + 1})
        return None  # skip: the agent's own rung

    def _where(self) -> str:
        """The suspect ranks and hosts of a hardware incident, for a rung's reason."""
        v = self.open.verdict if self.open is not None else {}
        ranks, hosts = v.get("ranks") or [], v.get("hosts") or []
        return "" if not ranks else " (" + ", ".join(f"rank {r} on {h}" for r, h in zip(ranks, hosts)) + ")"

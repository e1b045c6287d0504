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

The pieces live in ``service/recovery/``: the incident record and its persisted form
(``incident.py``), the snapshots (``snapshots.py``), the newest report's reading and the rung's
window (``reading.py``), the ladder's rungs (``ladder.py``, a mixin of :class:`RunRecovery`), the
experiment's checks (``experiment.py``) and the replay guard of a rolled-back LR jump
(``replay.py``). This module keeps :class:`RunRecovery` (what a report feeds, the cause, the
measured actions' context) and the names its importers use.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import Any

from trainguard.protocol.commands import REGISTRY
from trainguard.protocol.wire import LR_SCALE_MAX, LR_SCALE_MIN, DesiredState
from trainguard.service.adaptive_lr import LrRamp, ScheduleBaseline, baseline, corrected_scale
from trainguard.service.cause import HARDWARE_DIAGNOSES as _HARDWARE, Verdict, judge, refusal
from trainguard.service.recovery import replay as _replay
from trainguard.service.recovery.incident import (
    QUARANTINE_LIMIT, Incident, RecoveryChange, continue_ids_after, finite_or_text, incident_from_dict, new_id, number,
    rungs_of,
)
from trainguard.service.recovery.ladder import HARDWARE_STOP_REASON, LadderRungs
from trainguard.service.recovery.reading import ReportReading, RungWindow
from trainguard.service.recovery.snapshots import Snap, Snapshots, snapshot_policy
from trainguard.service.rules import AdaptiveLrAction, RecoveryPolicy

__all__ = ["HARDWARE_STOP_REASON", "Incident", "RunRecovery", "RecoveryChange", "continue_ids_after", "rungs_of", "snapshot_policy",
           "QUARANTINE_LIMIT", "Snap"]

#: The metrics whose healthy median a command's fold reads (``CommandSpec.measures``).
_MEASURED = tuple(dict.fromkeys((*(m for c in REGISTRY for m in c.measures), "trainguard_loss")))
#: Rule actions that are not a response to trouble: ``notify``, and ``accumulation`` (the adaptive
#: batch size follows the gradient variance of a healthy run). A rule that takes only these does not
#: make a report unhealthy (no snapshot is tainted, no incident opens on it).
_NOT_TROUBLE = frozenset({"notify", "accumulation"})


def _acts_on_trouble(rule: Any) -> bool:
    """Whether ``rule`` takes an action that responds to trouble."""
    return any(a.type not in _NOT_TROUBLE for a in rule.actions)


def _then(changes: list[RecoveryChange], desired: DesiredState, change: RecoveryChange | None) -> DesiredState:
    """Append ``change`` (if any) to ``changes``; the desired state in force after it."""
    if change is None:
        return desired
    changes.append(change)
    return change.desired


class RunRecovery(LadderRungs):
    """The recovery state of one run (see the module docstring)."""

    def __init__(self, policy: RecoveryPolicy | None = None, *, snapshot_every: int | None = None,
                 snapshot_keep: int = 3, ceiling: float = 1.0, skips_nonfinite: bool = False) -> None:
        self.policy = policy or RecoveryPolicy()
        self.ceiling = ceiling
        """The ``lr_scale`` an operator set last: the ramp climbs back to it, never above."""
        self.skips_nonfinite = skips_nonfinite
        """The agent skips steps with non-finite gradients (its registration config says so)."""
        self._own_accumulation: int | None = None
        """The run's own accumulation steps when it lets the controller change them (its registration config)."""
        self.snapshot_book = Snapshots(snapshot_every, snapshot_keep)
        self.incidents: deque[Incident] = deque(maxlen=100)
        self.open: Incident | None = None
        self.window = RungWindow()
        self.reading = ReportReading()
        self._healthy_metric: deque[float] = deque(maxlen=self.policy.baseline_reports)
        #: The same for each metric a command's fold measures (``healthy_median``).
        self._healthy_measures: dict[str, deque[float]] = {m: deque(maxlen=self.policy.baseline_reports) for m in _MEASURED}
        self._last_step: int | None = None
        self._healthy_lr: deque[float] = deque(maxlen=self.policy.baseline_reports)
        #: The update per unit of LR and the schedule's envelope, healthy (``service/adaptive_lr.py``).
        self.schedule = ScheduleBaseline(reports=self.policy.baseline_reports, tolerance=self.policy.degrade_ratio)
        self._lr_peak: float | None = None
        """The highest scheduled LR of a healthy report (the schedule's range so far)."""
        self._lr_fault_peak: float | None = None
        """After a verdict of an LR beyond the schedule's range: that range (the schedule's highest
        LR before the fault), raised by the healthy reports since (None: no LR fault seen)."""
        self._verdict: Verdict | None = None
        """The cause of what the newest report shows (:meth:`consider`), while no incident is open."""
        self._revised = False
        """The newest report revised the open incident's cause to hardware."""
        self._opened_now = False
        self._scale_before_experiment = 1.0
        self.ramp = self._new_ramp()

    @property
    def snapshots(self) -> deque[Snap]:
        """The snapshots held, oldest first."""
        return self.snapshot_book.held

    @property
    def snapshot_every(self) -> int | None:
        return self.snapshot_book.every

    @property
    def snapshot_keep(self) -> int:
        return self.snapshot_book.keep

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
        self.snapshot_book.every, self.snapshot_book.keep = snapshot_policy(config)
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

    _SCALARS = ("_last_step", "_verdict", "_lr_peak", "_revised", "_opened_now", "_lr_fault_peak")

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
            "healthy_metric": list(self._healthy_metric),
            "healthy_measures": {m: list(v) for m, v in self._healthy_measures.items()},
            "healthy_lr": list(self._healthy_lr),
            "ramp": self.ramp.copy(),
            "schedule": self.schedule.copy(),
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
        self._healthy_metric = deque(saved["healthy_metric"], maxlen=self._healthy_metric.maxlen)
        self._healthy_measures = {m: deque(v, maxlen=self.policy.baseline_reports) for m, v in saved["healthy_measures"].items()}
        self._healthy_lr = deque(saved["healthy_lr"], maxlen=self._healthy_lr.maxlen)
        self.ramp = saved["ramp"]
        self.schedule = saved["schedule"]

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
        return (before, inc.as_dict()) if inc.add_quarantined(samples) else None

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
            needed, note = self.schedule.needed(self.reading.values)
            if needed is not None:
                return min(max(needed * self.ceiling, action.min), action.max, current), note
        base, measured = self.baseline(), self.reading.measured
        # The measurement was made at the scale the agent reported (several actions on one report
        # must not compound: each computes from that scale, and none raises the current one).
        at = self.reading.measured_scale if self.reading.measured_scale is not None else current
        new = corrected_scale(at, measured, base, lo=action.min, hi=action.max)
        if new is not None:
            return min(new, current), f"update ratio {measured:.3g} at lr_scale {at:.4g} vs healthy baseline {base:.3g}"
        # No usable update ratio (e.g. the step of the report was skipped): the LR the user's own
        # schedule set, against its healthy level, says how far the LR itself jumped.
        lr_base = baseline(self._healthy_lr)
        lr_new = corrected_scale(1.0, self.reading.lr, lr_base, lo=action.min, hi=action.max)
        if lr_new is not None and lr_new < 1.0:
            return min(lr_new, current), f"the schedule's LR {self.reading.lr:.3g} vs its healthy level {lr_base:.3g}"
        return None, "no healthy baseline of the update ratio yet" if base is None else "no finite update ratio"

    def own_accumulation(self) -> int | None:
        return self._own_accumulation

    def rollback_target(self) -> tuple[int | None, str]:
        return self.snapshot_book.rollback_target(self.policy.snapshot_confirm_reports)

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
        if self.reading.skipped_now:
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
        self.reading.take_findings(findings, window)
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
        verdict = judge(findings, window, skipped=self.reading.skipped_now, lr_healthy=list(self._healthy_lr), lr_peak=peak,
                        metric=self.policy.metric, metric_baseline=self.baseline(),
                        hosts={int(r["rank"]): str(r["host"]) for r in ranks})
        if self.open is None:
            self._verdict = verdict
            if verdict.cause == "optimizer" and peak is not None and any(
                    e["points_to"] == "optimizer" and e["signal"] in _replay.LR_SIGNALS for e in verdict.evidence):
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
        return self.reading.skipped_now

    def before_decide(self, values: dict[str, float]) -> None:
        """The report's measurement, for the actions the rules take on it."""
        self.reading.take(values, self.policy.metric, skips_nonfinite=self.skips_nonfinite)

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
        if self.reading.data_active and self.open is not None and self.open.cause == "data":
            return False  # a data incident is over when its data is back in bounds
        return True

    def _loss_hurt(self, values: dict[str, float]) -> bool:
        """An optimizer incident's signals are back but not its loss: the median loss of its last
        ``recover_reports`` reports with the signals back is above ``loss_recovered_ratio`` x the loss's healthy median
        before the onset. Only while the ladder's rollback is still ahead and a good snapshot
        exists: the steps taken at the faulty LR moved the weights (one step at x100 left a small
        GPT 1.2x above its healthy loss 190 steps later, at the right LR), and the rollback restores
        them. Without a snapshot the run trains back on its own: no rung for the loss alone.
        Pure: the losses are recorded by ``_judge_window`` (``RungWindow.record_loss``) when the
        signals are back, before it asks."""
        inc, p = self.open, self.policy
        loss = values.get("trainguard_loss")
        if inc is None or loss is None or not math.isfinite(loss):
            return False
        if (inc.cause != "optimizer" or len(self.window.incident_losses) < p.recover_reports
                or not math.isfinite(p.loss_recovered_ratio)
                or "rollback" not in self.ladder() or any(r["rung"] == "rollback" for r in inc.rungs)
                or not self.snapshot_book.any_good(p.snapshot_confirm_reports)):
            return False
        base = self.healthy_median("trainguard_loss")
        recent = self.window.loss_median()
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
        if ScheduleBaseline.PER_LR not in self.reading.values:  # the policy's metric: above its baseline
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
        return measured > self.policy.degrade_ratio * base and not self.schedule.small_update(self.reading.values)

    def after_report(self, *, step: int, values: dict[str, float], findings: list[Any], before: DesiredState,
                     desired: DesiredState, fired: list[tuple[str, DesiredState]], now: float) -> list[RecoveryChange]:
        """Feed one report after the rules decided. ``before``/``desired``: the desired state
        before and after the rules' actions; ``fired``: (rule, desired state) of each alert whose
        actions changed it. Returns the further changes to commit (newest last)."""
        self._opened_now = False
        healthy = self.healthy(values, findings)
        self.snapshot_book.track(values, healthy, self.policy.snapshot_confirm_reports)
        measured = self.reading.measured
        changes: list[RecoveryChange] = []
        self._note_fired(step, now, before, fired)
        self._note_skips(step, now, healthy, desired)
        desired = self._open_on_cause(step, now, healthy, desired, changes)
        desired = self._follow_replay(step, values, desired, changes)
        experiment, desired = self._follow_experiment(step, healthy, desired, changes)
        if self.open is not None:
            desired = _then(changes, desired, self._judge_window(step, now, values, healthy, experiment, desired,
                                                                 bool(fired or changes)))
            self.ramp.reset()
        elif self.policy.enabled and not fired:
            _then(changes, desired, self._ramp_up(step, values, healthy, desired))
        elif fired:
            self.ramp.reset()
        if healthy and self.open is None and desired.lr_scale == self.ceiling and not changes:
            self._add_healthy(values, measured)
        self._last_step = step
        return changes

    def _note_fired(self, step: int, now: float, before: DesiredState, fired: list[tuple[str, DesiredState]]) -> None:
        """The rungs the rules' own actions took (an incident opens on the first)."""
        prev_desired = before
        for rule, new in fired:
            rungs = rungs_of(prev_desired, new)
            if rungs and self.open is None:
                self._open(step, now, f"rule:{rule}")
            if self.open is not None:
                for rung in rungs:
                    self._rung(rung, step, now, f"rule:{rule}", new)
            if new.rollback_seq > prev_desired.rollback_seq:
                self.snapshot_book.drop_after(new.rollback_step)
            prev_desired = new

    def _report_ladder(self) -> tuple[str, ...]:
        """The ladder of the open incident, else of the newest report's verdict."""
        verdict, p = self._verdict, self.policy
        if self.open is not None:
            return self.ladder()
        return (tuple(getattr(p.ladders, verdict.cause)) if verdict is not None and verdict.cause in ("data", "hardware", "unknown")
                else p.optimizer_ladder)

    def _note_skips(self, step: int, now: float, healthy: bool, desired: DesiredState) -> None:
        """The agent's spike guard skipping steps: the ladder's first rung, the agent's own."""
        skipped = self.reading.skipped_now
        if self.policy.enabled and not healthy and skipped and "skip" in self._report_ladder() and not desired.paused:
            # (a paused run is a human's: no incident opens on the reports it sends while paused)
            why = f"the agent skipped {skipped} step(s) it did not trust"
            if self.open is None:
                self._open(step, now, "skip")
                self._rung("skip", step, now, "agent", None, why)
            elif not self.open.rungs or self.open.rungs[-1]["rung"] != "skip":  # noted; the controller's rung keeps its window
                self._rung("skip", step, now, "agent", None, why, restart_window=False)

    def _open_on_cause(self, step: int, now: float, healthy: bool, desired: DesiredState,
                       changes: list[RecoveryChange]) -> DesiredState:
        """An incident of a data or hardware cause opens (the cause refused the rules' own actions,
        an LR cut for data: its rungs act instead), and the first rungs of its cause are taken."""
        p, verdict = self.policy, self._verdict
        opened = False
        if (p.enabled and self.open is None and verdict is not None and verdict.cause in ("data", "hardware")
                and not desired.paused and (not healthy or verdict.cause == "hardware")):
            self._open(step, now, f"cause:{verdict.cause}")
            opened = True
        elif self._opened_now:
            opened = True  # opened by this report's rules or skips
        if self.open is not None and p.enabled and (opened or self._revised):
            for change in self._first_rungs(step, now, desired):
                desired = _then(changes, desired, change)
        self._revised = False
        if self.open is not None and self.open.cause == "data" and self.reading.data_active and p.enabled:
            desired = _then(changes, desired, self._extend_data_skip(step, desired))
        return desired

    def _follow_replay(self, step: int, values: dict[str, float], desired: DesiredState,
                       changes: list[RecoveryChange]) -> DesiredState:
        """The replay guard of a rolled-back LR jump: begun near the jump, released past it."""
        inc = self.open
        replay = inc.replay if inc is not None else None
        if inc is None or replay is None or not self.policy.enabled:
            return desired
        if _replay.guard_due(replay, step):
            desired = _then(changes, desired, _replay.guard_replayed_jump(inc, step, desired, self._why_cause()))
        if _replay.release_due(replay, step):
            why = self._why_cause()
            self.window.restart(step)
            desired = _then(changes, desired, _replay.release_replay(inc, step, values, desired, why,
                                                                     schedule=self.schedule, ceiling=self.ceiling))
        return desired

    def _follow_experiment(self, step: int, healthy: bool, desired: DesiredState,
                           changes: list[RecoveryChange]) -> tuple[dict[str, Any] | None, DesiredState]:
        """The troubleshooting experiment of the open incident: its float32 recompute noted, and
        its conclusion at its end. Returns the experiment (as it was before any conclusion) and
        the desired state in force."""
        experiment = self.open.experiment if self.open is not None else None
        if experiment is None or experiment.get("outcome") is not None or not self.policy.enabled:
            return experiment, desired
        float32 = self.reading.float32_now
        if float32 is not None and step > experiment["from_step"]:
            seen = number(experiment.get("float32_rel_diff"))
            worst = float32 if seen is None else max(seen, float32)
            experiment = dict(experiment, float32_rel_diff=finite_or_text(worst))
            self.open.experiment = experiment  # type: ignore[union-attr]
        if step >= experiment["until_step"]:
            desired = _then(changes, desired, self._conclude_experiment(step, healthy and not self.degraded(), desired))
        return experiment, desired

    def _judge_window(self, step: int, now: float, values: dict[str, float], healthy: bool,
                      experiment: dict[str, Any] | None, desired: DesiredState, acted: bool) -> RecoveryChange | None:
        """The open incident's window after this report: recovered, still working, or escalated."""
        p, window = self.policy, self.window
        if acted:
            window.healthy_in_a_row = 0
            return None
        if self._working(experiment):
            # The rung in force is still working (data skipped, the experiment running): its
            # window opens when that ends, so the run gets window_reports/window_steps on good
            # data to show its signals back. Counted from the rung's decision instead, a long
            # burst used the window up and the first unhealthy reports after it escalated.
            window.restart(step)
            return None
        if healthy and not self.degraded():
            window.record_loss(values, p.recover_reports)  # the signals are back: is the loss? (``_loss_hurt``)
            if not self._loss_hurt(values):
                window.healthy_in_a_row += 1
                if window.healthy_in_a_row >= p.recover_reports:
                    self._close("recovered", step, now)
                return None
        if window.spent(step, p.window_reports, p.window_steps) and p.enabled:
            return self._escalate(step, now, desired)
        return None

    def _ramp_up(self, step: int, values: dict[str, float], healthy: bool, desired: DesiredState) -> RecoveryChange | None:
        """Outside incidents: the ramp's next step back up towards the ceiling, if any."""
        needed, note = self.schedule.needed(values)
        base, now_measured = self._ramp_measure()
        ramp = self.ramp.observe(step, healthy=healthy, measured=now_measured, base=base,
                                 scale=desired.lr_scale, ceiling=self.ceiling,
                                 needed=None if needed is None else needed * self.ceiling, needed_note=note)
        if ramp is None:
            return None
        new = desired.model_copy(update={"generation": desired.generation + 1, "reason": ramp.reason,
                                         "lr_scale": min(max(ramp.scale, LR_SCALE_MIN), LR_SCALE_MAX)})
        return RecoveryChange(new, "recovery:ramp")

    def _add_healthy(self, values: dict[str, float], measured: float | None) -> None:
        """A healthy report outside incidents at the ceiling: it joins the baselines."""
        if measured is not None and math.isfinite(measured) and measured > 0:
            self._healthy_metric.append(measured)
        for name, kept in self._healthy_measures.items():
            v = values.get(name)
            if v is not None and math.isfinite(v) and v > 0:
                kept.append(float(v))
        self.schedule.add_healthy(values)
        lr = self.reading.lr
        if lr is not None:
            self._healthy_lr.append(lr)
            self._lr_peak = lr if self._lr_peak is None else max(self._lr_peak, lr)
        top = values.get("trainguard_scheduler_lr_max", lr)
        if self._lr_fault_peak is not None and top is not None and math.isfinite(top):
            self._lr_fault_peak = max(self._lr_fault_peak, float(top))

    # ------------------------------------------------------------------ internals

    def _ramp_measure(self) -> tuple[float | None, float | None]:
        """(baseline, measurement) the ramp and the incident judge the update by: per unit of LR
        when the agent reports it and it has a healthy baseline, else the policy's metric."""
        per_lr = self.reading.values.get(ScheduleBaseline.PER_LR)
        base = baseline(self.schedule.per_lr)
        if per_lr is not None and base is not None:
            return base, float(per_lr)
        return self.baseline(), self.reading.measured

    def _open(self, step: int, now: float, trigger: str) -> None:
        onset = self._last_step + 1 if self._last_step is not None else step
        self.open = Incident(new_id(), onset, now, trigger)
        v = self._verdict
        if v is not None:  # decided on this report, before any action (``consider``)
            self.open.cause = v.cause
            self.open.verdict = v.as_dict()
        else:
            self.open.verdict = {"summary": "no verdict: the incident opened without an alarming report",
                                 "evidence": [], "ranks": [], "hosts": []}
        self._opened_now = True
        self.incidents.append(self.open)
        self.window.open_at(step)

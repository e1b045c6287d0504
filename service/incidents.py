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
snapshot: taken before the onset by construction. With none, it is refused with the reason. A
run that registers again (its job restarted) holds none until the new process reports its own.

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
window (``reading.py``), the healthy baselines and the ramp's measurement (``baselines.py``), a
report's health (``health.py``), the ladder's rungs and their follow-ups (``ladder.py``), the
cause of the newest report (``report_cause.py``), the save and restore of the state
(``persistence.py``; these three are mixins of :class:`RunRecovery`), the experiment's checks
(``experiment.py``) and the replay guard of a rolled-back LR jump (``replay.py``). This module
keeps :class:`RunRecovery` (what a report feeds, the incident's window, the measured actions'
context) and the names its importers use.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from trainguard.protocol.wire import LR_SCALE_MAX, LR_SCALE_MIN, DesiredState
from trainguard.service.adaptive_lr import LrRamp, ScheduleBaseline
from trainguard.service.cause import Verdict
from trainguard.service.recovery.baselines import HealthyBaselines
from trainguard.service.recovery.health import report_healthy
from trainguard.service.recovery.incident import (
    QUARANTINE_LIMIT, Incident, RecoveryChange, continue_ids_after, new_id, rungs_of, then,
)
from trainguard.service.recovery.ladder import HARDWARE_STOP_REASON, LadderRungs
from trainguard.service.recovery.persistence import SavedRecovery
from trainguard.service.recovery.reading import ReportReading, RungWindow
from trainguard.service.recovery.report_cause import ReportCause
from trainguard.service.recovery.snapshots import Snap, Snapshots, snapshot_policy
from trainguard.service.rules import AdaptiveLrAction, RecoveryPolicy

__all__ = ["HARDWARE_STOP_REASON", "Incident", "RunRecovery", "RecoveryChange", "continue_ids_after", "rungs_of", "snapshot_policy",
           "QUARANTINE_LIMIT", "Snap"]


def _settled(desired: DesiredState) -> bool:
    """The run's fate is decided: paused (a human's now) or asked to stop (it is ending). Reports the
    ranks send before they apply it (a round trip the agent never waits for) open no incident: a
    second incident on the same fault would checkpoint again on a run that is stopping."""
    return desired.paused or desired.stop


class RunRecovery(ReportCause, SavedRecovery, LadderRungs):
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
        self.baselines = HealthyBaselines(self.policy.baseline_reports, self.policy.degrade_ratio)
        self._last_step: int | None = None
        self._verdict: Verdict | None = None
        """The cause of what the newest report shows (:meth:`consider`), while no incident is open."""
        self._revised = False
        """The newest report revised the open incident's cause (to hardware; a single-batch data verdict to unknown)."""
        self._opened_now = False
        self._scale_before_experiment = 1.0
        self.ramp = self._new_ramp()

    @property
    def snapshots(self) -> deque[Snap]:
        """The snapshots held, oldest first."""
        return self.snapshot_book.held

    @property
    def schedule(self) -> ScheduleBaseline:
        """The healthy update per unit of LR and the schedule's envelope (``HealthyBaselines``)."""
        return self.baselines.schedule

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

    def job_restarted(self) -> None:
        """The run's job registered again: a new process. The snapshots the old one held in memory
        are gone with it (no rollback may name them); an open incident stays open, its rung's
        window afresh from the new process's reports (the rung acted on the process that ended).
        The healthy baselines stay: they describe the run, which goes on."""
        self.snapshot_book.held.clear()
        self._last_step = None
        if self.open is not None:
            self.window.restart(0)  # (the job may resume from a step before the rung's)
            self.window.healthy_in_a_row = 0

    def _new_ramp(self) -> LrRamp:
        p = self.policy
        return LrRamp(ramp_steps=p.ramp_steps, stable_reports=p.stable_reports, degrade_ratio=p.degrade_ratio)

    def set_policy(self, policy: RecoveryPolicy) -> None:
        if policy != self.policy:
            self.policy = policy
            self.baselines.resize(policy.baseline_reports, policy.degrade_ratio)
            self.ramp = self._new_ramp()

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
        return self.baselines.baseline()

    def healthy_median(self, metric: str) -> float | None:
        """The median of ``metric`` over the last ``baseline_reports`` healthy reports taken outside
        incidents at the run's own ``lr_scale`` (so before the open incident's onset), as the
        adaptive LR's baseline is; None without one, or for a metric no command measures."""
        if metric == self.policy.metric:
            return self.baseline()
        return self.baselines.median(metric)

    def adaptive_scale(self, action: AdaptiveLrAction, current: float) -> tuple[float | None, str]:
        """The ``lr_scale`` an adaptive LR action sets from the newest report's measurement and
        its healthy baseline (never above ``current``), and why; None when it cannot be measured."""
        return self.baselines.adaptive_scale(action, current, self.reading, metric=self.policy.metric, ceiling=self.ceiling)

    def own_accumulation(self) -> int | None:
        return self._own_accumulation

    def rollback_target(self) -> tuple[int | None, str]:
        return self.snapshot_book.rollback_target(self.policy.snapshot_confirm_reports)

    # ------------------------------------------------------------------ feeding

    def skipped_now(self) -> int:
        # The steps not taken: the agent's skips, and the loss scaler's (for a rollback's
        # ``unless_skipped``; the scaler's open an incident only with a report unhealthy otherwise).
        return max(self.reading.skipped_now, self.reading.amp_skipped_now)

    def before_decide(self, values: dict[str, float]) -> None:
        """The report's measurement, for the actions the rules take on it."""
        self.reading.take(values, self.policy.metric, skips_nonfinite=self.skips_nonfinite)

    def healthy(self, values: dict[str, float], findings: list[Any]) -> bool:
        """See the module docstring."""
        data_incident = self.reading.data_active and self.open is not None and self.open.cause == "data"
        return report_healthy(values, findings, self.policy, data_incident=data_incident)

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
        degrade_ratio) of its baseline (the optimizer's state still holds the fault: the run trains
        at a fraction of its LR) unless the loss is below its healthy median by the margin of
        ``loss_recovered_ratio`` (the run trains better than before the onset at that update)."""
        loss, base = self.reading.values.get("trainguard_loss"), self.healthy_median("trainguard_loss")
        below = (loss is not None and base is not None and math.isfinite(loss)
                 and loss < base / self.policy.loss_recovered_ratio)
        return self.baselines.degraded(self.reading, self.policy.degrade_ratio, loss_below=below)

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
            desired = then(changes, desired, self._judge_window(step, now, values, healthy, experiment, desired,
                                                                 bool(fired or changes)))
            self.ramp.reset()
        elif self.policy.enabled and not fired and not desired.stop:
            then(changes, desired, self._ramp_up(step, values, healthy, desired))
        elif fired:
            self.ramp.reset()
        if healthy and self.open is None and desired.lr_scale == self.ceiling and not changes:
            self.baselines.add(values, measured, self.reading.lr)
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

    def _note_skips(self, step: int, now: float, healthy: bool, desired: DesiredState) -> None:
        """Steps not taken on an unhealthy report: the ladder's first rung, the trainer's own (the
        agent's spike guard or non-finite skip, or the mixed-precision loss scaler's skip)."""
        skipped, scaler = self.reading.skipped_now, self.reading.amp_skipped_now
        if (self.policy.enabled and not healthy and (skipped or scaler) and "skip" in self._report_ladder()
                and not _settled(desired)):
            # (a paused run is a human's, a stopping run is ending: no incident opens on their reports)
            why = (f"the agent skipped {skipped} step(s) it did not trust" if skipped else
                   f"the mixed-precision loss scaler skipped {scaler} step(s) with non-finite gradients")
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
                and not _settled(desired) and (not healthy or verdict.cause == "hardware")):
            self._open(step, now, f"cause:{verdict.cause}")
            opened = True
        elif self._opened_now:
            opened = True  # opened by this report's rules or skips
        if self.open is not None and p.enabled and (opened or self._revised):
            for change in self._first_rungs(step, now, desired):
                desired = then(changes, desired, change)
        self._revised = False
        if self.open is not None and self.open.cause == "data" and self.reading.data_active and p.enabled:
            desired = then(changes, desired, self._extend_data_skip(step, desired))
        return desired

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
        needed, note = self.baselines.schedule.needed(values)
        base, now_measured = self.baselines.ramp_measure(self.reading)
        ramp = self.ramp.observe(step, healthy=healthy, measured=now_measured, base=base,
                                 scale=desired.lr_scale, ceiling=self.ceiling,
                                 needed=None if needed is None else needed * self.ceiling, needed_note=note)
        if ramp is None:
            return None
        new = desired.model_copy(update={"generation": desired.generation + 1, "reason": ramp.reason,
                                         "lr_scale": min(max(ramp.scale, LR_SCALE_MIN), LR_SCALE_MAX)})
        return RecoveryChange(new, "recovery:ramp")

    # ------------------------------------------------------------------ internals

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

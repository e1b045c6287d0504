"""The rungs of the recovery ladder (``service/incidents.py``'s module docstring): the ladder of
an incident's cause, its first rungs, the escalation to the next rung, the desired state each rung
asks for, and the follow-ups of the rungs that take steps to work: the data skip, the replay guard
of a rolled-back LR jump and the troubleshooting experiment. A mixin of
:class:`~service.incidents.RunRecovery` (its state: the open incident, the policy, the newest
report's reading, the healthy baselines and the window)."""

from __future__ import annotations

from typing import Any, Callable

from trainguard.protocol.commands import BY_NAME
from trainguard.protocol.wire import EXIT_HARDWARE_FAULT, LR_SCALE_MAX, DesiredState
from trainguard.service.engine import apply_actions
from trainguard.service.recovery import experiment as _experiment, replay as _replay
from trainguard.service.recovery.experiment import EXPERIMENT_LR_FACTOR
from trainguard.service.recovery.incident import RecoveryChange, finite_or_text, number, then
from trainguard.service.rules import AdaptiveLrAction, CheckpointAction, LrScaleAction, PauseAction, RollbackAction, StopAction

#: The reason a hardware incident's ``stop`` rung gives; the stop carries
#: ``EXIT_HARDWARE_FAULT`` (``Agent.exit_code``: a launcher restarts the job without the named node).
HARDWARE_STOP_REASON = "stopped for a restart without the suspect node"


class LadderRungs:
    """The ladder's rungs, taken on :class:`~service.incidents.RunRecovery`'s state."""

    open: Any
    policy: Any
    reading: Any
    window: Any
    ceiling: float
    snapshot_book: Any
    baselines: Any
    _last_step: int | None
    _scale_before_experiment: float
    degraded: Callable[[], bool]

    def ladder(self) -> tuple[str, ...]:
        """The rungs of the open incident's cause (the optimizer's: ``ladder``)."""
        return self.policy.ladder_of(self.open.cause if self.open is not None else "optimizer")

    # ------------------------------------------------------------------ rungs per cause

    def _working(self, experiment: dict[str, Any] | None) -> bool:
        """A rung in force that must not be judged yet: a data skip while the data is still out
        of bounds, an experiment that has not ended."""
        if experiment is not None and experiment.get("outcome") is None:
            return True
        if self.open is not None and self.open.replay is not None and self.open.replay.get("released") is None:
            return True  # the restored schedule has not passed the LR jump again
        return self.open is not None and self.open.cause == "data" and self.reading.data_active

    def _first_rungs(self, step: int, now: float, desired: DesiredState) -> list[RecoveryChange]:
        """The rungs the cause takes at once when the incident opens (or its cause is revised):
        a data incident whose data rules fire skips its batches; a hardware incident takes its
        whole ladder (checkpoint, then pause or stop)."""
        assert self.open is not None
        inc, out = self.open, []
        if inc.cause == "data" and self.reading.data_active and "data_skip" in self.ladder() and \
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
        exp["data_rules_firing"] = self.reading.data_active
        exp["sampling"] = _experiment.sampling_check(self.reading.data_checks, self.reading.values)
        amp = _experiment.amp_check(self.reading.values, exp.get("amp_skipped_at_start"))
        if amp is not None:
            exp["amp"] = amp
        tol = self.policy.float32_rel_tol
        exp["float32_recompute"] = float32 = _experiment.float32_check(exp.pop("float32_rel_diff", None), tol)
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
        exp["conclusion"] = _experiment.not_followed_conclusion(data_active=self.reading.data_active, amp=amp,
                                                                float32=float32, float32_rel_tol=tol)
        if self.reading.data_active:
            inc.cause = "data"
        elif amp_skips or numerics:
            inc.cause = "optimizer"
        inc.experiment = exp
        before = float(exp["lr_scale_before"])
        self.window.restart(step)
        if desired.lr_scale == before:
            return None
        return RecoveryChange(desired.model_copy(update={"generation": desired.generation + 1, "lr_scale": before,
                                                         "reason": f"{self._why_cause()}: {exp['conclusion']}"[:2000]}),
                              "recovery:ladder")

    def _follow_replay(self, step: int, values: dict[str, float], desired: DesiredState,
                       changes: list[RecoveryChange]) -> DesiredState:
        """The replay guard of a rolled-back LR jump: begun near the jump, released past it."""
        inc = self.open
        replay = inc.replay if inc is not None else None
        if inc is None or replay is None or not self.policy.enabled:
            return desired
        if _replay.guard_due(replay, step):
            desired = then(changes, desired, _replay.guard_replayed_jump(inc, step, desired, self._why_cause()))
        if _replay.release_due(replay, step):
            why = self._why_cause()
            self.window.restart(step)
            desired = then(changes, desired, _replay.release_replay(inc, step, values, desired, why,
                                                                     schedule=self.baselines.schedule, ceiling=self.ceiling))
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
            desired = then(changes, desired, self._conclude_experiment(step, healthy and not self.degraded(), desired))
        return experiment, desired

    # ------------------------------------------------------------------ the ladder

    def _rung(self, rung: str, step: int, now: float, actor: str, desired: DesiredState | None, reason: str = "",
              *, restart_window: bool = True) -> None:
        assert self.open is not None
        self.open.rungs.append({"rung": rung, "step": step, "time": now, "actor": actor,
                                "reason": desired.reason if desired is not None else reason,
                                "generation": desired.generation if desired is not None else None})
        if restart_window:
            self.window.restart(step)
        if rung == "data_skip" and desired is not None:
            self.open.data_skipped = [step + 1, desired.data_skip_until]
        if rung == "experiment" and desired is not None:
            self.open.experiment = {"lr_factor": EXPERIMENT_LR_FACTOR, "from_step": step,
                                    "until_step": step + self.policy.experiment_steps,
                                    "lr_scale_before": self._scale_before_experiment, "outcome": None,
                                    "amp_skipped_at_start": self.reading.values.get("trainguard_amp_skipped_steps_total")}
        if rung == "pause":
            self._close("escalated", step, now)

    def _close(self, outcome: str, step: int, now: float) -> None:
        assert self.open is not None
        self.open.outcome, self.open.closed_step, self.open.closed_time = outcome, step, now
        self.open = None
        self.window.healthy_in_a_row = 0

    def _escalate(self, step: int, now: float, desired: DesiredState) -> RecoveryChange | None:
        """Take the ladder's next rung after the highest one this incident took."""
        assert self.open is not None
        ladder = self.ladder()
        taken = [ladder.index(r["rung"]) for r in self.open.rungs if r["rung"] in ladder]
        exp = self.open.experiment
        jump = _replay.lr_jump_over(self.open, self.reading.values, self.reading.lr, self.baselines.lr_fault_peak)
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
                    new = _replay.guard_replay(self.open, step, self._last_step, jump, new)
                elif _replay.lr_jump_lasts(self.open, self.reading.lr, self.baselines.lr_fault_peak):
                    before = min(self.policy.rollback_lr_factor * self.ceiling, LR_SCALE_MAX)
                    new = _replay.before_replay(self.open, step, self._last_step, new, before)
            self._rung(rung, step, now, "recovery:ladder", new)
            if rung == "stop" and self.open is not None:
                self._close("escalated", step, now)
            if rung == "rollback" and new.rollback_seq > desired.rollback_seq:
                self.snapshot_book.drop_after(new.rollback_step)
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
            # the steps from the next one (a skip still running: from its first); a job resumed from
            # an earlier checkpoint trains on the steps before them
            first = d.data_skip_from if 0 < d.data_skip_from <= step < d.data_skip_until else step + 1
            return d.model_copy(update={"generation": d.generation + 1, "data_skip_from": first, "data_skip_until": until,
                                        "reason": f"{why}: skipping the batches of steps {first}-{until} on every rank, "
                                                  f"the LR untouched"[:2000]})
        spec = BY_NAME.get(rung)
        if spec is not None and spec.remedy:  # an optimizer remedy: its rule action with the defaults
            return apply_actions(d, (spec.rule_action(),), f"{why}: {rung.replace('_', ' ')}", self)
        if rung == "experiment":
            self._scale_before_experiment = d.lr_scale
            new = apply_actions(d, (LrScaleAction(factor=EXPERIMENT_LR_FACTOR),),
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

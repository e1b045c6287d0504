"""The cause of what a run's newest report shows (``service/cause.py`` judges it): decided before
the rules' actions are taken, so that an action that does not fit the cause is refused, and kept
while an incident is open unless hardware evidence revises it, or the skips that follow refute a
data verdict made on one batch standing out (:meth:`ReportCause._single_batch_refuted`). A mixin of
:class:`~service.incidents.RunRecovery` (its state: the open incident, the policy, the newest
report's reading and the healthy baselines)."""

from __future__ import annotations

import math
from typing import Any, Callable

from trainguard.service.cause import HARDWARE_DIAGNOSES as _HARDWARE, GRAD_CALM, GRAD_JUMP, GRAD_NORM, SINGLE_BATCH_SKIPS, Verdict, judge, refusal
from trainguard.service.rank_nodes import rank_places
from trainguard.service.recovery import replay as _replay
from trainguard.service.recovery.baselines import HealthyBaselines
from trainguard.service.recovery.health import alarming
from trainguard.service.recovery.incident import Incident, number
from trainguard.service.recovery.reading import ReportReading
from trainguard.service.rules import RecoveryPolicy


class ReportCause:
    """The cause of the newest report, decided on :class:`~service.incidents.RunRecovery`'s state."""

    open: Incident | None
    policy: RecoveryPolicy
    reading: ReportReading
    baselines: HealthyBaselines
    _verdict: Verdict | None
    _revised: bool
    ladder: Callable[[], tuple[str, ...]]

    def cause(self) -> str | None:
        """The cause the actions on the newest report must fit: the open incident's, else the
        verdict on the newest report (None: nothing alarming)."""
        if self.open is not None:
            return self.open.cause
        return self._verdict.cause if self._verdict is not None else None

    def refusal(self, action: Any) -> str | None:
        """Why a rule's ``action`` is not taken (it does not fit the cause, it changes the batch
        size while an incident is open, or it grows the batch while the loss oscillates
        periodically: a batch too large is that symptom's likely cause, so a smaller one is its
        remedy), or None."""
        if action.type == "accumulation" and self.open is not None:
            return f"accumulation refused: incident {self.open.id} is open"
        if action.type == "accumulation" and action.factor > 1 and self.reading.oscillating:
            return "accumulation refused: the loss oscillates periodically, and a batch too large is its likely cause"
        return refusal(self.cause(), action)

    def consider(self, findings: list[Any], window: Any, *, ranks: list[dict[str, Any]] | tuple[()] = ()) -> None:
        """Decide the cause of what the newest report shows, after the rules evaluated it and
        before their actions are taken (:meth:`refusal`). While an incident is open its cause
        stands, except that hardware evidence revises it."""
        self.reading.take_findings(findings, window)
        self._verdict = None
        if not self.policy.enabled:
            return
        if self.open is not None and self._single_batch_refuted(window):
            return
        if self.open is not None and (self.open.cause == "hardware"
                                      or not any(f.active and f.rule.diagnosis in _HARDWARE for f in findings)):
            return
        if self.open is None and not alarming(findings, self.policy, skipped=self.reading.skipped_now):
            return
        peak = window.latest("trainguard_scheduler_lr_peak")  # the agent's own record of the schedule's range
        if peak is None or not math.isfinite(peak) or peak <= 0:
            peak = self.baselines.lr_peak
        elif self.baselines.lr_fault_peak is not None:
            # The agent's record holds every LR the run took, the faulty ones too: after an LR fault
            # (replayed by a rollback that restores the user's scheduler) the range is the healthy one.
            peak = min(peak, self.baselines.lr_fault_peak)
        verdict = judge(findings, window, skipped=self.reading.skipped_now, lr_healthy=list(self.baselines.lr), lr_peak=peak,
                        metric=self.policy.metric, metric_baseline=self.baselines.baseline(),
                        hosts=rank_places(ranks))
        if self.open is None:
            self._verdict = verdict
            if verdict.cause == "optimizer" and peak is not None and any(
                    e["points_to"] == "optimizer" and e["signal"] in _replay.LR_SIGNALS for e in verdict.evidence):
                fault = self.baselines.lr_fault_peak
                self.baselines.lr_fault_peak = peak if fault is None else min(fault, peak)
        elif verdict.cause == "hardware":
            self._revise("hardware", window.last_step, verdict.summary, ranks=list(verdict.ranks),
                         hosts=list(verdict.hosts), evidence=list(self.open.verdict.get("evidence", [])) + list(
                             e for e in verdict.as_dict()["evidence"] if e["points_to"] == "hardware"))

    def _revise(self, cause: str, step: int, summary: str, **verdict: Any) -> None:
        """Revise the open incident's cause to ``cause`` (``verdict.revised``: from, step, summary;
        ``verdict``: the verdict's fields the new evidence replaces); its first rungs follow."""
        inc = self.open
        assert inc is not None
        inc.verdict = dict(inc.verdict, revised={"from": inc.cause, "step": step, "summary": summary}, **verdict)
        inc.cause = cause
        self._revised = True

    def _single_batch_refuted(self, window: Any) -> bool:
        """Revise a data incident judged on one batch standing out (its loss, or at most
        ``SINGLE_BATCH_SKIPS`` skipped steps, or its gradient norm's jump; no data rule among its
        evidence) to ``unknown`` once the agent has skipped more steps than that in a row, or a later
        report's gradient norm is still that jump's size and never came back to its level in
        between, with no data rule firing: no one batch is the cause (a schedule's LR past what the
        run can take makes every batch stand out, and skipping the batches cannot help). The
        unknown ladder's experiment finds out whether the LR is. A second jump after the norm came
        back is another batch (a rare harder source), not a norm that stays up. True when it revised."""
        inc = self.open
        if inc is None or inc.cause != "data" or self.reading.data_active:
            return False
        evidence = inc.verdict.get("evidence", [])
        if any(e["points_to"] == "data" and e["signal"].startswith("rule:") for e in evidence):
            return False
        if self.reading.skipped_now > SINGLE_BATCH_SKIPS:
            why = f"the agent skipped {self.reading.skipped_now} steps in a row"
        elif (jump := _gradient_jump_stays(evidence, window, inc.onset_step)) is not None:
            why = f"the gradient norm is still {jump:.3g}x its level before the onset"
        else:
            return False
        self._revise("unknown", window.last_step,
                     f"{why}, with no data rule firing: more than one batch stands out, so no single batch is the cause")
        return True

    def _report_ladder(self) -> tuple[str, ...]:
        """The ladder of the open incident, else of the newest report's verdict."""
        verdict, p = self._verdict, self.policy
        if self.open is not None:
            return self.ladder()
        return p.ladder_of(verdict.cause if verdict is not None else "optimizer")


def _gradient_jump_stays(evidence: list[dict[str, Any]], window: Any, onset_step: int) -> float | None:
    """The newest gradient norm over the level before the onset, when the verdict's gradient jump
    (``cause._gradient_jump``'s evidence) has not come back: still at least ``GRAD_JUMP`` times
    that level, and no report after the onset's and before the newest back within ``GRAD_CALM``
    times it (an explosion, not one batch, nor a second batch after the first came back); else None."""
    base = number(next((e["reference"] for e in evidence if e["signal"] == GRAD_NORM and e["points_to"] == "data"), None))
    latest = window.latest(GRAD_NORM)
    if base is None or not base > 0 or latest is None:
        return None
    ratio = latest / base if math.isfinite(latest) else math.inf
    if ratio < GRAD_JUMP:
        return None
    between = [v.get(GRAD_NORM, math.nan) for _, step, _, v in window.rows()[:-1] if step > onset_step]
    if any(x <= GRAD_CALM * base for x in between):
        return None  # it came back in between: the newest is another batch's jump
    return ratio

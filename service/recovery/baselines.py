"""A run's healthy levels (``service/incidents.py``'s module docstring): the medians over the last
``baseline_reports`` healthy reports taken outside incidents at the run's own ``lr_scale``, of the
policy's metric (the update ratio), of each metric a command's fold measures, of the LR the
user's schedule set, and the update per unit of LR with the schedule's envelope
(``service/adaptive_lr.ScheduleBaseline``); what the ramp and the incident judge the newest report
by, and the scale the adaptive LR computes from them."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from trainguard.protocol.catalog import RUN_CHANGE_MARKERS
from trainguard.protocol.commands import REGISTRY
from trainguard.service.adaptive_lr import ScheduleBaseline, baseline, corrected_scale
from trainguard.service.recovery.reading import ReportReading
from trainguard.service.rules import AdaptiveLrAction

#: The metrics whose healthy median a command's fold reads (``CommandSpec.measures``).
MEASURED = tuple(dict.fromkeys((*(m for c in REGISTRY for m in c.measures), "trainguard_loss")))


class HealthyBaselines:
    """The healthy levels of one run, each kept over the last ``reports`` healthy reports since the
    run last changed on purpose (:data:`RUN_CHANGE_MARKERS`: part of the model frozen or unfrozen, another
    optimizer, a change the user marked): SGD's update per unit of LR is a hundredth of Adam's,
    and judged by Adam's, every SGD report would read as a run training at a fraction of its LR."""

    def __init__(self, reports: int, tolerance: float) -> None:
        self._reports, self._tolerance = reports, tolerance
        #: The run-change markers of the last healthy report (:data:`RUN_CHANGE_MARKERS`, None where absent).
        self.regime: tuple[float | None, ...] | None = None
        self.metric: deque[float] = deque(maxlen=reports)
        """The policy's metric (the update ratio)."""
        #: The same for each metric a command's fold measures (``median``).
        self.measures: dict[str, deque[float]] = {m: deque(maxlen=reports) for m in MEASURED}
        self.lr: deque[float] = deque(maxlen=reports)
        """The LR the user's schedule set."""
        #: The update per unit of LR and the schedule's envelope, healthy (``service/adaptive_lr.py``).
        self.schedule = ScheduleBaseline(reports=reports, tolerance=tolerance)
        self.lr_peak: float | None = None
        """The highest scheduled LR of a healthy report (the schedule's range so far)."""
        self.lr_fault_peak: float | None = None
        """After a verdict of an LR beyond the schedule's range: that range (the schedule's highest
        LR before the fault), raised by the healthy reports since (None: no LR fault seen)."""

    def resize(self, reports: int, tolerance: float) -> None:
        """Keep the last ``reports`` of each level (a new policy), the newest ones kept."""
        self._reports, self._tolerance = reports, tolerance
        self.metric = deque(self.metric, maxlen=reports)
        self.measures = {m: deque(v, maxlen=reports) for m, v in self.measures.items()}
        kept = self.schedule
        self.schedule = ScheduleBaseline(reports=reports, tolerance=tolerance)
        self.schedule.per_lr.extend(kept.per_lr)
        self.schedule.update.extend(kept.update)
        self.schedule.envelope = kept.envelope
        self.lr = deque(self.lr, maxlen=reports)

    def save(self) -> dict[str, Any]:
        """Everything a report may change, for an undo (``RunRecovery.save``)."""
        return {
            "metric": list(self.metric),
            "measures": {m: list(v) for m, v in self.measures.items()},
            "lr": list(self.lr),
            "schedule": self.schedule.copy(),
            "lr_peak": self.lr_peak,
            "lr_fault_peak": self.lr_fault_peak,
            "regime": self.regime,
        }

    def restore(self, saved: dict[str, Any]) -> None:
        reports = self.metric.maxlen
        self.metric = deque(saved["metric"], maxlen=reports)
        self.measures = {m: deque(v, maxlen=reports) for m, v in saved["measures"].items()}
        self.lr = deque(saved["lr"], maxlen=self.lr.maxlen)
        self.schedule = saved["schedule"]
        self.lr_peak, self.lr_fault_peak = saved["lr_peak"], saved["lr_fault_peak"]
        self.regime = saved.get("regime")

    def add(self, values: dict[str, float], measured: float | None, lr: float | None) -> None:
        """A healthy report outside incidents at the ceiling: it joins the baselines, which start
        afresh where the run changed on purpose since the last one (:meth:`_changed`)."""
        if self._changed(values):
            self._clear()
        if measured is not None and math.isfinite(measured) and measured > 0:
            self.metric.append(measured)
        for name, kept in self.measures.items():
            v = values.get(name)
            if v is not None and math.isfinite(v) and v > 0:
                kept.append(float(v))
        self.schedule.add_healthy(values)
        if lr is not None:
            self.lr.append(lr)
            self.lr_peak = lr if self.lr_peak is None else max(self.lr_peak, lr)
        top = values.get("trainguard_scheduler_lr_max", lr)
        if self.lr_fault_peak is not None and top is not None and math.isfinite(top):
            self.lr_fault_peak = max(self.lr_fault_peak, float(top))

    def _changed(self, values: dict[str, float]) -> bool:
        """Whether a run-change marker this report and the last healthy one both carry differs."""
        regime = tuple(values.get(name) for name in RUN_CHANGE_MARKERS)
        before, self.regime = self.regime, regime
        return before is not None and any(a is not None and b is not None and a != b for a, b in zip(before, regime))

    def _clear(self) -> None:
        """Every level afresh, as for a new run."""
        self.metric.clear()
        for kept in self.measures.values():
            kept.clear()
        self.lr.clear()
        self.schedule = ScheduleBaseline(reports=self._reports, tolerance=self._tolerance)
        self.lr_peak = self.lr_fault_peak = None

    def baseline(self) -> float | None:
        """The healthy median of the policy's metric."""
        return baseline(self.metric)

    def median(self, metric: str) -> float | None:
        """The healthy median of a metric a command measures (None without one, or for another)."""
        kept = self.measures.get(metric)
        return None if kept is None else baseline(kept)

    def ramp_measure(self, reading: ReportReading) -> tuple[float | None, float | None]:
        """(baseline, measurement) the ramp and the incident judge the update by: per unit of LR
        when the agent reports it and it has a healthy baseline, else the policy's metric."""
        per_lr = reading.values.get(ScheduleBaseline.PER_LR)
        base = baseline(self.schedule.per_lr)
        if per_lr is not None and base is not None:
            return base, float(per_lr)
        return self.baseline(), reading.measured

    def degraded(self, reading: ReportReading, degrade_ratio: float, *, loss_below: bool = False) -> bool:
        """See :meth:`~service.incidents.RunRecovery.degraded`. ``loss_below``: whether the
        report's loss is clearly below its healthy median."""
        base, measured = self.ramp_measure(reading)
        if base is None or measured is None:
            return False
        if not math.isfinite(measured):
            return True
        if ScheduleBaseline.PER_LR not in reading.values:  # the policy's metric: above its baseline
            return measured > degrade_ratio * base
        if measured < base / (2 * degrade_ratio):
            # Far below per unit of LR: the fault's gradients inflated Adam's second moment, which
            # remembers them for ~1/(1 - beta2) steps, so the run trains at a fraction of its LR
            # (0.2x for 200 steps after 5 steps at x200) while its loss stays above where it was.
            # Not recovered: the ladder goes on (a rollback restores the optimizer state too).
            # With the loss clearly below its healthy level the run trains well at its update:
            # Adam's normalised step also falls on its own as training goes on (a baseline from the
            # first hundred steps read 4.5 per unit of LR, a healthy run 1.2 a hundred steps later).
            return not loss_below
        # High per unit of LR, but is the update itself large? While the LR in force is far below
        # the one the baseline was measured at (a rollback's guard, adaptive LR), Adam's normalised
        # step m/sqrt(v) grows towards 1 as the weights stop moving (successive gradients agree):
        # 2.5-5x its healthy value at lr_scale 5e-4, with an update 100x smaller than healthy.
        # That is the cut LR, not a hurt run; judged by it, such a run is paused after its guard.
        return measured > degrade_ratio * base and not self.schedule.small_update(reading.values)

    def adaptive_scale(self, action: AdaptiveLrAction, current: float, reading: ReportReading, *,
                       metric: str, ceiling: float) -> tuple[float | None, str]:
        """See :meth:`~service.incidents.RunRecovery.adaptive_scale` (``metric``: the policy's)."""
        if action.metric == metric:
            # In the schedule's terms when the agent reports them: the healthy update per unit of
            # LR, with the schedule's LR within its envelope (a constant: the schedule keeps its shape).
            needed, note = self.schedule.needed(reading.values)
            if needed is not None:
                return min(max(needed * ceiling, action.min), action.max, current), note
        base, measured = self.baseline(), reading.measured
        # The measurement was made at the scale the agent reported (several actions on one report
        # must not compound: each computes from that scale, and none raises the current one).
        at = reading.measured_scale if reading.measured_scale is not None else current
        new = corrected_scale(at, measured, base, lo=action.min, hi=action.max)
        if new is not None:
            return min(new, current), f"update ratio {measured:.3g} at lr_scale {at:.4g} vs healthy baseline {base:.3g}"
        # No usable update ratio (e.g. the step of the report was skipped): the LR the user's own
        # schedule set, against its healthy level, says how far the LR itself jumped.
        lr_base = baseline(self.lr)
        lr_new = corrected_scale(1.0, reading.lr, lr_base, lo=action.min, hi=action.max)
        if lr_new is not None and lr_new < 1.0:
            return min(lr_new, current), f"the schedule's LR {reading.lr:.3g} vs its healthy level {lr_base:.3g}"
        return None, "no healthy baseline of the update ratio yet" if base is None else "no finite update ratio"

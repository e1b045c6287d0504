"""Adaptive LR: set ``lr_scale`` from the measurement instead of halving, then ramp it back.

Pure functions and one small state machine; the controller's per-run recovery state
(:mod:`service.incidents`) feeds them the reports.

**Bring the update back to its baseline.** The rule action ``adaptive_lr`` divides the LR by how far
``metric`` (by default ``trainguard_update_ratio``, ||dW|| / ||W|| of the last step, which scales
with the LR that produced it) stands above its healthy baseline: the median of the last
``baseline_reports`` healthy reports before the onset. The value measured at the report was made
with the ``lr_scale`` in force then, so::

    new scale = current scale x baseline / measured        (clamped to [min, max])

A ×40 LR from the user's own schedule gives a ×40 update ratio and a scale of 1/40 at once; the
next report tells whether it was enough (if not, the action fires again and corrects again).

**In the schedule's terms** (:class:`ScheduleBaseline`, when the agent reports what the user's
scheduler asked for). An Adam-type optimizer moves the weights in proportion to the LR, so the
update ratio per unit of applied LR (``trainguard_update_ratio_per_lr``) is what neither the
schedule nor ``lr_scale`` moves; the schedule itself is judged against its *envelope*, the highest
LR it set while the run was healthy. The scale the run needs is then::

    needed = ceiling x min(1, baseline per-LR / measured per-LR) x min(1, envelope / scheduled LR)

(each factor 1 within its tolerance). It is one constant, so the schedule keeps its shape under
it: a schedule x1000 gets 1/1000 and its cosine stays a cosine. A warm restart goes back to the
envelope and needs nothing. Once the schedule is back inside its envelope and the update per unit
of LR is healthy again, ``needed`` is the ceiling, and the ramp goes there at once instead of
climbing for ``ramp_steps``.

**Ramp back once stable.** After ``stable_reports`` healthy reports in a row, the scale grows
geometrically towards its ceiling (1.0, or the scale an operator set), reaching it after ``ramp_steps`` steps (the factor per report follows
the steps the report covered). When the metric comes back above ``degrade_ratio`` x baseline the
ramp steps back to the last scale that was healthy and holds there: a persistent cause (the user's
schedule stays ×1000) ends at a scale that trains, a transient one (a burst of bad data) ends back
at the ceiling.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Iterable, Mapping

from trainguard.protocol.wire import LR_SCALE_MAX, LR_SCALE_MIN

__all__ = ["baseline", "corrected_scale", "LrRamp", "RampStep", "ScheduleBaseline", "SCHEDULE_TOLERANCE"]


def baseline(values: Iterable[float]) -> float | None:
    """Median of the finite, positive values; None when there are none."""
    xs = [v for v in values if math.isfinite(v) and v > 0]
    return median(xs) if xs else None


def corrected_scale(current_scale: float, measured: float | None, base: float | None, *,
                    lo: float = LR_SCALE_MIN, hi: float = LR_SCALE_MAX) -> float | None:
    """The scale that brings ``measured`` back to ``base``: ``current x base / measured``,
    clamped to [lo, hi]; None when it cannot be computed (no baseline, a non-finite or zero
    measurement). Never raises the scale: a measurement at or below the baseline keeps it."""
    if base is None or measured is None or not math.isfinite(measured) or measured <= 0:
        return None
    if measured <= base:
        return min(max(current_scale, lo), hi)
    return min(max(current_scale * base / measured, lo), hi)


#: The scheduled LR may exceed its envelope by this factor (rounding, a schedule that ends a hair
#: above its start) before it counts as above it.
SCHEDULE_TOLERANCE = 1.05


def _positive(values: Mapping[str, float], key: str) -> float | None:
    v = values.get(key)
    return float(v) if v is not None and math.isfinite(v) and v > 0 else None


class ScheduleBaseline:
    """The healthy update per unit of LR of one run and its schedule's healthy envelope, from the
    reports it is fed (see the module docstring)."""

    PER_LR = "trainguard_update_ratio_per_lr"
    UPDATE = "trainguard_update_ratio"

    def __init__(self, *, reports: int = 16, tolerance: float = 1.5) -> None:
        if reports < 1 or not tolerance >= 1:
            raise ValueError("reports must be >= 1 and tolerance >= 1")
        self.tolerance = tolerance
        """The per-LR update may be this factor above its baseline before it counts (report noise)."""
        self.per_lr: deque[float] = deque(maxlen=reports)
        self.update: deque[float] = deque(maxlen=reports)
        """The healthy update ratios themselves (``UPDATE``), beside their per-LR values."""
        self.envelope: float | None = None
        """The highest LR the schedule set in a healthy report (None: none seen yet)."""

    def copy(self) -> "ScheduleBaseline":
        new = ScheduleBaseline.__new__(ScheduleBaseline)
        new.tolerance, new.per_lr, new.envelope = self.tolerance, deque(self.per_lr, maxlen=self.per_lr.maxlen), self.envelope
        new.update = deque(self.update, maxlen=self.update.maxlen)
        return new

    def small_update(self, values: Mapping[str, float]) -> bool:
        """The report's update ratio is within ``tolerance`` x its healthy median: a high update
        per unit of LR then comes from an LR already cut far below the schedule (Adam's normalised
        step m/sqrt(v) grows towards 1 as the weights stop moving and successive gradients agree),
        not from a step too large."""
        base, update = baseline(self.update), _positive(values, self.UPDATE)
        return base is not None and update is not None and update <= self.tolerance * base

    def add_healthy(self, values: Mapping[str, float]) -> None:
        """A healthy report at the run's own scale, outside incidents: it joins the baselines."""
        per_lr = _positive(values, self.PER_LR)
        if per_lr is not None:
            self.per_lr.append(per_lr)
        update = _positive(values, self.UPDATE)
        if update is not None:
            self.update.append(update)
        top = _positive(values, "trainguard_scheduler_lr_max") or _positive(values, "trainguard_scheduler_lr")
        if top is not None:
            self.envelope = top if self.envelope is None else max(self.envelope, top)

    def needed(self, values: Mapping[str, float]) -> tuple[float | None, str]:
        """The factor of the ceiling the run needs now (at most 1), and how it was computed; None
        when the report says nothing in these terms (no per-LR update with a baseline, and no
        scheduled LR with a known envelope). The scheduled LR is that of the report's last step: a
        jump that already ended within the interval needs no cut (its damage is the ladder's)."""
        factor, notes = 1.0, []
        known = False
        base, per_lr = baseline(self.per_lr), _positive(values, self.PER_LR)
        if base is not None and per_lr is not None:
            known = True
            if per_lr > self.tolerance * base and not self.small_update(values):
                factor *= base / per_lr
                notes.append(f"update per unit of LR {per_lr:.3g} vs its healthy {base:.3g}")
        lr = _positive(values, "trainguard_scheduler_lr")
        envelope = self.envelope if self.envelope is not None else _positive(values, "trainguard_scheduler_lr_peak")
        if lr is not None and envelope is not None:
            known = True  # (a schedule back inside its envelope is no reason to cut the LR now)
            if lr > SCHEDULE_TOLERANCE * envelope:
                factor *= envelope / lr
                notes.append(f"the schedule's LR {lr:.3g} is {lr / envelope:.3g}x the highest it set while "
                             f"healthy ({envelope:.3g})")
        if not known:
            return None, "no update per unit of LR with a healthy baseline yet"
        if not notes:
            return 1.0, (f"the schedule's LR within its envelope and the update per unit of LR "
                         f"{per_lr:.3g} at its healthy {base:.3g}" if per_lr is not None and base is not None else
                         "the schedule's LR within its envelope")
        return min(max(factor, LR_SCALE_MIN), 1.0), "; ".join(notes)


@dataclass(frozen=True, slots=True)
class RampStep:
    """A change the ramp asks for: the new scale and why."""

    scale: float
    reason: str


class LrRamp:
    """The ramp of ``lr_scale`` back towards 1.0 (one per run).

    :meth:`observe` takes each report's (step, healthy, metric value, baseline, current scale,
    ceiling) and returns the :class:`RampStep` to apply, if any. The ramp's target follows the
    steps since it started: ``start x (ceiling / start) ** (steps / ramp_steps)``, reaching the
    ceiling after ``ramp_steps``; a change is asked for when the target is ``min_increase`` above
    the current scale (or the ceiling),
    so a slow ramp does not make a new desired state on every report. :meth:`reset` is called
    whenever the scale is set by something else (a rule, an operator, a rung)."""

    def __init__(self, *, ramp_steps: int = 400, stable_reports: int = 3, degrade_ratio: float = 1.5,
                 min_increase: float = 0.1) -> None:
        if ramp_steps < 1 or stable_reports < 1 or not degrade_ratio > 1 or not min_increase > 0:
            raise ValueError("ramp_steps and stable_reports must be >= 1, degrade_ratio > 1 and min_increase > 0")
        self.ramp_steps, self.stable_reports, self.degrade_ratio = ramp_steps, stable_reports, degrade_ratio
        self.min_increase = min_increase
        self.reset()

    def copy(self) -> "LrRamp":
        """A shallow copy (an undo record: taken on every report, so cheaper than ``copy.copy``)."""
        new = LrRamp.__new__(LrRamp)
        new.__dict__.update(self.__dict__)
        return new

    def reset(self) -> None:
        self.healthy_in_a_row = 0
        self.start_scale: float | None = None
        self.start_step = 0
        self.last_good_scale: float | None = None
        self.held = False

    def observe(self, step: int, *, healthy: bool, measured: float | None, base: float | None,
                scale: float, ceiling: float = 1.0, needed: float | None = None,
                needed_note: str = "") -> RampStep | None:
        """``needed`` (with ``needed_note``): the scale the run needs now in the schedule's terms
        (:meth:`ScheduleBaseline.needed` x the ceiling), when known. Then a healthy report goes
        straight to it (the incident that cut the scale already saw ``recover_reports`` healthy
        reports; the cause is measured gone) instead of climbing geometrically."""
        degraded = measured is not None and (not math.isfinite(measured) or (
            base is not None and measured > self.degrade_ratio * base))
        if not healthy or degraded:
            self.healthy_in_a_row = 0
            if self.start_scale is not None and not self.held and self.last_good_scale is not None \
                    and self.last_good_scale < scale:
                # the last increase went too far: back to the last scale that trained, and stay there
                self.held = True
                return RampStep(self.last_good_scale, f"lr_scale ramp stopped: {_why(measured, base, healthy)}; "
                                                      f"back to {self.last_good_scale:.4g}, held")
            return None
        self.healthy_in_a_row += 1
        if scale >= ceiling or self.held:
            return None
        self.last_good_scale = scale
        if needed is not None:
            target = min(ceiling, needed)
            if not target > scale * (1.0 + self.min_increase) and target < ceiling:
                return None
            if target <= scale:
                return None
            return RampStep(target, f"lr_scale back to the schedule ({needed_note}): {scale:.4g} -> {target:.4g}")
        if self.healthy_in_a_row < self.stable_reports:
            return None
        if self.start_scale is None:
            self.start_scale, self.start_step = scale, step
        target = min(ceiling, self.start_scale * (ceiling / self.start_scale) ** ((step - self.start_step) / self.ramp_steps))
        if target < ceiling and target < scale * (1.0 + self.min_increase):
            return None
        return RampStep(target, f"lr_scale ramp towards {ceiling:g} ({self.healthy_in_a_row} healthy reports): "
                                f"{scale:.4g} -> {target:.4g}")


def _why(measured: float | None, base: float | None, healthy: bool) -> str:
    if not healthy:
        return "a rule fired"
    if measured is None or not math.isfinite(measured):
        return "the update ratio is not finite"
    return f"the update ratio {measured:.3g} is above {base:.3g} (its healthy baseline) x the tolerance"

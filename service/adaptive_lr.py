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

**Ramp back once stable.** After ``stable_reports`` healthy reports in a row, the scale grows
geometrically towards its ceiling (1.0, or the scale an operator set), reaching it after ``ramp_steps`` steps (the factor per report follows
the steps the report covered). When the metric comes back above ``degrade_ratio`` x baseline the
ramp steps back to the last scale that was healthy and holds there: a persistent cause (the user's
schedule stays ×1000) ends at a scale that trains, a transient one (a burst of bad data) ends back
at the ceiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import Iterable

from trainguard.protocol.wire import LR_SCALE_MAX, LR_SCALE_MIN

__all__ = ["baseline", "corrected_scale", "LrRamp", "RampStep"]


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
                scale: float, ceiling: float = 1.0) -> RampStep | None:
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

"""Evaluation of the ``rate`` and ``oscillation`` rule kinds (pure functions of a
:class:`~service.window.RuleWindow`): ``rate`` (a counter's increase per step over a window of reports, e.g. the share of steps the
mixed-precision loss scaler skipped) and ``oscillation`` (a periodic swing of a metric: the
stability guide's symptom table, row 2)."""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from trainguard.service.numerics import all_finite, mean_of, power_spectrum
from trainguard.service.rules import OscillationRule, RateRule
from trainguard.service.window import RuleWindow

__all__ = ["rate", "oscillation", "periodogram_peak", "centred_steps"]


def rate(rule: RateRule, w: RuleWindow, now: float, finding: Any) -> Any:
    if w.latest(rule.metric) is None or w.latest(rule.per) is None:
        return finding(rule, None)
    counts = w.series(rule.metric, rule.window + 1)
    steps = w.series(rule.per, rule.window + 1)
    n = min(len(counts), len(steps))
    if n < 2:
        return finding(rule, None)
    counts, steps = _measured_span(rule, counts[-n:], steps[-n:])
    if len(steps) < 2:
        return finding(rule, None)
    d_steps = float(steps[-1] - steps[0])
    d_count = float(counts[-1] - counts[0])
    if not (d_steps > 0 and math.isfinite(d_count)):
        return finding(rule, None)
    value = d_count / d_steps
    if not value > rule.value:
        return finding(rule, False)
    return finding(
        rule, True,
        f"{rule.metric} rose by {d_count:g} over {d_steps:g} {rule.per} ({value:.3g} per step; limit {rule.value:g})",
        {"metric": rule.metric, "per": rule.per, "rate": value, "limit": rule.value, "increase": d_count,
         "steps": d_steps, "reports": n},
    )


def _measured_span(rule: RateRule, counts: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reports ``rate`` measures over: from the newest one back to the newest that lies at
    least ``rule.min_steps`` back (empty when none does), after those in which the counter still
    equals ``per`` (``rule.leave_out_startup``: a loss scaler's search for its scale)."""
    if rule.leave_out_startup:
        started = steps > counts  # a step not counted: once true, true from then on (one count a step at most)
        first = int(started.argmax()) if started.any() else len(steps)
        counts, steps = counts[first:], steps[first:]
    if rule.min_steps and len(steps):
        back = np.flatnonzero(steps[-1] - steps >= rule.min_steps)
        first = int(back[-1]) if len(back) else len(steps)
        counts, steps = counts[first:], steps[first:]
    return counts, steps


@functools.lru_cache(maxsize=64)
def centred_steps(n: int) -> tuple[np.ndarray, float]:
    """Report indices 0..n-1 minus their mean, and their sum of squares (least-squares slope)."""
    t = np.arange(n, dtype=np.float64) - (n - 1) / 2.0
    t.flags.writeable = False
    return t, float(np.dot(t, t))


def _detrended(values: np.ndarray, mean: float | None = None) -> np.ndarray:
    """``values`` minus their least-squares line over 0..n-1 (closed form: what
    ``np.polyfit(t, values, 1)`` fits, without its SVD, which cost most of a report's rules);
    ``mean``: the values' mean, when the caller has it."""
    n = len(values)
    t, tt = centred_steps(n)  # centred: the slope does not depend on the mean
    slope = float(np.dot(t, values)) / tt if n > 1 else 0.0
    return values - (mean_of(values) if mean is None else mean) - slope * t


def periodogram_peak(values: np.ndarray, detrended: np.ndarray | None = None) -> tuple[float, float, float]:
    """(share of the detrended variance in the strongest frequency and its two neighbours,
    period in reports, lag-``period`` autocorrelation) of ``values`` after removing the
    least-squares line (``detrended``, when the caller has it already)."""
    n = len(values)
    x = _detrended(values) if detrended is None else detrended
    if not np.maximum.reduce(np.abs(x)) > 1e-12 * max(float(np.maximum.reduce(np.abs(values))), 1e-300):
        return 0.0, math.inf, 0.0  # nothing around the line but rounding
    power = power_spectrum(x)
    power[0] = 0.0
    total = float(np.add.reduce(power))
    if total <= 0:
        return 0.0, math.inf, 0.0
    k = int(power.argmax())
    share = float(np.add.reduce(power[max(k - 1, 1):k + 2])) / total
    period = n / k
    lag = int(round(period))
    acf = float(np.dot(x[:-lag], x[lag:]) / np.dot(x, x)) if 0 < lag < n else 0.0
    return share, period, acf


def oscillation(rule: OscillationRule, w: RuleWindow, now: float, finding: Any) -> Any:
    if w.latest(rule.metric) is None:
        return finding(rule, None)
    vals = w.series(rule.metric, rule.window)
    if len(vals) < rule.window or not all_finite(vals):
        return finding(rule, None)
    mean = mean_of(vals)
    resid = _detrended(vals, mean)
    mean = abs(mean)
    amplitude = math.sqrt(2.0 * float(np.dot(resid, resid)) / len(resid))  # sqrt(2) x the residuals' std
    rel_amplitude = amplitude / mean if mean > 0 else math.inf
    if rel_amplitude < rule.min_rel_amplitude:
        return finding(rule, False)  # too small to matter: no spectrum needed (the usual case)
    share, period, acf = periodogram_peak(vals, resid)
    periodic = (share >= rule.min_power and rule.min_period <= period <= len(vals) / 2
                and acf >= rule.min_autocorrelation)  # a swing recurs a period later; a one-off bump does not
    if not periodic:
        return finding(rule, False)
    values = {"metric": rule.metric, "amplitude": amplitude, "rel_amplitude": rel_amplitude, "window": len(vals),
              "power_share": share, "period_reports": period, "autocorrelation": acf}
    return finding(
        rule, True,
        f"{rule.metric} oscillates with a period of {period:.3g} reports ({share:.0%} of its variance around the "
        f"trend; amplitude {rel_amplitude:.2%} of its mean)",
        values,
    )

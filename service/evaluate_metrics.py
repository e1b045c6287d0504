"""Evaluation of the rule kinds that read one metric's recent values (pure functions of a
:class:`~service.window.RuleWindow`): ``threshold``, ``spike`` (against a rolling median or EMA),
``nonfinite`` (also over per-rank vectors) and ``trend``."""

from __future__ import annotations

import math
import operator
from typing import Any, Callable

import numpy as np

from trainguard.protocol.catalog import RUN_CHANGE_MARKERS
from trainguard.service import rate_and_oscillation
from trainguard.service.finding import Finding, Verdict, json_number
from trainguard.service.numerics import all_finite, finite_range, mean_of, median
from trainguard.service.rule_kinds import NonFiniteRule, SpikeRule, ThresholdRule, TrendRule
from trainguard.service.window import RuleWindow

__all__ = ["nonfinite", "spike", "threshold", "trend"]

_OPS: dict[str, Callable[[Any, Any], Any]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
}


def threshold(rule: ThresholdRule, w: RuleWindow, now: float) -> Verdict:
    latest = w.latest(rule.metric)
    if latest is None:
        return None
    cmp = _OPS[rule.op]
    if rule.for_reports == 1 and not rule.settle_steps and not cmp(latest, rule.value):
        return False  # the common case, without building the series
    vals = w.series(rule.metric, rule.for_reports)
    if len(vals) < rule.for_reports:
        return False
    limit = rule.value
    if rule.settle_steps and _settling(rule, w):
        if rule.settle_value is None:
            return False
        limit = rule.settle_value
    if not all(cmp(v, limit) for v in vals.tolist()):
        return False
    if rule.crossing_window and not _crossed(rule, w, vals):
        return False
    last = float(vals[-1])
    return Finding(
        rule, True,
        f"{rule.metric} = {last:.6g} {rule.op} {limit:g}" + (f" for {rule.for_reports} reports" if rule.for_reports > 1 else "")
        + (f" (the limit over the first {rule.settle_steps} steps of a fresh optimizer state)" if limit != rule.value else ""),
        {"metric": rule.metric, "value": json_number(last), "threshold": limit, "op": rule.op, "values": [json_number(v) for v in vals.tolist()]},
    )


#: Gradient norms: a 0 there is no measurement of the run's scale. The agent reports
#: ``trainguard_grad_norm_max`` 0 for a report interval without a finite norm that is shorter than
#: ``report_every`` (the report at step 1, whose step the GradScaler skipped: the interval's unused
#: rows are 0), and a gradient of exactly 0 everywhere says nothing of its scale either.
_NORMS = frozenset({"trainguard_grad_norm_max", "trainguard_grad_norm"})


def _crossed(rule: ThresholdRule, w: RuleWindow, vals: np.ndarray) -> bool:
    """Whether a finite value within the limit precedes the newest ``for_reports`` (``vals``) in the
    rule's crossing window (the metric crossed the limit in this run); for a gradient norm, a
    positive one (:data:`_NORMS`). With ``crossing_rise``, also whether each of ``vals`` rose that
    many times beyond the metric's level before the crossing (the median of the window's values up
    to its last one within the limit): a metric whose level is near the limit crosses it with its noise."""
    before = w.series(rule.metric, rule.crossing_window + rule.for_reports)[:-rule.for_reports]
    cmp = _OPS[rule.op]
    floor = 0.0 if rule.metric in _NORMS else -math.inf
    measured = np.isfinite(before) & (before > floor)
    within = np.flatnonzero(measured & ~cmp(before, rule.value))
    if not len(within):
        return False
    if rule.crossing_rise == 1.0:
        return True
    level = median(before[:within[-1] + 1][measured[:within[-1] + 1]])
    if rule.op in (">", ">="):
        return bool((vals >= rule.crossing_rise * level).all())
    return bool((vals * rule.crossing_rise <= level).all())


#: The markers of a change after which the optimizer's state starts afresh: another optimizer, or
#: parameters that start to train (``ThresholdRule.settle_steps``), for reports without the state's age.
_FRESH_STATE_MARKERS = ("trainguard_optimizer_class", "trainguard_trainable_elements")

#: The age of the optimizer's state the agent reports (its youngest per-parameter step count).
_STATE_AGE = "trainguard_optimizer_state_steps"


def _settling(rule: ThresholdRule, w: RuleWindow) -> bool:
    """Whether the oldest of the newest ``for_reports`` reports ended within ``rule.settle_steps``
    optimizer steps of its optimizer state's start. When the newest ``for_reports`` reports carry
    the state's age (:data:`_STATE_AGE`), that age: a state that started afresh while the run's
    step went on (a job resumed without its optimizer's state, a reset) settles, and a restored
    one is judged at once. Without it (older agents, optimizers without a step count), the run's
    first step or the last report before its optimizer or its trained parameters changed (a
    marker of :data:`_FRESH_STATE_MARKERS` whose reports line up with the steps'); False for
    reports without ``trainguard_step``."""
    ages = w.series(_STATE_AGE, rule.for_reports)
    if w.latest(_STATE_AGE) is not None and len(ages) == rule.for_reports:
        return float(ages[0]) <= rule.settle_steps
    steps = w.series("trainguard_step", w.size)
    if len(steps) < rule.for_reports:
        return False
    start = 0.0
    for name in _FRESH_STATE_MARKERS:
        values = w.series(name, len(steps))
        if len(values) == len(steps):
            other = np.flatnonzero(values != values[-1])
            if len(other):
                start = max(start, float(steps[other[-1]]))
    return float(steps[-rule.for_reports]) - start <= rule.settle_steps


#: 1 / Phi^-1(3/4): turns a median absolute deviation into a normal standard deviation.
_MAD_TO_SIGMA = 1.482602218505602


def _ema(x: np.ndarray, alpha: float) -> tuple[float, float]:
    mean, var = float(x[0]), 0.0
    for v in x[1:].tolist():
        d = v - mean
        incr = alpha * d
        mean += incr
        var = (1 - alpha) * (var + d * incr)
    return mean, math.sqrt(var)


#: The scheduled LR may exceed the envelope it had before the window by this factor and still be
#: a planned rise (service/adaptive_lr.SCHEDULE_TOLERANCE).
_SCHEDULE_TOLERANCE = 1.05


def _schedule_rise(rule: SpikeRule, w: RuleWindow) -> float:
    """How far the scheduled LR rose over the rule's window (newest / median of the reports before
    it; >= 1), for ``schedule_discount``. 1 when it did not rise or is not reported, and when it
    is above the schedule's envelope as it stood before the window (the agent's
    ``trainguard_scheduler_lr_peak`` in the window's oldest report): a jump beyond every LR the
    run had trained at is not a plan, and one inside the window cannot raise that envelope."""
    lr = w.latest("trainguard_scheduler_lr")
    peaks = w.series("trainguard_scheduler_lr_peak", rule.window + 1)
    if lr is None or not lr > 0 or not len(peaks) or not lr <= _SCHEDULE_TOLERANCE * float(peaks[0]):
        return 1.0
    before = w.series("trainguard_scheduler_lr", rule.window + 1)[:-1]
    before = before[np.isfinite(before) & (before > 0)]
    if not len(before):
        return 1.0
    return max(lr / median(before), 1.0)


def _since_run_change(w: RuleWindow, hist: np.ndarray) -> np.ndarray:
    """``hist`` (the reports before the newest) cut to those since the run last changed what it
    trains or the optimizer it trains with, or marked a change (a value of ``RUN_CHANGE_MARKERS``
    changed, ``trainguard/protocol/catalog.py``): before it
    the metric was another model's or another optimizer's (a linear probe's head alone has a
    gradient norm tens of times smaller than the whole model's; Adam's update per unit of LR is a
    hundred times SGD's). A marker whose reports do not line up with ``hist`` (reports without
    it: older agents) is left out."""
    start = 0
    for name in RUN_CHANGE_MARKERS:
        values = w.series(name, len(hist) + 1)
        if len(values) == len(hist) + 1:
            other = np.flatnonzero(values != values[-1])
            if len(other):
                start = max(start, int(other[-1]) + 1)
    return hist[start:]


def _visits(hist: np.ndarray, base: float, level: float) -> int:
    """How many separate times ``hist`` rose to ``level`` (above ``base``) and came back to ``base``
    or below afterwards (``SpikeRule.recurring``). A rise still in progress at the window's end, or
    one the window began in, counts only once it came back."""
    visits, high = 0, False
    for v in hist.tolist():
        if not high and v >= level:
            high = True
        elif high and v <= base:
            high, visits = False, visits + 1
    return visits


#: Values of the window the trend line of ``SpikeRule.trend_with`` is fitted to at most (its pairs: O(n^2)).
_TREND_POINTS = 64

#: The largest logarithm of a trend level (``math.exp`` overflows above ~709): beyond it, no trend judgement.
_LOG_MAX = 700.0


def _trend_level(hist: np.ndarray) -> float | None:
    """Where a robust line through ``log(hist)`` puts the next value (Theil-Sen: the median of the
    pairwise slopes, the median intercept), for ``SpikeRule.trend_with``; None unless the line
    rises and every value is positive."""
    y = hist[-_TREND_POINTS:]
    if len(y) < 3 or not bool((y > 0).all()):
        return None
    y = np.log(y)
    i, j = np.triu_indices(len(y), 1)
    slope = float(np.median((y[j] - y[i]) / (j - i)))
    level = float(np.median(y - slope * np.arange(len(y)))) + slope * len(y)
    if not slope > 0 or level > _LOG_MAX:
        return None
    return math.exp(level)


#: A value more than this multiple of the largest of the 3 before it is a jump, not part of a climb
#: (the agent's spike guard draws the same line: ``SpikeGuardConfig.min_jump``).
_CLIMB_JUMP = 2.0


def _climbs(values: np.ndarray) -> bool:
    """Whether no value of ``values`` is more than :data:`_CLIMB_JUMP` times the largest of the 3
    before it: a rise made report by report, not a level that jumped once."""
    xs = values.tolist()
    return all(x <= _CLIMB_JUMP * max(xs[max(0, i - 3):i]) for i, x in enumerate(xs) if i)


def _not_risen(w: RuleWindow, rule: SpikeRule, hist: np.ndarray) -> bool:
    """Whether ``rule.trend_with``'s value in the newest report is finite and at or below its
    median over the reports of ``hist`` (the window) before it; False when the newest report
    lacks it or it is NaN or infinite (a loss that blew up has risen)."""
    latest = w.latest(str(rule.trend_with))
    if latest is None or not math.isfinite(latest):
        return False
    before = w.series(str(rule.trend_with), len(hist) + 1)[:-1]
    before = before[np.isfinite(before)]
    return len(before) >= 1 and latest <= median(before)


def _ratio_judged(rule: SpikeRule, w: RuleWindow, hist: np.ndarray, latest: float,
                  base: float) -> tuple[float, dict[str, Any], str] | None:
    """A ratio rule's score of ``latest`` against ``base`` (> 0, as ``latest``): (the schedule's LR
    rise it was divided by, the finding's values, its summary) when it reaches ``rule.ratio``, else
    None (below it, or on the window's own rising trend: ``SpikeRule.trend_with``)."""
    up, down = latest / base, base / latest
    score = up if rule.direction == "up" else down if rule.direction == "down" else max(up, down)
    rise = _schedule_rise(rule, w) if rule.schedule_discount and score >= rule.ratio else 1.0
    if not score / rise >= rule.ratio:
        return None
    extra: dict[str, Any] = {"ratio": score, "limit": rule.ratio}
    level = _trend_level(hist) if rule.trend_with is not None and rule.baseline == "median" and rule.direction == "up" else None
    if level is not None and level > base and _climbs(np.append(hist, latest)) and _not_risen(w, rule, hist):
        if not latest / level / rise >= rule.ratio:
            return None  # on the window's own rising trend, the loss not rising: the run's
        extra["trend_level"] = level
    return rise, extra, f"{rule.metric} = {latest:.6g} is {score:.3g}x its rolling {rule.baseline} {base:.6g} (limit {rule.ratio:g}x)"


def spike(rule: SpikeRule, w: RuleWindow, now: float) -> Verdict:
    latest = w.latest(rule.metric)
    if latest is None or not math.isfinite(latest):
        return None if latest is None else False
    hist = w.series(rule.metric, rule.window + 1)[:-1]
    if (rule.mode == "ratio" and rule.baseline == "median" and rule.direction == "up" and latest > 0
            and len(hist) >= rule.min_history):
        # Quick "no": every value finite and the value below ratio x the window's minimum (so its median).
        bounds = finite_range(hist)
        if bounds is not None and 0 < bounds[0] and latest < rule.ratio * bounds[0]:
            return False
    hist = _since_run_change(w, hist)
    hist = hist if all_finite(hist) else hist[np.isfinite(hist)]
    if len(hist) < rule.min_history:
        return None
    if rule.baseline == "median":
        base = median(hist)
        if rule.mode == "zscore" and (latest <= base if rule.direction == "up" else latest >= base if rule.direction == "down" else False):
            return False  # on the quiet side of the median: no z-score in that direction reaches z > 0
        scale = _MAD_TO_SIGMA * median(np.abs(hist - base)) if rule.mode == "zscore" else math.nan  # (z-scores only)
    else:
        base, scale = _ema(hist, 2.0 / (rule.window + 1))
    if rule.mode == "ratio":
        if base <= 0 or latest <= 0:
            return None
        judged = _ratio_judged(rule, w, hist, latest, base)
        if judged is None:
            return False
        rise, extra, summary = judged
    else:
        scale = max(scale, 1e-12 * max(abs(base), 1.0))
        z = (latest - base) / scale
        score = z if rule.direction == "up" else -z if rule.direction == "down" else abs(z)
        rise = _schedule_rise(rule, w) if rule.schedule_discount and score >= rule.z else 1.0
        if not score / rise >= rule.z:
            return False
        extra = {"zscore": z, "scale": scale, "limit": rule.z}
        summary = f"{rule.metric} = {latest:.6g} is {z:+.3g} sigma from its rolling {rule.baseline} {base:.6g} (limit {rule.z:g})"
    if rule.recurring and _visits(hist, base, base + 0.5 * (latest - base)) >= rule.recurring:
        return False
    if rise > 1.0:
        extra["schedule_lr_rise"] = rise
        summary += f", after the schedule's LR rose {rise:.3g}x (score divided by it)"
    values = {"metric": rule.metric, "value": latest, "baseline": base, "baseline_kind": rule.baseline, "history": len(hist), **extra}
    return Finding(rule, True, summary, values)


def nonfinite(rule: NonFiniteRule, w: RuleWindow, now: float) -> Verdict:
    seen = False
    bad: dict[str, Any] = {}
    if rule.metric is not None:
        v = w.latest(rule.metric)
        if v is not None:
            seen = True
            if not math.isfinite(v):
                bad[rule.metric] = json_number(v)
    for vec in rule.vectors:
        hist = w.rank_history(vec, 1)
        if len(hist):
            seen = True
            if all_finite(hist[-1]):
                continue  # the usual case
            ranks = np.flatnonzero(~np.isfinite(hist[-1]))  # (not empty: all_finite said some rank is not finite)
            bad[f"ranks.{vec}"] = {int(r): json_number(float(hist[-1][r])) for r in ranks[:16].tolist()}
    if not seen:
        return None
    if not bad or (rule.scaler_halvings and _scaler_backoff(rule, w)):
        return False
    return Finding(rule, True, "non-finite " + ", ".join(bad), {"nonfinite": bad})


#: The loss scaler's counter of the steps it skipped, and its scale after the report's last step.
_AMP_SKIPS, _LOSS_SCALE = "trainguard_amp_skipped_steps_total", "trainguard_loss_scale"


def _scaler_backoff(rule: NonFiniteRule, w: RuleWindow) -> bool:
    """Whether the newest report's steps include some the loss scaler skipped and its scale is
    within ``rule.scaler_halvings`` halvings of its median over the newest ``rule.scaler_window``
    reports that came after its first step taken (a step not skipped: ``trainguard_step`` above
    the skips' count), or no step was taken yet (the scaler's search for its scale). The median,
    not the highest: a scaler that went on without an overflow for two growth intervals doubled
    its scale twice, and backs off twice."""
    n = rule.scaler_window + 1
    scale, skips, steps = w.series(_LOSS_SCALE, n), w.series(_AMP_SKIPS, n), w.series("trainguard_step", n)
    if w.latest(_LOSS_SCALE) is None or w.latest(_AMP_SKIPS) is None or not len(steps):
        return False
    k = min(len(scale), len(skips), len(steps))
    scale, skips, steps = scale[-k:], skips[-k:], steps[-k:]
    if not skips[-1] > (skips[-2] if k > 1 else 0.0):
        return False  # the scaler skipped none of the newest report's steps: the weights moved
    taken = steps[:-1] > skips[:-1]
    if not steps[-1] > skips[-1] or not taken.any():
        return True  # no step taken yet, or the first one in this report: the scaler's search
    return bool(scale[-1] * 2.0 ** rule.scaler_halvings >= median(scale[:-1][taken]))


def _short_of_run(rule: TrendRule, w: RuleWindow) -> bool:
    """Whether the newest ``rule.window`` reports cover less than ``rule.min_run_fraction`` of the
    run's optimizer steps (``trainguard_step``; False when a report of them lacks it)."""
    steps = w.series("trainguard_step", rule.window)
    if len(steps) < rule.window:
        return False
    return float(steps[0]) > (1.0 - rule.min_run_fraction) * float(steps[-1])


def trend(rule: TrendRule, w: RuleWindow, now: float) -> Verdict:
    if w.latest(rule.metric) is None:
        return None
    vals = w.series(rule.metric, rule.window)
    if len(vals) < rule.window or not all_finite(vals):
        return None
    n = len(vals)
    if rule.direction == "not_decreasing":
        if rule.min_run_fraction and _short_of_run(rule, w):
            return False
        tc, tt = rate_and_oscillation.centred_steps(n)
        mean = mean_of(vals)
        slope = float(np.dot(tc, vals - mean) / tt)
        fitted_drop = -slope * (n - 1)
        need = rule.min_rel_change * abs(float(mean))
        if not fitted_drop <= need:
            return False
        return Finding(
            rule, True,
            (f"{rule.metric} fell by {fitted_drop:.6g}" if fitted_drop >= 0 else f"{rule.metric} rose by {-fitted_drop:.6g}")
            + f" over {n} reports (least squares; needs to fall by > {need:.6g})",
            {"metric": rule.metric, "slope_per_report": slope, "fitted_drop": fitted_drop, "required_drop": need, "window": n, "first": float(vals[0]), "last": float(vals[-1])},
        )
    first, last = float(vals[0]), float(vals[-1])
    growth = last - first
    if not (growth > 0 and growth >= rule.min_rel_change * abs(first)):
        return False
    monotonic = bool((vals[1:] >= vals[:-1]).all())
    if not monotonic:
        return False
    return Finding(
        rule, True,
        f"{rule.metric} grew monotonically from {first:.6g} to {last:.6g} over {n} reports",
        {"metric": rule.metric, "first": first, "last": last, "growth": growth, "monotonic": monotonic, "window": n},
    )

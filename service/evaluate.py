"""Rule evaluation: each rule kind as a pure function of a :class:`~service.window.RuleWindow`
(and, for absence rules, the time) giving a verdict, which :func:`evaluate` turns into a
:class:`Finding` per rule. No I/O."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from trainguard.service.rules import (
    AbsenceRule, CrossRankRule, DesyncRule, NonFiniteRule, OscillationRule, RateRule, SpikeRule, ThresholdRule,
    TrendRule,
)
from trainguard.service import rate_and_oscillation
from trainguard.service.numerics import all_finite, finite_range, mean_of, median
from trainguard.service.window import RuleWindow

__all__ = ["Finding", "evaluate"]

_OPS: dict[str, Callable[[Any, Any], Any]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
}

@dataclass(frozen=True, slots=True)
class Finding:
    """A rule's verdict on a window: ``active`` True (condition holds), False (it does not), or
    None (no data to judge: the firing state stays as it is)."""

    rule: Any
    active: bool | None
    summary: str = ""
    values: dict[str, Any] = field(default_factory=dict)


#: What an evaluation function returns: a firing :class:`Finding`, or ``False`` (the condition does
#: not hold) or ``None`` (no data to judge). :func:`evaluate` turns the last two into the rule's
#: shared findings (see :class:`_Plan`).
Verdict = Any


def _finding(rule: Any, active: bool | None, summary: str = "", values: dict[str, Any] | None = None) -> Verdict:
    """A verdict as the rate and oscillation rule kinds build it: a Finding only when it fires."""
    if active is not True:
        return active
    return Finding(rule, True, summary, values if values is not None else {})


def _num(x: float) -> float | str:
    """A float for JSON-friendly alert values (NaN/Inf as the wire's strings)."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float(x)


def _threshold(rule: ThresholdRule, w: RuleWindow, now: float) -> Verdict:
    latest = w.latest(rule.metric)
    if latest is None:
        return None
    if rule.for_reports == 1 and not _OPS[rule.op](latest, rule.value):
        return False  # the common case, without building the series
    vals = w.series(rule.metric, rule.for_reports)
    if len(vals) < rule.for_reports:
        return False
    cmp = _OPS[rule.op]
    if not all(cmp(v, rule.value) for v in vals.tolist()):
        return False
    last = float(vals[-1])
    return Finding(
        rule, True,
        f"{rule.metric} = {last:.6g} {rule.op} {rule.value:g}" + (f" for {rule.for_reports} reports" if rule.for_reports > 1 else ""),
        {"metric": rule.metric, "value": _num(last), "threshold": rule.value, "op": rule.op, "values": [_num(v) for v in vals.tolist()]},
    )


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


def _spike(rule: SpikeRule, w: RuleWindow, now: float) -> Verdict:
    latest = w.latest(rule.metric)
    if latest is None or not math.isfinite(latest):
        return None if latest is None else False
    hist = w.series(rule.metric, rule.window + 1)[:-1]
    if (rule.mode == "ratio" and rule.baseline == "median" and rule.direction == "up" and latest > 0
            and len(hist) >= rule.min_history):
        # Quick "no": every value finite and the value below ratio x the window's minimum, hence
        # below ratio x its median.
        bounds = finite_range(hist)
        if bounds is not None and 0 < bounds[0] and latest < rule.ratio * bounds[0]:
            return False
    if not all_finite(hist):
        hist = hist[np.isfinite(hist)]
    if len(hist) < rule.min_history:
        return None
    if rule.baseline == "median":
        base = median(hist)
        if rule.mode == "zscore" and (latest <= base if rule.direction == "up" else latest >= base if rule.direction == "down" else False):
            return False  # on the quiet side of the median: no z-score in that direction reaches z > 0
        # The MAD is only needed for z-scores (an alert's values never show it in ratio mode).
        scale = _MAD_TO_SIGMA * median(np.abs(hist - base)) if rule.mode == "zscore" else math.nan
    else:
        base, scale = _ema(hist, 2.0 / (rule.window + 1))
    if rule.mode == "ratio":
        if base <= 0 or latest <= 0:
            return None
        up, down = latest / base, base / latest
        score = up if rule.direction == "up" else down if rule.direction == "down" else max(up, down)
        rise = _schedule_rise(rule, w) if rule.schedule_discount and score >= rule.ratio else 1.0
        if not score / rise >= rule.ratio:
            return False
        extra: dict[str, Any] = {"ratio": score, "limit": rule.ratio}
        summary = f"{rule.metric} = {latest:.6g} is {score:.3g}x its rolling {rule.baseline} {base:.6g} (limit {rule.ratio:g}x)"
    else:
        scale = max(scale, 1e-12 * max(abs(base), 1.0))
        z = (latest - base) / scale
        score = z if rule.direction == "up" else -z if rule.direction == "down" else abs(z)
        rise = _schedule_rise(rule, w) if rule.schedule_discount and score >= rule.z else 1.0
        if not score / rise >= rule.z:
            return False
        extra = {"zscore": z, "scale": scale, "limit": rule.z}
        summary = f"{rule.metric} = {latest:.6g} is {z:+.3g} sigma from its rolling {rule.baseline} {base:.6g} (limit {rule.z:g})"
    if rise > 1.0:
        extra["schedule_lr_rise"] = rise
        summary += f", after the schedule's LR rose {rise:.3g}x (score divided by it)"
    values = {"metric": rule.metric, "value": latest, "baseline": base, "baseline_kind": rule.baseline, "history": len(hist), **extra}
    return Finding(rule, True, summary, values)


def _nonfinite(rule: NonFiniteRule, w: RuleWindow, now: float) -> Verdict:
    seen = False
    bad: dict[str, Any] = {}
    if rule.metric is not None:
        v = w.latest(rule.metric)
        if v is not None:
            seen = True
            if not math.isfinite(v):
                bad[rule.metric] = _num(v)
    for vec in rule.vectors:
        hist = w.rank_history(vec, 1)
        if len(hist):
            seen = True
            if all_finite(hist[-1]):
                continue  # the usual case
            ranks = np.flatnonzero(~np.isfinite(hist[-1]))  # (not empty: all_finite said some rank is not finite)
            bad[f"ranks.{vec}"] = {int(r): _num(float(hist[-1][r])) for r in ranks[:16].tolist()}
    if not seen:
        return None
    if not bad:
        return False
    return Finding(rule, True, "non-finite " + ", ".join(bad), {"nonfinite": bad})


def _trend(rule: TrendRule, w: RuleWindow, now: float) -> Verdict:
    if w.latest(rule.metric) is None:
        return None
    vals = w.series(rule.metric, rule.window)
    if len(vals) < rule.window or not all_finite(vals):
        return None
    n = len(vals)
    if rule.direction == "not_decreasing":
        tc, tt = rate_and_oscillation.centred_steps(n)
        mean = mean_of(vals)
        slope = float(np.dot(tc, vals - mean) / tt)
        fitted_drop = -slope * (n - 1)
        need = rule.min_rel_change * abs(float(mean))
        if not fitted_drop <= need:
            return False
        return Finding(
            rule, True,
            f"{rule.metric} fell by {fitted_drop:.6g} over {n} reports (least squares; needs > {need:.6g})",
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


def _spread(rule: CrossRankRule, row: np.ndarray) -> tuple[bool | None, dict[str, Any]]:
    finite = np.isfinite(row)
    if finite.sum() < 2:
        return None, {}
    vals = np.where(finite, row, -np.inf)
    med = median(row[finite])
    top = int(np.argmax(vals))
    if med <= 0:
        if not (rule.min_value > 0 and row[top] > 0):
            return None, {}
        ratio = math.inf
    else:
        ratio = float(row[top]) / med
    hit = ratio >= rule.ratio and float(row[top]) >= rule.min_value
    return hit, {"max": float(row[top]), "median": med, "ratio": ratio, "limit": rule.ratio, "rank": top}


def _above(rule: CrossRankRule, row: np.ndarray) -> tuple[bool | None, dict[str, Any]]:
    finite = np.isfinite(row)
    if not finite.any():
        return None, {}
    assert rule.value is not None
    with np.errstate(invalid="ignore"):
        ranks = np.flatnonzero(finite & (row >= rule.value))
    return bool(len(ranks)), {
        "limit": rule.value, "ranks": ranks[:16].tolist(), "count": int(len(ranks)),
        "values": {int(r): _num(float(row[r])) for r in ranks[:16].tolist()},
    }


def _mismatch(rule: CrossRankRule, row: np.ndarray) -> tuple[bool | None, dict[str, Any]]:
    finite = np.isfinite(row)
    if not finite.any() or len(row) < 2:
        return None, {}
    ref = median(row[finite])
    tol = rule.rel_tol * max(abs(ref), 1e-30)
    with np.errstate(invalid="ignore"):
        off = ~finite | (np.abs(row - ref) > tol)
    ranks = np.flatnonzero(off)
    return bool(len(ranks)), {
        "reference": ref, "rel_tol": rule.rel_tol, "ranks": ranks[:16].tolist(), "differing": int(len(ranks)),
        "values": {int(r): _num(float(row[r])) for r in ranks[:16].tolist()},
    }


_CHECKS = {"spread": _spread, "mismatch": _mismatch, "above": _above}


def _row_verdicts(rule: CrossRankRule, hist: np.ndarray) -> list[bool | None]:
    """Each row's verdict, as :func:`_spread` / :func:`_mismatch` give it; all rows at once when
    every value is finite (the usual case), row by row otherwise."""
    k, n = hist.shape
    if n >= 2 and np.isfinite(hist).all() and rule.check != "above":
        if rule.check == "mismatch" and hist.min() == hist.max():
            return [False] * k  # every rank agrees exactly (data-parallel fingerprints): nothing differs
        s = np.sort(hist, axis=1)
        med = s[:, n // 2] if n % 2 else 0.5 * (s[:, n // 2 - 1] + s[:, n // 2])
        if rule.check == "spread":
            if rule.min_value > 0 and not (med > 0).all():
                return [_spread(rule, row)[0] for row in hist]
            judged = med > 0
            hit = (s[:, -1] / np.where(judged, med, 1.0) >= rule.ratio) & (s[:, -1] >= rule.min_value)
            return [bool(h) if j else None for h, j in zip(hit.tolist(), judged.tolist())]
        tol = rule.rel_tol * np.maximum(np.abs(med), 1e-30)
        return (np.abs(hist - med[:, None]) > tol[:, None]).any(axis=1).tolist()
    check = _CHECKS[rule.check]
    return [check(rule, row)[0] for row in hist]


def _slowest(hist: np.ndarray) -> np.ndarray:
    """The rank with the largest finite value in each row (what ``_spread`` names)."""
    return np.argmax(np.where(np.isfinite(hist), hist, -np.inf), axis=1)


def _cross_rank(rule: CrossRankRule, w: RuleWindow, now: float) -> Verdict:
    hist = w.rank_history(rule.vector, rule.for_reports)
    if not len(hist):
        return None
    if rule.check == "spread" and hist.shape[1] >= 2:
        # Quick "no" on the newest row (the finding needs every row): every value finite and
        # positive, and the max below ratio x the min (hence below ratio x the median) or below
        # min_value.
        bounds = finite_range(hist[-1])
        if bounds is not None and 0 < bounds[0] and (bounds[1] < rule.ratio * bounds[0] or bounds[1] < rule.min_value):
            return False
    verdicts = _row_verdicts(rule, hist)
    if verdicts[-1] is None:
        return None
    if not (len(hist) >= rule.for_reports and all(v is True for v in verdicts)):
        return False
    if rule.check == "spread" and len(hist) > 1 and len(set(_slowest(hist).tolist())) > 1:
        return False  # a different rank on top each time is noise, not a straggler
    values = {"vector": rule.vector, "check": rule.check, **_CHECKS[rule.check](rule, hist[-1])[1]}
    if rule.check == "spread":
        summary = f"rank {values['rank']} {rule.vector} = {values['max']:.6g} is {values['ratio']:.3g}x the median {values['median']:.6g} (limit {rule.ratio:g}x)"
    elif rule.check == "above":
        summary = f"rank(s) {values['ranks'][:8]} have {rule.vector} >= {rule.value:g} ({values['count']} in all)"
    else:
        summary = f"{values['differing']} rank(s) disagree on {rule.vector} (first: {values['ranks'][:8]}; rel. tolerance {rule.rel_tol:g})"
    return Finding(rule, True, summary, values)


def _desync(rule: DesyncRule, w: RuleWindow, now: float) -> Verdict:
    hist = w.rank_history(rule.vector, 1)
    if not len(hist):
        return None
    row = hist[-1]
    judged = ~np.isnan(row)
    if not judged.any():
        return None
    with np.errstate(invalid="ignore"):
        ranks = np.flatnonzero(judged & (row > rule.rel_tol))
    if not len(ranks):
        return False
    kind = rule.vector.removesuffix("_desync")
    layers = [{"layer": d.layer, "rel_diff": _num(d.rel_diff), "ranks": list(d.ranks)}
              for d in getattr(w, "desync", ()) if d.kind == kind]
    what = "gradients" if kind == "grad" else "parameters"
    where = f" in layer(s) {', '.join(repr(x['layer']) for x in layers[:4])}" if layers else ""
    worst = float(np.max(row[ranks]))
    return Finding(
        rule, True,
        f"rank(s) {ranks[:8].tolist()} disagree with the other ranks on their {what}{where}: "
        f"relative difference {worst:.3g} (tolerance {rule.rel_tol:g})",
        {"vector": rule.vector, "rel_tol": rule.rel_tol, "ranks": ranks[:16].tolist(),
         "values": {int(r): _num(float(row[r])) for r in ranks[:16].tolist()}, "layers": layers[:16]},
    )


def _absence(rule: AbsenceRule, w: RuleWindow, now: float, live_since: float = -math.inf) -> Verdict:
    since = max(w.last_received, live_since)
    silent = now - since
    if not silent >= rule.seconds:
        return False
    return Finding(
        rule, True, f"no report for {silent:.0f} s (limit {rule.seconds:g} s)",
        {"silent_s": silent, "limit_s": rule.seconds, "last_report_at": w.last_received, "silent_since": since},
    )


_EVAL: dict[type, Callable[[Any, RuleWindow, float], Verdict]] = {
    ThresholdRule: _threshold, SpikeRule: _spike, NonFiniteRule: _nonfinite,
    TrendRule: _trend, CrossRankRule: _cross_rank, DesyncRule: _desync, AbsenceRule: _absence,
    RateRule: lambda r, w, now: rate_and_oscillation.rate(r, w, now, _finding),
    OscillationRule: lambda r, w, now: rate_and_oscillation.oscillation(r, w, now, _finding),
}


@dataclass(frozen=True, slots=True)
class _Plan:
    """A rule set made ready to evaluate: per rule, its function, its "no" and "no data" findings
    (built once and shared: a report's evaluation gives mostly these, and a frozen dataclass
    costs ~1 us to build; their empty values are never read, only a fired finding's are
    recorded) and, for a rule that reads only one per-rank vector, that vector (no data while
    the run has never sent it, without a call)."""

    rules: tuple[Any, ...]  # (held: the plans are keyed by the identity of this tuple)
    steps: tuple[tuple[Callable[[Any, RuleWindow, float], Verdict], Any, Finding, Finding, str | None], ...]

    @classmethod
    def of(cls, rules: tuple[Any, ...]) -> "_Plan":
        return cls(rules, tuple(
            (_EVAL[type(r)], r, Finding(r, False), Finding(r, None), getattr(r, "vector", None)) for r in rules
        ))


#: Plans by the identity of their rules tuple (a rules reload makes a new tuple; the controller
#: keeps one per job). Emptied when full.
_PLANS: dict[int, _Plan] = {}
_PLANS_MAX = 256


def _plan(rules: tuple[Any, ...]) -> _Plan:
    plan = _PLANS.get(id(rules))  # (a plan holds its tuple alive: no other object can have that id meanwhile)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[id(rules)] = _Plan.of(rules)
    return plan


def evaluate(rules: tuple[Any, ...], window: RuleWindow, now: float, *, live_since: float | None = None) -> list[Finding]:
    """Every rule's finding on ``window`` at time ``now``, in the order of ``rules``. Pure: no I/O,
    no mutation.

    ``live_since``: when the run last became live (registered, re-registered, unpaused); absence
    rules count silence from the later of it and the last report. The controller's ticker passes
    it; a report's own evaluation need not (its arrival is the newest sign of life)."""
    seen = window.vectors_seen
    out: list[Finding] = []
    append = out.append
    for fn, rule, no, unknown, vector in _plan(rules).steps:
        if vector is not None and vector not in seen:
            append(unknown)
            continue
        v = fn(rule, window, now) if live_since is None or fn is not _absence else _absence(rule, window, now, live_since)
        append(no if v is False else unknown if v is None else v)
    return out

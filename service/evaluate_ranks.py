"""Evaluation of the rule kinds that compare the ranks of a report (pure functions of a
:class:`~service.window.RuleWindow`): ``cross_rank`` (spread, mismatch, above) and ``desync``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainguard.service.finding import Finding, Verdict, json_number
from trainguard.service.numerics import finite_range, median
from trainguard.service.rule_kinds import CrossRankRule, DesyncRule
from trainguard.service.window import RuleWindow

__all__ = ["cross_rank", "desync"]


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
        "values": {int(r): json_number(float(row[r])) for r in ranks[:16].tolist()},
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
        "values": {int(r): json_number(float(row[r])) for r in ranks[:16].tolist()},
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


def cross_rank(rule: CrossRankRule, w: RuleWindow, now: float) -> Verdict:
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


def desync(rule: DesyncRule, w: RuleWindow, now: float) -> Verdict:
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
    layers = [{"layer": d.layer, "rel_diff": json_number(d.rel_diff), "ranks": list(d.ranks)}
              for d in getattr(w, "desync", ()) if d.kind == kind]
    what = "gradients" if kind == "grad" else "parameters"
    where = f" in layer(s) {', '.join(repr(x['layer']) for x in layers[:4])}" if layers else ""
    worst = float(np.max(row[ranks]))
    return Finding(
        rule, True,
        f"rank(s) {ranks[:8].tolist()} disagree with the other ranks on their {what}{where}: "
        f"relative difference {worst:.3g} (tolerance {rule.rel_tol:g})",
        {"vector": rule.vector, "rel_tol": rule.rel_tol, "ranks": ranks[:16].tolist(),
         "differing": int(len(ranks)), "judged": int(np.count_nonzero(judged)),
         "values": {int(r): json_number(float(row[r])) for r in ranks[:16].tolist()}, "layers": layers[:16]},
    )

"""Evaluation of the rule kinds that compare the ranks of a report (pure functions of a
:class:`~service.window.RuleWindow`): ``cross_rank`` (spread, mismatch, above) and ``desync``.
``spread`` names the ranks slower than the median of their others in each of its reports
(``service/slow_ranks.py``): one rank, or a group slow together."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from trainguard.service.finding import Finding, Verdict, json_number
from trainguard.service.numerics import finite_range, median
from trainguard.service.rank_nodes import listed
from trainguard.service.rule_kinds import CrossRankRule, DesyncRule
from trainguard.service.slow_ranks import slow_ranks
from trainguard.service.window import RuleWindow

__all__ = ["cross_rank", "desync"]


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


_CHECKS = {"mismatch": _mismatch, "above": _above}


def _row_verdicts(rule: CrossRankRule, hist: np.ndarray) -> list[bool | None]:
    """Each row's verdict, as :func:`_mismatch` / :func:`_above` give it; all rows at once when
    every value is finite (the usual case), row by row otherwise."""
    k, n = hist.shape
    if n >= 2 and np.isfinite(hist).all() and rule.check == "mismatch":
        if hist.min() == hist.max():
            return [False] * k  # every rank agrees exactly (data-parallel fingerprints): nothing differs
        s = np.sort(hist, axis=1)
        med = s[:, n // 2] if n % 2 else 0.5 * (s[:, n // 2 - 1] + s[:, n // 2])
        tol = rule.rel_tol * np.maximum(np.abs(med), 1e-30)
        return (np.abs(hist - med[:, None]) > tol[:, None]).any(axis=1).tolist()
    check = _CHECKS[rule.check]
    return [check(rule, row)[0] for row in hist]


def _group_text(rule: CrossRankRule, named: np.ndarray, row: np.ndarray, refs: np.ndarray, judged: int) -> str:
    """The summary of several ranks slow together (each against the median of its others: ``refs``)."""
    vals = row[named]
    with np.errstate(divide="ignore"):
        least = float(np.min(vals / refs))  # (a reference of 0 under a min_value: an infinite ratio)
    return (f"{len(named)} of {judged} ranks ({listed(named.tolist())}) are slow together: {rule.vector} {float(vals.min()):.6g} to "
            f"{float(vals.max()):.6g}, each at least {least:.3g}x the median of its other ranks (at most "
            f"{float(np.max(refs)):.6g}; limit {rule.ratio:g}x); ranks slow together "
            "point to what they share (a slower node type, or one node's device, network or storage), not to one rank")


def _spread(rule: CrossRankRule, hist: np.ndarray) -> Verdict:
    """The ranks slower than the median of their others in each of the rows (``service/slow_ranks.py``)."""
    found = slow_ranks(hist, rule.ratio, rule.min_value)
    if not found.judged[-1]:
        return None
    named = np.flatnonzero(found.slow.all(axis=0)) if len(hist) >= rule.for_reports else np.empty(0, np.int64)
    if not len(named):
        return False  # none, or a different rank each time: scheduling noise, not a straggler
    row = hist[-1]
    refs = found.references(len(hist) - 1, row[named])
    at = int(np.argmax(row[named]))
    top, ref = int(named[at]), float(refs[at])
    ratio = float(row[top]) / ref if ref > 0 else math.inf
    judged = int(np.count_nonzero(np.isfinite(row)))
    values = {"vector": rule.vector, "check": rule.check, "max": float(row[top]), "median": ref,
              "ratio": ratio, "limit": rule.ratio, "rank": top, "ranks": named[:16].tolist(), "count": int(len(named)),
              "judged": judged, "values": {int(r): json_number(float(row[r])) for r in named[:16].tolist()}}
    if len(named) == 1:
        summary = (f"rank {top} {rule.vector} = {values['max']:.6g} is {ratio:.3g}x the median of the other ranks "
                   f"{values['median']:.6g} (limit {rule.ratio:g}x)")
    else:
        summary = _group_text(rule, named, row, refs, judged)
    return Finding(rule, True, summary, values)


def cross_rank(rule: CrossRankRule, w: RuleWindow, now: float) -> Verdict:
    hist = w.rank_history(rule.vector, rule.for_reports)
    if not len(hist):
        return None
    if rule.check == "spread":
        if hist.shape[1] >= 2:
            # Quick "no" on the newest row (the finding needs every row): every value finite and
            # positive, and the max below ratio x the min (hence below ratio x any rank's median
            # of the others) or below min_value.
            bounds = finite_range(hist[-1])
            if bounds is not None and 0 < bounds[0] and (bounds[1] < rule.ratio * bounds[0] or bounds[1] < rule.min_value):
                return False
        return _spread(rule, hist)
    verdicts = _row_verdicts(rule, hist)
    if verdicts[-1] is None:
        return None
    if not (len(hist) >= rule.for_reports and all(v is True for v in verdicts)):
        return False
    values = {"vector": rule.vector, "check": rule.check, **_CHECKS[rule.check](rule, hist[-1])[1]}
    if rule.check == "above":
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

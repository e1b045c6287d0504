"""Evaluation of the rule kinds that compare the ranks of a report (pure functions of a
:class:`~service.window.RuleWindow`): ``cross_rank`` (spread, mismatch, above) and ``desync``.
``spread`` names the ranks slower than the median of their others in more than half of the
reports of its span of steps (``service/slow_ranks.py``): one rank, or a group slow together."""

from __future__ import annotations

import bisect
import itertools
import threading
from typing import Any

import numpy as np

from trainguard.service.finding import Finding, Verdict, json_number
from trainguard.service.numerics import finite_range, median
from trainguard.service.rank_nodes import listed
from trainguard.service.rule_kinds import CrossRankRule, DesyncRule
from trainguard.service.slow_ranks import SlowRanks, median_ratios, named_over, slow_ranks
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


def _group_text(rule: CrossRankRule, named: np.ndarray, ratios: np.ndarray, judged: int, over: str) -> str:
    """The summary of several ranks slow together (``ratios``: each one's median ratio to the
    median of its other ranks)."""
    return (f"{len(named)} of {judged} ranks ({listed(named.tolist())}) are slow together: {rule.vector} of each is "
            f"{float(np.min(ratios)):.3g}x to {float(np.max(ratios)):.3g}x the median of its other ranks {over}, its median "
            f"ratio (limit {rule.ratio:g}x); ranks slow together "
            "point to what they share (a slower node type, or one node's device, network or storage), not to one rank")


def _judged_reports(rule: CrossRankRule, w: RuleWindow) -> tuple[list[float], list[int]]:
    """The steps and row ids of the per-rank rows a ``spread`` rule judges: the newest report back
    to the newest one at least ``for_steps`` steps before it, ``for_reports`` at least (none: empty)."""
    steps, ids = w.rank_history_index(rule.vector, max(rule.for_reports, rule.for_steps + 1))
    first = len(ids) - rule.for_reports
    if rule.for_steps and ids:  # (a run's steps only grow: a job that went back starts a new window)
        first = min(first, bisect.bisect_right(steps, steps[-1] - rule.for_steps) - 1)
    if first < 0:
        return [], []
    return steps[first:], ids[first:]


#: Each judged row's verdict, (judged, the slow ranks), by row id and the rule's (vector, ratio,
#: min_value) (:data:`_KINDS`): a report's row is judged once, not once in each report whose span
#: holds it. At most :data:`_ROWS_MAX` (the oldest half goes when full: about 25 MB at most).
_ROWS: dict[int, tuple[bool, np.ndarray]] = {}
_ROWS_MAX = 1 << 17
_SLOW_KEPT = 64  # the most slow ranks of a row whose verdict is kept
_KINDS: dict[tuple[str, float, float], int] = {}
_KINDS_MAX = 256
_ROWS_LOCK = threading.Lock()  # (simulations evaluate in worker threads)
_NONE = np.zeros(0, np.int64)


def _row_verdict(rule: CrossRankRule, row: np.ndarray) -> tuple[bool, np.ndarray]:
    # Quick "no": every value finite and positive, and the max below ratio x the min (hence below
    # ratio x any rank's median of the others) or below min_value.
    bounds = finite_range(row)
    if bounds is not None and 0 < bounds[0] and (bounds[1] < rule.ratio * bounds[0] or bounds[1] < rule.min_value):
        return True, _NONE
    found = slow_ranks(row[None], rule.ratio, rule.min_value)
    return bool(found.judged[0]), np.flatnonzero(found.slow[0])


def _spread_rows(rule: CrossRankRule, w: RuleWindow, ids: list[int]) -> list[tuple[bool, np.ndarray]]:
    """The verdict of each row ``ids``, those not judged before read and judged now."""
    kind = _KINDS.get((rule.vector, rule.ratio, rule.min_value))
    if kind is None:
        with _ROWS_LOCK:
            if len(_KINDS) >= _KINDS_MAX:
                _KINDS.clear()
                _ROWS.clear()
            kind = _KINDS.setdefault((rule.vector, rule.ratio, rule.min_value), len(_KINDS))
    keys = [i * _KINDS_MAX + kind for i in ids]
    got = [_ROWS.get(k) for k in keys]
    missing = [j for j, g in enumerate(got) if g is None]
    if missing:
        for j, row in zip(missing, w.rank_values_of(rule.vector, [ids[j] for j in missing])):
            got[j] = _row_verdict(rule, row)
        kept = [j for j in missing if len(got[j][1]) <= _SLOW_KEPT]  # (a large group: judged again each time)
        with _ROWS_LOCK:
            if len(_ROWS) + len(kept) > _ROWS_MAX:
                for k in list(itertools.islice(_ROWS, len(_ROWS) // 2)):
                    del _ROWS[k]
            _ROWS.update((keys[j], got[j]) for j in kept)
    return got  # type: ignore[return-value]


def _spread(rule: CrossRankRule, w: RuleWindow) -> Verdict:
    """The ranks slower than the median of their others in more than half of the reports judged
    (``service/slow_ranks.py``)."""
    steps, ids = _judged_reports(rule, w)
    if not ids:
        return None if not len(w.rank_history(rule.vector, 1)) else False
    verdicts = _spread_rows(rule, w, ids)
    if not verdicts[-1][0]:
        return None
    slow = [ranks for _, ranks in verdicts if len(ranks)]
    if 2 * len(slow) <= len(ids):
        return False  # none, a burst of a few steps, or a different rank each time: not a straggler
    counts = np.bincount(np.concatenate(slow))
    if not (2 * counts > len(ids)).any():
        return False
    hist = w.rank_values_of(rule.vector, ids)
    found = slow_ranks(hist, rule.ratio, rule.min_value)
    return _spread_finding(rule, hist, found, named_over(found), steps)


def _spread_finding(rule: CrossRankRule, hist: np.ndarray, found: SlowRanks, named: np.ndarray, steps: list[float]) -> Finding:
    ratios = median_ratios(found, hist, named)
    at = int(np.argmax(ratios))
    top, ratio = int(named[at]), float(ratios[at])
    row = hist[-1]
    ref = float(found.references(len(hist) - 1, row[top:top + 1])[0])
    judged = int(np.count_nonzero(np.isfinite(row)))
    span = float(steps[-1] - steps[0])
    values = {"vector": rule.vector, "check": rule.check, "max": float(row[top]), "median": ref,
              "ratio": ratio, "limit": rule.ratio, "rank": top, "ranks": named[:16].tolist(), "count": int(len(named)),
              "judged": judged, "values": {int(r): json_number(float(row[r])) for r in named[:16].tolist()},
              "reports": int(len(hist)), "steps": json_number(span)}
    over = f"over {len(hist)} reports ({span:g} steps)"
    if len(named) == 1:
        summary = (f"rank {top} {rule.vector} is {ratio:.3g}x the median of the other ranks {over}, its median ratio "
                   f"(in the newest report {values['max']:.6g} against {ref:.6g}) (limit {rule.ratio:g}x)")
    else:
        summary = _group_text(rule, named, ratios, judged, over)
    return Finding(rule, True, summary, values)


def cross_rank(rule: CrossRankRule, w: RuleWindow, now: float) -> Verdict:
    if rule.check == "spread":
        return _spread(rule, w)
    hist = w.rank_history(rule.vector, rule.for_reports)
    if not len(hist):
        return None
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

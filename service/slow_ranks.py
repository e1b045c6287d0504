"""The ranks of a report slower than the others (the ``spread`` check of ``cross_rank`` rules):
each rank's value against the median of the OTHER ranks' values in the same report.

Against the median of every rank a slow rank is part of its own reference: with two ranks the
median is their mean, so a rank twice as slow as the other read 1.33x and had to be three times as
slow to reach 1.5x; with three, the slow rank pulled the median up too. Against the median of the
others, a rank twice as slow as the other of two reads 2x, as the Prometheus alert
``TrainguardStraggler`` judges it.

A group of ranks slow together (a node type slower than the others, ranks sharing one slow node)
is found rank by rank while the fast ranks are at least half of the job: each slow rank's others
are then mostly fast ranks, whose median is a fast rank's time. When the slow ranks are more than
half of the job, theirs is the job's speed and none is named.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["SlowRanks", "others_median", "slow_ranks"]


def others_median(sorted_rows: np.ndarray) -> np.ndarray:
    """For rows sorted in ascending order (shape ``(k, n)``, ``n >= 2``), the median of each row
    without each of its positions: ``out[:, i]`` is the median of the row's values but its ``i``-th
    smallest."""
    n = sorted_rows.shape[1]
    left, pos = n - 1, np.arange(n)
    if left % 2:  # an odd count left: its middle value
        mid = left // 2
        return sorted_rows[:, mid + (mid >= pos)]
    lo, hi = left // 2 - 1, left // 2  # an even count left: the mean of its two middle values
    return 0.5 * (sorted_rows[:, lo + (lo >= pos)] + sorted_rows[:, hi + (hi >= pos)])


class SlowRanks(NamedTuple):
    """Per report (row) and rank: ``slow`` (the rank's value reaches ``ratio`` x the median of the
    others and ``min_value``), ``reference`` (that median; NaN for a rank not finite or a row of
    fewer than two finite values) and per row ``judged`` (some rank could be judged: two finite
    values and a positive reference, or a ``min_value`` that judges a reference of 0)."""

    slow: np.ndarray
    reference: np.ndarray
    judged: np.ndarray


def _references(hist: np.ndarray) -> np.ndarray:
    """Each finite value's median of the other finite values of its row (NaN elsewhere)."""
    ref = np.full(hist.shape, np.nan)
    if hist.shape[1] < 2:
        return ref
    if np.isfinite(hist).all():
        order = np.argsort(hist, axis=1, kind="stable")
        np.put_along_axis(ref, order, others_median(np.take_along_axis(hist, order, axis=1)), axis=1)
        return ref
    for i, row in enumerate(hist):
        finite = np.flatnonzero(np.isfinite(row))
        if len(finite) < 2:
            continue
        order = finite[np.argsort(row[finite], kind="stable")]
        ref[i, order] = others_median(row[order][None])[0]
    return ref


def slow_ranks(hist: np.ndarray, ratio: float, min_value: float) -> SlowRanks:
    """The slow ranks of each row of ``hist`` (reports x ranks; NaN and infinities are no value):
    a rank is slow when its value is at least ``ratio`` times the median of the other ranks' finite
    values and at least ``min_value``; with that median at 0 or below, when ``min_value`` is positive
    and reached (a rank that waits while the others do not), else the rank is not judged."""
    ref = _references(hist)
    has_ref = ~np.isnan(ref)
    positive = has_ref & (ref > 0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        over = np.where(positive, hist / np.where(positive, ref, 1.0) >= ratio, min_value > 0)
        slow = has_ref & over & (hist >= min_value)
    judged = (positive | (has_ref & (min_value > 0))).any(axis=1)
    return SlowRanks(slow, ref, judged)

"""The ranks of a report slower than the others (the ``spread`` check of ``cross_rank`` rules):
each rank's value against the median of the OTHER ranks' values in the same report.

Against the median of every rank a slow rank is part of its own reference: with two ranks the
median is their mean, so a rank twice as slow as the other read 1.33x and had to be three times as
slow to reach 1.5x; with three, the median was the middle rank's value where the other two ranks'
median is the mean of both. Against the median of the others (the mean of the two middle values
of an even number, as the Prometheus alert ``TrainguardStraggler`` takes it), a rank twice as slow
as the other of two reads 2x.

A group of ranks slow together (a node type slower than the others, ranks sharing one slow node)
is found rank by rank while it is at most half of the job: each slow rank's others are then mostly
fast ranks. Of an odd number of ranks one more than half can read slow when the rest are much
faster (of three ranks at 0.1, 1 and 1, the two at 1 read 1.82x the 0.55 of their others).

Only a rank above the middle of its sorted row can be slow (the median of the others of any other
rank is at least its value), and the medians of the others of those ranks are at most two values,
read next to the middle of the sorted row: the ranks are compared with them, not each with a
median of its own. A rank at or below the middle has a third one (``below``), at least its value.

:func:`named_over` judges a rank over several reports: slow in more than half of them (its median
ratio to the others reaches the limit), so that a burst of a few slow steps on one rank (a process
that got less CPU for a moment) is not a straggler while a rank that stays slow is, whichever
reports its noise falls on.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["SlowRanks", "slow_ranks", "named_over", "median_ratios"]


class SlowRanks(NamedTuple):
    """Per report (row) and rank ``slow``: the rank's value reaches ``ratio`` x the median of the
    other ranks and ``min_value``. Per row: ``middle`` (the value a rank must exceed to be slow),
    ``above`` (the median of the others of a rank above ``middle``), ``at`` (that of the rank at
    ``middle`` when it is there alone, of an odd number of ranks; else NaN), ``judged`` (two finite
    values, and a positive median of them or a ``min_value`` that judges a median of 0), ``below``
    (that of a rank below ``middle``, or at it beside another). NaN for rows of fewer than two
    finite values."""

    slow: np.ndarray
    middle: np.ndarray
    above: np.ndarray
    at: np.ndarray
    judged: np.ndarray
    below: np.ndarray

    def references(self, row: int, values: np.ndarray) -> np.ndarray:
        """The medians of the other ranks of the ranks of ``values`` in ``row``."""
        at_or_below = np.where((values == self.middle[row]) & ~np.isnan(self.at[row]), self.at[row], self.below[row])
        return np.where(values > self.middle[row], self.above[row], at_or_below)


def _others_median(rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """For finite rows (shape ``(k, n)``, ``n >= 2``), per row: the middle value a rank must exceed
    to be slow, the median of the others of a rank above it, that of a rank alone at it (NaN where
    none can be: an even ``n``, or a tie there), the row's median, and that of a rank below the
    middle value."""
    n = rows.shape[1]
    if n % 2 == 0:  # an odd number of others: above the lower middle value, that value; else the next
        mid = n // 2 - 1
        # (one partition, not a sort: the value after the middle is the least of those above it)
        s = np.partition(rows, mid, axis=1)
        a, b = s[:, mid], s[:, mid + 1:].min(axis=1)
        return a, a, np.full(len(s), np.nan), 0.5 * (a + b), b
    lo, hi = (n - 3) // 2, (n - 1) // 2  # an even number of others: the mean of their two middle values
    s = np.partition(rows, hi, axis=1)
    a, b, c = s[:, :hi].max(axis=1), s[:, hi], s[:, hi + 1:].min(axis=1)
    # above the middle value b: the others' middle is a and b; at b, alone there (a < b): a and c;
    # below it (or at it beside a): b and c
    return b, 0.5 * (a + b), np.where(a < b, 0.5 * (a + c), np.nan), b, 0.5 * (b + c)


def _is_slow(hist: np.ndarray, ref: np.ndarray, ratio: float, min_value: float) -> np.ndarray:
    """``hist`` >= ``ratio`` x ``ref`` (per row) and >= ``min_value``; a reference of 0 or below
    judged only under a positive ``min_value`` (NaN references: never)."""
    with np.errstate(invalid="ignore"):
        limit = np.where(ref > 0, np.maximum(ratio * ref, min_value), min_value if min_value > 0 else np.inf)
        return hist >= np.where(np.isnan(ref), np.inf, limit)[:, None]


def _finite_rows(hist: np.ndarray, ratio: float, min_value: float) -> SlowRanks:
    middle, above, at, med, below = _others_median(hist)
    slow = (hist > middle[:, None]) & _is_slow(hist, above, ratio, min_value)
    slow |= (hist == middle[:, None]) & _is_slow(hist, at, ratio, min_value)
    return SlowRanks(slow, middle, above, at, (med > 0) | (min_value > 0), below)


def slow_ranks(hist: np.ndarray, ratio: float, min_value: float) -> SlowRanks:
    """The slow ranks of each row of ``hist`` (reports x ranks; NaN and infinities are no value):
    a rank is slow when its value is at least ``ratio`` times the median of the other ranks' finite
    values and at least ``min_value``; with that median at 0 or below, when ``min_value`` is
    positive and reached (a rank that waits while the others do not)."""
    k, n = hist.shape
    if n >= 2 and np.isfinite(hist).all():
        return _finite_rows(hist, ratio, min_value)
    out = SlowRanks(np.zeros(hist.shape, bool), *(np.full(k, np.nan) for _ in range(3)), np.zeros(k, bool), np.full(k, np.nan))
    for i, row in enumerate(hist):
        finite = np.flatnonzero(np.isfinite(row))
        if len(finite) >= 2:
            got = _finite_rows(row[finite][None], ratio, min_value)
            out.slow[i, finite] = got.slow[0]
            for mine, theirs in zip(out[1:], got[1:]):
                mine[i] = theirs[0]
    return out


def named_over(found: SlowRanks) -> np.ndarray:
    """The ranks slow in more than half of ``found``'s reports (a report that does not judge a rank
    counts as one in which it is not slow)."""
    return np.flatnonzero(2 * np.count_nonzero(found.slow, axis=0) > len(found.slow))


def median_ratios(found: SlowRanks, hist: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """The median over the reports of ``hist`` of each of ``ranks``' value / the median of its
    other ranks (a reference of 0 or below: an infinite ratio; reports that do not judge it are
    left out)."""
    rows = np.array([found.references(i, hist[i, ranks]) for i in range(len(hist))]).reshape(len(hist), len(ranks))
    vals = hist[:, ranks]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(rows > 0, vals / rows, np.where(np.isnan(rows), np.nan, np.inf))
    ratios[~np.isfinite(vals)] = np.nan
    out = np.full(len(ranks), np.nan)
    for j in range(len(ranks)):
        got = ratios[:, j][~np.isnan(ratios[:, j])]
        if len(got):
            out[j] = float(np.median(got))
    return out

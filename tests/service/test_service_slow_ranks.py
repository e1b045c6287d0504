"""service/slow_ranks.py: each rank against the median of the other ranks (expected values from
statistics.median over the row without the rank)."""

from __future__ import annotations

import math
import statistics

import numpy as np

from trainguard.service.slow_ranks import median_ratios, named_over, slow_ranks


def test_each_rank_is_slow_against_statistics_median_of_the_others() -> None:
    """The definition, rank by rank with statistics.median, on random rows with ties, NaN and
    infinities, at several ratios and floors; a slow rank's reference is that median."""
    rng = np.random.default_rng(5)
    for _ in range(800):
        n = int(rng.integers(1, 10))
        row = rng.integers(0, 5, n).astype(float) * float(rng.choice([0.01, 1.0]))  # ties, zeros
        if rng.random() < 0.3:
            row[int(rng.integers(0, n))] = float(rng.choice([math.nan, math.inf]))
        ratio, floor = float(rng.choice([1.2, 1.5, 3.0])), float(rng.choice([0.0, 0.02]))
        found = slow_ranks(row[None], ratio, floor)
        finite = [float(v) for v in row if math.isfinite(v)]
        for r, v in enumerate(row.tolist()):
            if not math.isfinite(v) or len(finite) < 2:
                assert not found.slow[0, r]
                continue
            others = list(finite)
            others.remove(v)
            med = statistics.median(others)
            expect = (v / med >= ratio if med > 0 else floor > 0) and v >= floor
            assert bool(found.slow[0, r]) is expect, (row, r, ratio, floor)
            if expect:
                assert found.references(0, np.array([v]))[0] == med
        assert bool(found.judged[0]) is (len(finite) >= 2 and (statistics.median(finite) > 0 or floor > 0))


def test_two_ranks_each_against_the_other() -> None:
    found = slow_ranks(np.array([[0.02, 0.04], [0.02, 0.026]]), 1.5, 0.0)
    assert found.slow.tolist() == [[False, True], [False, False]]  # 2x the other; 1.3x the other
    assert found.references(0, np.array([0.04])).tolist() == [0.02] and found.judged.tolist() == [True, True]


def test_non_finite_ranks_are_no_value_and_a_row_needs_two_finite_ones() -> None:
    row = [math.nan, 1.0, 1.0, 2.0, math.inf]
    found = slow_ranks(np.array([row, [math.nan, 3.0, math.nan, math.inf, math.nan]]), 1.5, 0.0)
    assert found.slow.tolist() == [[False, False, False, True, False], [False] * 5]
    assert found.references(0, np.array([2.0])).tolist() == [1.0] and math.isnan(found.middle[1])
    assert found.judged.tolist() == [True, False]
    assert slow_ranks(np.array([[1.0]]), 1.5, 0.0).judged.tolist() == [False]  # one rank: nothing to compare


def test_a_reference_of_zero_is_judged_only_under_a_floor() -> None:
    waits = np.array([[0.0, 0.0, 0.0, 0.2]])
    assert slow_ranks(waits, 1.5, 0.05).slow.tolist() == [[False, False, False, True]]  # waits while the others do not
    assert slow_ranks(waits, 1.5, 0.0).judged.tolist() == [False]  # a step time of 0: nothing to judge
    assert slow_ranks(np.array([[0.0, 0.0, 0.0, 0.03]]), 1.5, 0.05).slow.tolist() == [[False] * 4]  # below the floor


def test_of_three_ranks_a_fast_one_makes_the_other_two_read_slow() -> None:
    # the median of the two others of a rank at 1 is 0.55 (the documented limit of "at most half")
    assert slow_ranks(np.array([[0.1, 1.0, 1.0]]), 1.5, 0.0).slow.tolist() == [[False, True, True]]
    assert slow_ranks(np.array([[1.0, 1.3, 1.8]]), 1.5, 0.0).slow.tolist() == [[False, False, True]]  # 1.8 / 1.15


def test_a_group_is_slow_up_to_half_of_the_ranks() -> None:
    half = np.array([[1.0, 1.02, 0.98, 1.01, 2.0, 2.1, 1.95, 2.05]])
    assert np.flatnonzero(slow_ranks(half, 1.5, 0.0).slow[0]).tolist() == [4, 5, 6, 7]
    most = np.array([[1.0, 1.02, 0.98, 2.0, 2.0, 2.1, 1.95, 2.05]])  # 5 of 8 slow: their speed is the job's
    assert not slow_ranks(most, 1.5, 0.0).slow.any()


def test_every_rank_s_reference_and_median_ratio_against_statistics_median() -> None:
    """Each rank's median of the other ranks (below the middle, at it, above it; ties, NaN) is
    ``statistics.median`` of the others; a rank's median ratio over several reports is
    ``statistics.median`` of its ratios in the reports that judge it; the ranks named over them
    are those slow in more than half."""
    rng = np.random.default_rng(9)
    for _ in range(400):
        k, n = int(rng.integers(1, 7)), int(rng.integers(2, 9))
        hist = rng.integers(1, 6, (k, n)).astype(float)
        if rng.random() < 0.3:
            hist[int(rng.integers(0, k)), int(rng.integers(0, n))] = math.nan
        found = slow_ranks(hist, 1.5, 0.0)
        want: list[list[float]] = [[] for _ in range(n)]
        for i, row in enumerate(hist):
            finite = [float(v) for v in row if math.isfinite(v)]
            for r, v in enumerate(row.tolist()):
                if not math.isfinite(v) or len(finite) < 2:
                    continue
                others = list(finite)
                others.remove(v)
                med = statistics.median(others)
                assert found.references(i, np.array([v]))[0] == med, (hist, i, r)
                want[r].append(v / med)
        got = median_ratios(found, hist, np.arange(n))
        for r in range(n):
            assert (math.isnan(got[r]) and not want[r]) or got[r] == statistics.median(want[r]), (hist, r)
        slow_in = found.slow.sum(axis=0)
        assert named_over(found).tolist() == [r for r in range(n) if slow_in[r] > k / 2]

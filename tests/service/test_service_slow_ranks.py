"""service/slow_ranks.py: each rank against the median of the other ranks (expected values from
statistics.median over the row without the rank)."""

from __future__ import annotations

import math
import statistics

import numpy as np

from trainguard.service.slow_ranks import others_median, slow_ranks


def test_the_median_of_the_others_is_that_of_the_row_without_each_rank() -> None:
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(2, 10))
        row = rng.integers(0, 4, n).astype(float)  # ties
        s = np.sort(row)
        got = others_median(s[None])[0]
        assert got.tolist() == [statistics.median(np.delete(s, i).tolist()) for i in range(n)], s


def test_two_ranks_each_against_the_other() -> None:
    found = slow_ranks(np.array([[0.02, 0.04], [0.02, 0.026]]), 1.5, 0.0)
    assert found.slow.tolist() == [[False, True], [False, False]]  # 2x the other; 1.3x the other
    assert found.reference.tolist() == [[0.04, 0.02], [0.026, 0.02]] and found.judged.tolist() == [True, True]


def test_non_finite_ranks_are_no_value_and_a_row_needs_two_finite_ones() -> None:
    row = [math.nan, 1.0, 1.0, 2.0, math.inf]
    found = slow_ranks(np.array([row, [math.nan, 3.0, math.nan, math.inf, math.nan]]), 1.5, 0.0)
    assert found.slow.tolist() == [[False, False, False, True, False], [False] * 5]
    assert found.reference[0].tolist()[1:4] == [1.5, 1.5, 1.0] and math.isnan(found.reference[0][0])
    assert found.judged.tolist() == [True, False]
    assert slow_ranks(np.array([[1.0]]), 1.5, 0.0).judged.tolist() == [False]  # one rank: nothing to compare


def test_a_reference_of_zero_is_judged_only_under_a_floor() -> None:
    waits = np.array([[0.0, 0.0, 0.0, 0.2]])
    assert slow_ranks(waits, 1.5, 0.05).slow.tolist() == [[False, False, False, True]]  # waits while the others do not
    assert slow_ranks(waits, 1.5, 0.0).judged.tolist() == [False]  # a step time of 0: nothing to judge
    assert slow_ranks(np.array([[0.0, 0.0, 0.0, 0.03]]), 1.5, 0.05).slow.tolist() == [[False] * 4]  # below the floor


def test_a_group_is_slow_up_to_half_of_the_ranks() -> None:
    half = np.array([[1.0, 1.02, 0.98, 1.01, 2.0, 2.1, 1.95, 2.05]])
    assert np.flatnonzero(slow_ranks(half, 1.5, 0.0).slow[0]).tolist() == [4, 5, 6, 7]
    most = np.array([[1.0, 1.02, 0.98, 2.0, 2.0, 2.1, 1.95, 2.05]])  # 5 of 8 slow: their speed is the job's
    assert not slow_ranks(most, 1.5, 0.0).slow.any()

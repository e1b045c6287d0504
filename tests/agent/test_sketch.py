"""Bottom-k sketches and the Jaccard estimate (trainer_agent/sketch.py) against exact set
arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer_agent.sketch import EMPTY, BottomK, jaccard, overlaps

K = 256


def _hashes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2**63, size=n, dtype=np.uint64) * np.uint64(2) + rng.integers(0, 2, size=n, dtype=np.uint64)


def _values_of(row: np.ndarray) -> np.ndarray:
    return row.view(np.uint64)


def _sketch(values: np.ndarray, k: int = K, batches: int = 7) -> np.ndarray:
    s = BottomK(k)
    for part in np.array_split(values, batches):
        s.update(part)
    return s.take()


def test_bottom_k_is_the_k_smallest_distinct_hashes() -> None:
    rng = np.random.default_rng(1)
    values = _hashes(rng, 5000)
    values = np.concatenate([values, values[:100]])  # repeats count once
    row = _sketch(values, k=64)
    assert row.dtype == np.int64
    np.testing.assert_array_equal(row.view(np.uint64), np.unique(values)[:64])
    s = BottomK(8)
    s.update(np.array([5, 3, 3], dtype=np.uint64))
    row = s.take().view(np.uint64)
    assert row[:2].tolist() == [3, 5] and (row[2:] == EMPTY).all()
    assert (s.take().view(np.uint64) == EMPTY).all()  # take() starts a new interval
    with pytest.raises(ValueError):
        BottomK(0)


@pytest.mark.parametrize("shared", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_jaccard_estimate_against_the_exact_value(shared: float) -> None:
    rng = np.random.default_rng(int(shared * 10))
    n = 20_000
    common = _hashes(rng, int(n * shared))
    a = np.concatenate([common, _hashes(rng, n - common.size)])
    b = np.concatenate([common, _hashes(rng, n - common.size)])
    exact = np.intersect1d(a, b).size / np.union1d(a, b).size
    est = jaccard(_sketch(a), _sketch(b), K)
    se = math.sqrt(max(exact * (1 - exact), 1 / K) / K)
    assert abs(est - exact) <= 5 * se, (est, exact)


def test_small_sets_are_exact_and_overlaps_name_the_partner() -> None:
    rng = np.random.default_rng(3)
    x = _hashes(rng, 40)
    rows = np.stack([_sketch(x[:30]), _sketch(_hashes(rng, 50)), _sketch(x[10:40]), BottomK(K).take()])
    assert jaccard(rows[0], rows[2], K) == pytest.approx(20 / 40)
    best, partner = overlaps(rows, K)
    assert best[0] == pytest.approx(0.5) and partner[0] == 2
    assert best[2] == pytest.approx(0.5) and partner[2] == 0
    assert best[1] == 0.0 and partner[1] == -1  # shares no sequence with anyone
    assert math.isnan(best[3]) and partner[3] == -1  # rank 3 saw nothing
    assert math.isnan(jaccard(rows[3], rows[3], K))


def test_overlaps_of_many_ranks_find_the_sharing_groups_without_all_pairs() -> None:
    rng = np.random.default_rng(5)
    world = 120
    rows = np.stack([_sketch(_hashes(rng, 500), batches=1) for _ in range(world)])
    rows[30] = _sketch(np.concatenate([_values_of(rows[31])[:40], _hashes(rng, 460)]), batches=1)  # partial overlap
    shared = _sketch(_hashes(rng, 500), batches=1)
    for r in (7, 60, 119):  # three ranks read the same data
        rows[r] = shared
    best, partner = overlaps(rows, K)
    assert np.flatnonzero(best > 0.5).tolist() == [7, 60, 119]
    assert {int(partner[r]) for r in (7, 60, 119)} <= {7, 60, 119}
    # the reference: the largest estimate over all pairs, computed pair by pair
    reference = np.zeros(world)
    for i in range(world):
        for j in range(i + 1, world):
            sim = jaccard(rows[i], rows[j], K)
            reference[i], reference[j] = max(reference[i], sim), max(reference[j], sim)
    np.testing.assert_array_equal(best, reference)

"""Bottom-k sketches and the Jaccard estimate (trainer_agent/measure/sketch.py) against exact set
arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer_agent.measure.sketch import EMPTY, BottomK, distinct_rows, jaccard, normalized, overlaps, row_hash

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


def _all_pairs(rows: np.ndarray, k: int) -> np.ndarray:
    """The reference: every rank's largest estimate over all other ranks, pair by pair."""
    n = len(rows)
    ref = np.array([np.nan if (rows[i].view(np.uint64) == EMPTY).all() else 0.0 for i in range(n)])
    for i in range(n):
        for j in range(n):
            if i != j:
                sim = jaccard(rows[i], rows[j], k)
                if sim > ref[i]:
                    ref[i] = sim
    return ref


def _planted(rng: np.random.Generator, world: int, k: int) -> np.ndarray:
    """Sketches of ``world`` ranks with shared data planted: groups that read the same data,
    partial overlaps of random size (some below k sequences: exact), a rank overlapping several
    others by different amounts, ranks that saw nothing, and rows as another process might send
    them (unsorted, a value twice)."""
    pool = [_hashes(rng, int(rng.integers(1, 3 * k))) for _ in range(world)]
    for _ in range(int(rng.integers(0, world // 3 + 1))):  # partial overlaps
        a, b = rng.integers(0, world, size=2)
        take = int(rng.integers(1, pool[a].size + 1))
        pool[b] = np.concatenate([pool[b], pool[a][:take]])
    rows = np.stack([_sketch(p, k=k, batches=3) for p in pool])
    for _ in range(int(rng.integers(0, 4))):  # groups with the same data
        members = rng.choice(world, size=int(rng.integers(2, 5)), replace=False)
        rows[members] = rows[members[0]]
    for r in rng.choice(world, size=int(rng.integers(0, 3)), replace=False):
        rows[r] = BottomK(k).take()
    r = int(rng.integers(0, world))
    if (rows[r].view(np.uint64) != EMPTY).sum() >= 2:
        rows[r] = rng.permutation(rows[r])  # unsorted
        row = rows[r].view(np.uint64)
        filled = np.flatnonzero(row != EMPTY)
        row[filled[-1]] = row[filled[0]]  # a value twice
    return rows


@pytest.mark.parametrize("seed", range(12))
def test_overlaps_equal_the_all_pairs_estimate_on_random_sketches_with_planted_shared_data(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    k = int(rng.choice([4, 16, 64]))
    world = int(rng.integers(2, 48))
    rows = _planted(rng, world, k)
    best, partner = overlaps(rows, k)
    np.testing.assert_array_equal(best, _all_pairs(rows, k))
    for i in range(world):
        if best[i] > 0:  # the named partner is one whose estimate is the maximum
            assert partner[i] != i and jaccard(rows[i], rows[partner[i]], k) == best[i]
        else:
            assert partner[i] == -1


def test_a_hash_nearly_every_rank_saw_costs_no_n_squared_pairs_and_keeps_the_planted_overlap() -> None:
    rng = np.random.default_rng(9)
    world, k = 300, 16
    common = np.array([1], dtype=np.uint64)  # smaller than every other hash: in every sketch
    own = [_hashes(rng, 40) for _ in range(world)]
    own[200] = np.concatenate([own[200][:20], own[5][:20]])
    rows = np.stack([_sketch(np.concatenate([common, o]), k=k, batches=1) for o in own])
    best, partner = overlaps(rows, k, crowded=8)
    ref = _all_pairs(rows, k)
    assert best[5] == ref[5] and best[200] == ref[200] and ref[5] > 0.3
    assert partner[5] == 200 and partner[200] == 5
    assert (best <= ref).all() and (best > 0).all()  # the others: linked through the common hash only


def test_distinct_rows_group_equal_sketches_even_when_their_hashes_collide() -> None:
    rng = np.random.default_rng(11)
    base = np.stack([_sketch(_hashes(rng, 50), k=16, batches=1) for _ in range(4)])
    rows = normalized(base[[2, 0, 2, 1, 3, 0, 3]])
    for hash_rows in (row_hash, lambda v: np.zeros(len(v), dtype=np.uint64)):  # the second: every row collides
        distinct, first, group = distinct_rows(rows, hash_rows)
        np.testing.assert_array_equal(distinct[group], rows)  # each rank's group holds its own sketch
        assert sorted(first.tolist()) == [0, 1, 3, 4]  # the lowest rank of each sketch
        assert len({tuple(r) for r in distinct.tolist()}) == len(distinct) == 4

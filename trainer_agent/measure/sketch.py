"""Bottom-k sketches of the sequences a rank saw, and the cross-rank overlap they estimate (the
shared-seed failure of the stability guide, section 3.3: ranks or workers that feed the same
samples).

Each sequence is reduced to a uniform 64-bit hash of its content (the data monitor's exact hash).
A rank keeps the ``k`` smallest distinct hashes it saw since its last report: a bottom-k MinHash
sketch of the set of its sequences. At the report the ranks' sketches travel in the report's
all-gather (``k`` int64 per rank) and the leader estimates, for every pair of ranks, the Jaccard
similarity of the two sets (Broder 1997)::

    U = the k smallest of sketch(A) | sketch(B)          (the bottom-k sketch of A | B)
    J(A, B) ~ |U & sketch(A) & sketch(B)| / |U|

exact when both sets have fewer than ``k`` distinct sequences; otherwise its standard error is
about sqrt(J (1 - J) / k). Ranks of a data-parallel job should see disjoint data (J ~ 0); ranks
that share a sampler seed and rank configuration see the same data (J ~ 1).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

__all__ = ["BottomK", "EMPTY", "SKETCH_K", "distinct_rows", "jaccard", "normalized", "overlaps", "pair_estimates", "row_hash"]

#: Sketch size every rank sends at a report (the same on all ranks): 512 bytes per rank; the
#: Jaccard estimate's standard error is at most 1/16.
SKETCH_K = 64

#: Marks an unused slot of a sketch sent in a fixed-width row (as int64: -1).
EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)


class BottomK:
    """The ``k`` smallest distinct 64-bit hashes seen since the last :meth:`take`. Thread-safe."""

    def __init__(self, k: int = 64) -> None:
        if type(k) is not int or not 1 <= k <= 4096:
            raise ValueError(f"k must be an integer in [1, 4096], got {k!r}")
        self.k = k
        self._values = np.empty(0, dtype=np.uint64)
        self._lock = threading.Lock()

    def update(self, hashes: np.ndarray) -> None:
        """Add the hashes of a batch of sequences (uint64 array)."""
        h = np.asarray(hashes, dtype=np.uint64).reshape(-1)
        if not h.size:
            return
        with self._lock:
            if self._values.size == self.k:
                h = h[h < self._values[-1]]  # the usual case: nothing below the k-th smallest
                if not h.size:
                    return
            self._values = np.unique(np.concatenate([self._values, h]))[: self.k]

    def take(self) -> np.ndarray:
        """The sketch as a fixed-width int64 row of ``k`` (hash bits; unused slots ``EMPTY``),
        and start a new interval."""
        with self._lock:
            values, self._values = self._values, np.empty(0, dtype=np.uint64)
        row = np.full(self.k, EMPTY, dtype=np.uint64)
        row[: values.size] = values
        return row.view(np.int64)


def _values(row: np.ndarray) -> np.ndarray:
    v = np.asarray(row, dtype=np.int64).view(np.uint64)
    return np.unique(v[v != EMPTY])


def jaccard(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """The bottom-k estimate of the Jaccard similarity of the sets behind sketches ``a`` and
    ``b`` (rows as :meth:`BottomK.take` gives them); NaN when both are empty."""
    sa, sb = _values(a), _values(b)
    union = np.union1d(sa, sb)[:k]
    if not union.size:
        return float("nan")
    both = np.intersect1d(np.intersect1d(union, sa, assume_unique=True), sb, assume_unique=True)
    return both.size / union.size


def normalized(rows: np.ndarray) -> np.ndarray:
    """Sketch rows ([n, w] int64, as :meth:`BottomK.take` gives them, or any bits a rank sent) as
    sets: each row's distinct values ascending, then ``EMPTY`` (uint64 view). Two rows are equal
    exactly when they stand for the same set."""
    v = np.sort(np.asarray(rows, dtype=np.int64).reshape(len(rows), -1).view(np.uint64), axis=1)
    if v.shape[1] > 1:
        repeat = np.zeros(v.shape, dtype=bool)
        repeat[:, 1:] = v[:, 1:] == v[:, :-1]
        if repeat.any():  # BottomK rows have no repeats; a row from elsewhere may
            v = np.sort(np.where(repeat, EMPTY, v), axis=1)
    return v


def pair_estimates(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """:func:`jaccard` of the pairs of normalized rows ``a[i], b[i]`` ([m, w] uint64 each), all
    at once: one sort of each pair's values, the union's first ``k`` distinct values counted, and
    those present twice (in both sets). NaN for a pair of empty sets."""
    both = np.sort(np.concatenate([a, b], axis=1), axis=1)
    real = both != EMPTY
    twice = np.zeros(both.shape, dtype=bool)
    twice[:, 1:] = (both[:, 1:] == both[:, :-1]) & real[:, 1:]
    first = real & ~twice  # the union's values, each once, ascending
    order = np.cumsum(first, axis=1)  # 1-based place of each value in the union
    in_union = first & (order <= k)
    union = in_union.sum(axis=1)
    common = np.zeros(both.shape, dtype=bool)
    common[:, 1:] = twice[:, 1:] & in_union[:, :-1]  # the second copy of a value in the union's head
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, common.sum(axis=1) / np.maximum(union, 1), np.nan)


def _pairs_sharing_values(values: np.ndarray, crowded: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs ``(a, b)``, a < b, of the (distinct, normalized) rows ``values`` that share a value,
    each with how many values they share: an inverted index (one sort of every value with its
    row). A value held by more than ``crowded`` rows links each of them to its neighbours in that
    value's list only (a sequence nearly every rank saw must not cost the n^2 pairs)."""
    n, w = values.shape
    filled = values != EMPTY
    flat, owner = values[filled], np.nonzero(filled)[0]
    order = np.lexsort((owner, flat))
    flat, owner = flat[order], owner[order]
    if flat.size < 2:
        return np.empty((0, 2), dtype=np.int64), np.empty(0, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate([[True], flat[1:] != flat[:-1]]))
    sizes = np.diff(np.concatenate([starts, [flat.size]]))
    pieces = []
    for size in np.unique(sizes[sizes > 1]).tolist():  # runs of one size at once
        at = starts[sizes == size]
        if size <= crowded:
            i, j = np.triu_indices(size, 1)
            members = owner[at[:, None] + np.arange(size)]
            pieces.append(np.stack([members[:, i].reshape(-1), members[:, j].reshape(-1)], axis=1))
        else:
            step = (at[:, None] + np.arange(size - 1)).reshape(-1)
            pieces.append(np.stack([owner[step], owner[step + 1]], axis=1))
    if not pieces:
        return np.empty((0, 2), dtype=np.int64), np.empty(0, dtype=np.int64)
    pairs = np.concatenate(pieces)  # owners within a run ascend: a < b
    code, shared = np.unique(pairs[:, 0] * n + pairs[:, 1], return_counts=True)
    return np.stack([code // n, code % n], axis=1), shared


def row_hash(values: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of ``values`` ([n, w] uint64; position-dependent)."""
    mixed = values * np.uint64(0x9E3779B97F4A7C15)  # wraps: uint64 arithmetic is modulo 2^64
    mixed ^= mixed >> np.uint64(29)
    weights = (np.arange(1, values.shape[1] + 1, dtype=np.uint64) * np.uint64(0xBF58476D1CE4E5B9)) | np.uint64(1)
    return (mixed * weights).sum(axis=1, dtype=np.uint64)


def distinct_rows(values: np.ndarray, hash_rows: Callable[[np.ndarray], np.ndarray] = row_hash
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(distinct rows, first rank of each, group of each rank)``: one sort of a hash per row,
    every row then checked against its group's first (on a collision, a sort of the rows)."""
    _, first, group = np.unique(hash_rows(values), return_index=True, return_inverse=True)
    group = group.reshape(-1)
    if not (values == values[first[group]]).all():  # two different rows with the same hash
        _, first, group = np.unique(values, axis=0, return_index=True, return_inverse=True)
        group = group.reshape(-1)
    return values[first], first, group


def overlaps(rows: np.ndarray, k: int, candidates: int = 32, crowded: int = 64,
             chunk: int = 1 << 15) -> tuple[np.ndarray, np.ndarray]:
    """For sketches ``rows`` ([ranks, k] int64, row r = rank r), each rank's largest estimated
    Jaccard similarity with another rank (:func:`jaccard`), and that rank (-1 when it shares no
    hash with any). A rank with an empty sketch (it saw no data) has NaN.

    Without the n^2 pairs, in O(n k log(n k)) for n ranks:

    1. Ranks with the same sketch (ranks that read the same data: a tensor-parallel group, a
       shared sampler seed) are grouped by one sort of the rows; each has 1 with the others.
    2. Among the distinct sketches, only those that share a hash can have an estimate above 0:
       an inverted index of the hashes gives the pairs that share any, with how many
       (``_pairs_sharing_values``); each sketch keeps its ``candidates`` partners that share the
       most, whose estimates are computed together (``pair_estimates``, ``chunk`` pairs at a time).

    The result is the all-pairs maximum whenever no sketch shares hashes with more than
    ``candidates`` other distinct sketches, nor only through hashes held by more than
    ``crowded`` of them."""
    n = len(rows)
    best = np.full(n, np.nan)
    partner = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return best, partner
    values = normalized(rows)
    distinct, first, group = distinct_rows(values)
    g = len(distinct)
    filled = distinct[:, 0] != EMPTY
    g_best = np.where(filled, 0.0, np.nan)
    g_partner = np.full(g, -1, dtype=np.int64)  # a rank
    _best_partners(distinct, first, k, g_best, g_partner, candidates, crowded, chunk)
    best[:] = g_best[group]
    partner[:] = g_partner[group]
    _same_sketch_partners(group, filled, best, partner)
    return best, partner


def _best_partners(distinct: np.ndarray, first: np.ndarray, k: int, g_best: np.ndarray, g_partner: np.ndarray,
                   candidates: int, crowded: int, chunk: int) -> None:
    """Step 2 of :func:`overlaps`: each distinct sketch's best estimate among its ``candidates``
    partners that share the most hashes, into ``g_best`` / ``g_partner`` (a rank)."""
    pairs, shared = _pairs_sharing_values(distinct, crowded)
    if not len(pairs):
        return
    ends = np.concatenate([pairs, pairs[:, ::-1]])  # (sketch, partner) both ways
    counts = np.concatenate([shared, shared])
    order = np.lexsort((ends[:, 1], -counts, ends[:, 0]))  # per sketch: most shared first
    ends = ends[order]
    head = np.concatenate([[0], np.flatnonzero(ends[1:, 0] != ends[:-1, 0]) + 1])
    place = np.arange(len(ends)) - np.repeat(head, np.diff(np.concatenate([head, [len(ends)]])))
    ends = ends[place < candidates]
    sims = np.concatenate([pair_estimates(distinct[ends[i:i + chunk, 0]], distinct[ends[i:i + chunk, 1]], k)
                           for i in range(0, len(ends), chunk)])
    # per sketch the largest estimate, on a tie the partner of the lowest rank
    order = np.lexsort((first[ends[:, 1]], -sims, ends[:, 0]))
    top = order[np.concatenate([[True], ends[order][1:, 0] != ends[order][:-1, 0]])]
    who, sim = ends[top, 0], sims[top]
    better = sim > 0
    g_best[who[better]] = sim[better]
    g_partner[who[better]] = first[ends[top, 1][better]]


def _same_sketch_partners(group: np.ndarray, filled: np.ndarray, best: np.ndarray, partner: np.ndarray) -> None:
    """Step 1 of :func:`overlaps`: ranks with the same (non-empty) sketch as another have 1, with
    the lowest other such rank."""
    g = len(filled)
    members = np.bincount(group, minlength=g)
    same = (members[group] > 1) & filled[group]
    if not same.any():
        return
    ranks = np.flatnonzero(same)
    by_group = ranks[np.argsort(group[ranks], kind="stable")]
    lowest = np.full(g, -1, dtype=np.int64)
    second = np.full(g, -1, dtype=np.int64)
    gs = group[by_group]
    head = np.concatenate([[True], gs[1:] != gs[:-1]])
    lowest[gs[head]] = by_group[head]
    nxt = np.flatnonzero(head) + 1
    second[gs[head]] = by_group[nxt]
    best[ranks] = 1.0
    partner[ranks] = np.where(lowest[group[ranks]] == ranks, second[group[ranks]], lowest[group[ranks]])

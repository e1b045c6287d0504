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

import numpy as np

__all__ = ["BottomK", "EMPTY", "SKETCH_K", "jaccard", "overlaps"]

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


def overlaps(rows: np.ndarray, k: int, candidates: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """For sketches ``rows`` ([ranks, k] int64, row r = rank r), each rank's largest estimated
    Jaccard similarity with another rank, and that rank (-1 when it shares no hash with any).
    A rank with an empty sketch (it saw no data) has NaN.

    Only ranks that share a hash can have a non-zero estimate, so the candidates of a rank are
    found by one sort of all hashes (ranks next to each other in a run of equal hashes), at most
    ``candidates`` per rank: O(n k log(n k)) for n ranks, not the n^2 pairs (1,000 ranks that all
    read the same data cost ~8,000 estimates, not 500,000)."""
    n = len(rows)
    values = np.asarray(rows, dtype=np.int64).reshape(n, -1).view(np.uint64)
    filled = values != EMPTY
    best = np.where(filled.any(axis=1), 0.0, np.nan)
    partner = np.full(n, -1, dtype=np.int64)
    flat, owner = values[filled], np.nonzero(filled)[0]
    order = np.lexsort((owner, flat))
    flat, owner = flat[order], owner[order]
    same = (flat[1:] == flat[:-1]) & (owner[1:] != owner[:-1])
    links = np.unique(np.stack([owner[:-1][same], owner[1:][same]], axis=1), axis=0) if same.any() else np.empty((0, 2), dtype=np.int64)
    near: dict[int, list[int]] = {}
    for a, b in links.tolist():
        for x, y in ((a, b), (b, a)):
            got = near.setdefault(x, [])
            if len(got) < candidates and y not in got:
                got.append(y)
    for i, others in near.items():
        for j in others:
            sim = jaccard(rows[i], rows[j], k)
            if sim > best[i]:
                best[i], partner[i] = sim, j
    return best, partner

"""Recent reports of one run, kept in preallocated numpy ring buffers.

The ingest path appends one report per request. Keeping reports as Python objects (a deque of
dicts) makes the garbage collector walk ever larger object graphs, which showed up as pauses of up
to ~0.5 s at p99; here a report becomes a few stores into float64 arrays that are allocated once
(they grow only when a new metric name appears, by doubling).

:class:`RunWindow` is the one implementation of the read-only :class:`RuleWindow` protocol that
rules evaluate over.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from service.wire import RankValues, Report

__all__ = ["VECTORS", "RuleWindow", "RunWindow"]

#: Per-rank vectors of a report, in storage order (bit i of a mask = VECTORS[i] present).
VECTORS: tuple[str, ...] = tuple(RankValues.model_fields)
_VECTOR_INDEX = {name: i for i, name in enumerate(VECTORS)}


class RuleWindow(Protocol):
    """What a rule may read: the recent history of one run. Never mutated by rules."""

    @property
    def size(self) -> int:
        """Reports available (at most the capacity)."""

    @property
    def last_received(self) -> float:
        """Controller time of the last report (or of the registration, before any report)."""

    def latest(self, metric: str) -> float | None:
        """The newest report's value of ``metric``, ``None`` when that report lacks it."""

    def series(self, metric: str, last: int) -> np.ndarray:
        """Values of ``metric`` in the newest ``last`` reports that carry it, oldest first."""

    def rank_history(self, vector: str, last: int) -> np.ndarray:
        """The newest ``last`` reports' per-rank ``vector`` that were present, shape (k, world)."""


class RunWindow:
    """Ring buffers holding the newest ``capacity`` reports of one run.

    Job-level values live in a (capacity, columns) float64 matrix with a presence mask (a value
    absent from a report is not NaN: NaN is a real value). Per-rank vectors live in a smaller ring
    of (rank_capacity, len(VECTORS), world_size).
    """

    __slots__ = (
        "capacity", "rank_capacity", "world_size", "count", "columns", "_values", "_present",
        "_received", "_step", "_ranks", "_rank_mask", "rank_count", "_last_received",
    )

    def __init__(self, *, capacity: int, rank_capacity: int, world_size: int, created: float) -> None:
        if capacity < 1 or rank_capacity < 1 or world_size < 1:
            raise ValueError("capacity, rank_capacity and world_size must be >= 1")
        self.capacity = capacity
        self.rank_capacity = rank_capacity
        self.world_size = world_size
        self.count = 0
        """Reports appended since creation (also the sequence number of the newest)."""
        self.rank_count = 0
        self.columns: dict[str, int] = {}
        self._values = np.full((capacity, 16), math.nan)
        self._present = np.zeros((capacity, 16), dtype=bool)
        self._received = np.zeros(capacity)
        self._step = np.zeros(capacity, dtype=np.int64)
        self._ranks = np.zeros((rank_capacity, len(VECTORS), world_size))
        self._rank_mask = np.zeros((rank_capacity, len(VECTORS)), dtype=bool)
        self._last_received = created

    # -- writing ---------------------------------------------------------------------------
    def _column(self, name: str) -> int:
        col = self.columns.get(name)
        if col is None:
            col = len(self.columns)
            if col == self._values.shape[1]:
                grow = self._values.shape[1]
                self._values = np.hstack([self._values, np.full((self.capacity, grow), math.nan)])
                self._present = np.hstack([self._present, np.zeros((self.capacity, grow), dtype=bool)])
            self.columns[name] = col
        return col

    def append(self, report: Report, received: float) -> None:
        """Add ``report``, received at controller time ``received``; overwrites the oldest."""
        self.append_raw(report.values, rank_vectors(report.ranks), report.step_last, received)

    def append_raw(
        self, values: dict[str, float], ranks: dict[str, np.ndarray], step_last: int, received: float
    ) -> None:
        """Add one report given as plain values (also used to reload persisted reports)."""
        row = self.count % self.capacity
        self._present[row] = False
        for name, value in values.items():
            col = self._column(name)
            self._values[row, col] = value
            self._present[row, col] = True
        self._received[row] = received
        self._step[row] = step_last
        self.count += 1
        self._last_received = received
        if ranks:
            rrow = self.rank_count % self.rank_capacity
            self._rank_mask[rrow] = False
            for i, name in enumerate(VECTORS):
                vec = ranks.get(name)
                if vec is not None:
                    self._ranks[rrow, i] = vec
                    self._rank_mask[rrow, i] = True
            self.rank_count += 1

    def resize_world(self, world_size: int) -> None:
        """A re-registration with another world size: drop the per-rank history only."""
        if world_size != self.world_size:
            self.world_size = world_size
            self._ranks = np.zeros((self.rank_capacity, len(VECTORS), world_size))
            self._rank_mask[:] = False
            self.rank_count = 0

    def touch(self, received: float) -> None:
        """Restart the absence clock (a re-registration counts as a sign of life)."""
        self._last_received = max(self._last_received, received)

    # -- RuleWindow ------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return min(self.count, self.capacity)

    @property
    def last_received(self) -> float:
        return self._last_received

    @property
    def last_step(self) -> int | None:
        return int(self._step[(self.count - 1) % self.capacity]) if self.count else None

    def _rows(self, last: int) -> np.ndarray:
        n = min(last, self.size)
        return np.arange(self.count - n, self.count) % self.capacity

    def latest(self, metric: str) -> float | None:
        col = self.columns.get(metric)
        if col is None or not self.count:
            return None
        row = (self.count - 1) % self.capacity
        return float(self._values[row, col]) if self._present[row, col] else None

    def series(self, metric: str, last: int) -> np.ndarray:
        col = self.columns.get(metric)
        if col is None or not self.count:
            return np.empty(0)
        # Reports may skip a metric: take the newest ``last`` rows that carry it.
        rows = self._rows(self.size)
        picked = rows[self._present[rows, col]]
        if last < len(picked):
            picked = picked[len(picked) - last :]
        return self._values[picked, col]

    def rank_history(self, vector: str, last: int) -> np.ndarray:
        i = _VECTOR_INDEX[vector]
        if last == 1 and self.rank_count:
            row = (self.rank_count - 1) % self.rank_capacity
            return self._ranks[row : row + 1, i] if self._rank_mask[row, i] else self._ranks[0:0, i]
        n = min(last, self.rank_count, self.rank_capacity)
        rows = np.arange(self.rank_count - n, self.rank_count) % self.rank_capacity
        rows = rows[self._rank_mask[rows, i]]
        return self._ranks[rows, i]

    def latest_values(self) -> dict[str, float]:
        """The newest report's job-level values (for status pages)."""
        if not self.count:
            return {}
        row = (self.count - 1) % self.capacity
        return {
            name: float(self._values[row, col])
            for name, col in self.columns.items()
            if self._present[row, col]
        }


def rank_vectors(ranks: RankValues) -> dict[str, np.ndarray]:
    """The non-empty per-rank vectors of a report as float64 arrays."""
    out = {}
    for name in VECTORS:
        vec = getattr(ranks, name)
        if vec:
            out[name] = np.asarray(vec, dtype=np.float64)
    return out

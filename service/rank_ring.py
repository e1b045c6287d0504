"""The per-rank vectors of one run's recent reports (:class:`RankRing`), the part of a
:class:`~service.window.RunWindow` that is world_size columns wide: one ring of (capacity,
len(VECTORS), world_size) float64, stored once and read a few rows at a time."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from trainguard.protocol.rank_values import STORED_LAYOUT

__all__ = ["VECTORS", "RankRing"]

#: Per-rank vectors of a report, in storage order (bit i of a mask = VECTORS[i] present; append-only,
#: see ``trainguard.protocol.rank_values``).
VECTORS: tuple[str, ...] = STORED_LAYOUT
_VECTOR_INDEX = {name: i for i, name in enumerate(VECTORS)}
#: Each row written to any ring gets the next number: a key for what is derived from a row's values
#: (``service.evaluate_ranks`` keeps each row's straggler verdict), never reused in this process.
_ROW_IDS = itertools.count(1)


class RankRing:
    """The newest ``capacity`` reports' per-rank vectors (of the reports that carried any), with
    which vectors each report carried, which of them as received (for people) and the report's
    sequence number and row id (:data:`_ROW_IDS`)."""

    __slots__ = ("capacity", "world_size", "count", "values", "mask", "shown", "seq", "ids", "steps", "absent_at", "seen")

    def __init__(self, capacity: int, world_size: int) -> None:
        self.capacity = capacity
        self.world_size = world_size
        self.count = 0
        """Reports appended (their rows: ``count % capacity`` is the next one)."""
        self.seen: set[str] = set()  # vectors any report of this history carried
        self.values = np.zeros((capacity, len(VECTORS), world_size))
        self.mask = np.zeros((capacity, len(VECTORS)), dtype=bool)
        self.shown = np.zeros((capacity, len(VECTORS)), dtype=bool)  # as received (for people)
        self.seq = np.zeros(capacity, dtype=np.int64)
        # per row, its id and its report's last step (plain lists: read a few at a time by rules)
        self.ids: list[int] = [0] * capacity
        self.steps: list[float] = [math.nan] * capacity
        #: Per vector, the ``count`` of the newest report that lacked it (as the window's
        #: ``_absent_at`` per column).
        self.absent_at = [0] * len(VECTORS)

    def append(self, ranks: dict[str, np.ndarray], seq: int, step: float = math.nan) -> None:
        """Add the per-rank vectors of report ``seq`` (its last step ``step``); overwrites the oldest."""
        row = self.count % self.capacity
        self.count += 1
        for i, name in enumerate(VECTORS):
            vec = ranks.get(name)
            if vec is not None:
                self.values[row, i] = vec
            else:
                self.absent_at[i] = self.count
        self.mask[row] = [name in ranks for name in VECTORS]
        # a vector read back from a stored record (``service.rank_store``) serves the rules, not people
        exact = getattr(ranks, "exact", None)
        self.shown[row] = [name in ranks and (exact is None or name in exact) for name in VECTORS]
        if not self.seen.issuperset(ranks):
            self.seen.update(ranks)
        self.seq[row] = seq
        self.ids[row] = next(_ROW_IDS)
        self.steps[row] = step

    def save_next(self) -> tuple[Any, ...]:
        """What the next :meth:`append` overwrites, for :meth:`rollback`."""
        row = self.count % self.capacity
        return self.values[row].copy(), self.mask[row].copy(), self.shown[row].copy(), self.ids[row], self.steps[row]

    def rollback(self, count: int, saved: tuple[Any, ...] | None) -> None:
        """Take back the append made when the ring held ``count`` reports (``saved`` by
        :meth:`save_next` then), unless another came after it or the world size changed."""
        if saved is not None and self.count == count + 1 and saved[0].shape == self.values.shape[1:]:
            row = count % self.capacity
            self.values[row], self.mask[row], self.shown[row], self.ids[row], self.steps[row] = saved
            self.count = count

    def history(self, vector: str, last: int) -> np.ndarray:
        """The newest ``last`` reports' ``vector`` that were present, shape (k, world_size)."""
        i = _VECTOR_INDEX[vector]
        n = min(last, self.count, self.capacity)
        if n < 1 or vector not in self.seen:  # (most rules read vectors most jobs never send)
            out = self.values[0:0, i]
            out.flags.writeable = False
            return out
        first = (self.count - n) % self.capacity
        every = self.absent_at[i] <= self.count - n  # each of the n reports carried it
        if every and first + n <= self.capacity:  # the common case: a view
            out = self.values[first : first + n, i]
            out.flags.writeable = False
            return out
        if first + n <= self.capacity:  # contiguous in the ring: a view
            rows, mask = self.values[first : first + n, i], self.mask[first : first + n, i]
        else:  # wrapped: oldest part at the end of the ring, newest at its start
            rest = first + n - self.capacity
            rows = np.concatenate([self.values[first:, i], self.values[:rest, i]])
            mask = np.concatenate([self.mask[first:, i], self.mask[:rest, i]])
        out = rows if mask.all() else rows[mask]
        out.flags.writeable = False
        return out

    def history_index(self, vector: str, last: int) -> tuple[list[float], list[int]]:
        """The last steps and row ids of the reports :meth:`history` gives for the same arguments
        (a few rows: plain lists)."""
        i = _VECTOR_INDEX[vector]
        n = min(last, self.count, self.capacity)
        if n < 1 or vector not in self.seen:
            return [], []
        first = (self.count - n) % self.capacity
        rows = list(range(first, min(first + n, self.capacity))) + list(range(0, first + n - self.capacity))
        if self.absent_at[i] > self.count - n:  # some of them lacked it
            rows = [r for r in rows if self.mask[r, i]]
        return [self.steps[r] for r in rows], [self.ids[r] for r in rows]

    def values_of(self, vector: str, ids: list[int]) -> np.ndarray:
        """``vector`` of the rows ``ids`` (held ones, as :meth:`history_index` gave them), shape
        (len(ids), world_size)."""
        rows = [self.ids.index(x) for x in ids]
        out = self.values[rows[0]:rows[0] + 1, _VECTOR_INDEX[vector]] if len(rows) == 1 else self.values[rows, _VECTOR_INDEX[vector]]
        out.flags.writeable = False
        return out

    def rows(self, after: int = 0) -> list[tuple[int, dict[str, list[float]]]]:
        """The vectors of reports after sequence number ``after`` still held, oldest first, as
        ``(seq, {vector: one value per rank})``, only those as received."""
        n = min(self.count, self.capacity)
        out = []
        for k in range(self.count - n, self.count):
            row = k % self.capacity
            seq = int(self.seq[row])
            if seq > after:
                mask = self.shown[row]
                out.append((seq, {name: self.values[row, i].tolist() for i, name in enumerate(VECTORS) if mask[i]}))
        return out

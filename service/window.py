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
from array import array
from typing import Any, Protocol

import numpy as np

from trainguard.protocol.rank_vector import Filled
from trainguard.protocol.wire import RankValues, Report
from trainguard.service.rank_ring import VECTORS, RankRing

__all__ = ["VECTORS", "RuleWindow", "RunWindow"]

_EMPTY = np.empty(0)
_EMPTY.flags.writeable = False


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

    def rank_history_index(self, vector: str, last: int) -> tuple[list[float], list[int]]:
        """The last step and the row id of each report :meth:`rank_history` gives for the same
        arguments; a row id names one row's values for as long as the process runs."""

    def rank_values_of(self, vector: str, ids: list[int]) -> np.ndarray:
        """The per-rank ``vector`` of the rows ``ids`` (held ones), shape (len(ids), world)."""

    @property
    def vectors_seen(self) -> "set[str] | frozenset[str]":
        """The per-rank vectors any report in this history carried (``rank_history`` of any other
        is empty)."""


class RunWindow:
    """Ring buffers holding the newest ``capacity`` reports of one run.

    Job-level values live in a (capacity, columns) float64 matrix with a presence mask (a value
    absent from a report is not NaN: NaN is a real value). Per-rank vectors live in a smaller ring
    of (rank_capacity, len(VECTORS), world_size) (:class:`~service.rank_ring.RankRing`).

    The values ring is stored twice, one copy after the other (row ``i`` and row ``i + capacity``
    hold the same report), so the newest ``n`` reports are always one contiguous slice, oldest
    first: rules read views of the buffer instead of gathering up to ``capacity`` rows by index
    (five series reads per report with the default rules). The second copy costs one more store
    per value on append and ~35 KB per run with the default capacity. The per-rank ring, read a
    few rows at a time but large (world_size columns), is stored once.
    """

    __slots__ = (
        "capacity", "count", "columns", "_values", "_present", "_values2", "_present2", "_received", "_step", "_ring",
        "_last_received", "_written", "_keys", "_cols", "desync", "_absent_at", "_absent_cols",
    )

    def __init__(self, *, capacity: int, rank_capacity: int, world_size: int, created: float) -> None:
        if capacity < 1 or rank_capacity < 1 or world_size < 1:
            raise ValueError("capacity, rank_capacity and world_size must be >= 1")
        self.capacity = capacity
        self.count = 0
        """Reports appended since creation (also the sequence number of the newest)."""
        self._written = 0
        """Reports appended to this object (``count`` may start higher: a reload sets it)."""
        #: The newest report's ``desync`` list (layers whose fingerprints differ across ranks).
        self.desync: tuple[Any, ...] = ()
        self.columns: dict[str, int] = {}
        self._absent_at: list[int] = []
        """Per column, the sequence number of the newest report that lacked it (an upper bound
        after a rollback): the newest ``n`` reports all carry the column when it is <= count - n,
        which spares :meth:`series` a pass over the presence mask."""
        self._absent_cols: list[int] = []  # the columns the last appended report lacked
        self._set_values(np.full((2, capacity, 16), math.nan), np.zeros((2, capacity, 16), dtype=bool))
        self._received = np.zeros(capacity)
        self._step = np.zeros(capacity, dtype=np.int64)
        self._ring = RankRing(rank_capacity, world_size)
        self._last_received = created
        self._keys: tuple[str, ...] = ()
        """Metric names of the last report appended, and their columns (reports of a run usually
        carry the same names in the same order: the lookup is done once)."""
        self._cols = np.empty(0, dtype=np.intp)

    # Writes go to both copies through the (2, capacity, columns) arrays; reads slice the
    # (2 * capacity, columns) views of the same memory.
    def _set_values(self, values2: np.ndarray, present2: np.ndarray) -> None:
        self._values2, self._present2 = values2, present2
        self._values = values2.reshape(2 * self.capacity, -1)
        self._present = present2.reshape(2 * self.capacity, -1)

    # -- writing ---------------------------------------------------------------------------
    def _column(self, name: str) -> int:
        col = self.columns.get(name)
        if col is None:
            col = len(self.columns)
            if col == self._values.shape[1]:
                grow = (2, self.capacity, self._values.shape[1])
                self._set_values(np.concatenate([self._values2, np.full(grow, math.nan)], axis=2),
                                 np.concatenate([self._present2, np.zeros(grow, dtype=bool)], axis=2))
            self.columns[name] = col
            self._absent_at.append(self.count)  # the reports so far lack it
        return col

    def append(self, report: Report, received: float) -> None:
        """Add ``report``, received at controller time ``received``; overwrites the oldest."""
        self.append_raw(report.values, rank_vectors(report.ranks), report.step_last, received)
        self.desync = tuple(report.desync)

    def append_raw(
        self, values: dict[str, float], ranks: dict[str, np.ndarray], step_last: int, received: float
    ) -> None:
        """Add one report given as plain values (also used to reload persisted reports)."""
        row = self.count % self.capacity
        keys = tuple(values)
        if keys != self._keys:
            cols = [self._column(name) for name in keys]
            self._cols = np.array(cols, dtype=np.intp)
            self._keys = keys
            carried = set(cols)
            self._absent_cols = [c for c in range(len(self.columns)) if c not in carried]
        self._present2[:, row] = False
        self._values2[:, row, self._cols] = list(values.values())
        self._present2[:, row, self._cols] = True
        self._received[row] = received
        self._step[row] = step_last
        self.count += 1
        for c in self._absent_cols:
            self._absent_at[c] = self.count
        self._written += 1
        self._last_received = received
        if ranks:
            self._ring.append(ranks, self.count, float(step_last))

    def append_many(self, values: list[dict[str, float]], steps: list[int], received: list[float]) -> None:
        """:meth:`append_raw` of each report in turn, without per-rank vectors (reports read back
        from the database, oldest first), in one pass over the arrays instead of one per report:
        the window ends exactly as the appends one by one would leave it."""
        cap = self.capacity
        if len(values) > cap:  # in passes that write each row once
            self.append_many(values[:-cap], steps[:-cap], received[:-cap])
            values, steps, received = values[-cap:], steps[-cap:], received[-cap:]
        n = len(values)
        if not n:
            return
        count0 = self.count
        # the columns in the order the appends would add them
        groups: dict[tuple[str, ...], list[int]] = {}
        for j, v in enumerate(values):
            keys = tuple(v)
            if keys not in groups:
                groups[keys] = []
                self.count = count0 + j  # a column new here was lacked by the reports before it (_column)
                for name in keys:
                    self._column(name)
            groups[keys].append(j)
        ncols = len(self.columns)
        lacking = np.full(ncols, -1, dtype=np.int64)  # per column, the newest report (index) without it
        rows = (count0 + np.arange(n)) % cap
        vals = self._values2[0, rows].copy()
        present = np.zeros(vals.shape, dtype=bool)
        for keys, js in groups.items():
            cols = np.array([self.columns[k] for k in keys], dtype=np.intp)
            missing = np.ones(ncols, dtype=bool)
            missing[cols] = False
            lacking[missing] = np.maximum(lacking[missing], js[-1])
            vals[np.ix_(js, cols)] = [list(values[j].values()) for j in js]
            present[np.ix_(js, cols)] = True
        for c in np.flatnonzero(lacking >= 0):
            self._absent_at[c] = max(self._absent_at[c], count0 + int(lacking[c]) + 1)
        self._values2[:, rows] = vals
        self._present2[:, rows] = present
        self._received[rows] = received
        self._step[rows] = steps
        last = tuple(values[-1])
        self._keys, self._cols = last, np.array([self.columns[k] for k in last], dtype=np.intp)
        carried = set(self._cols.tolist())
        self._absent_cols = [c for c in range(ncols) if c not in carried]
        self.count = count0 + n
        self._written += n
        self._last_received = received[-1]

    def save_next(self, *, ranks: bool) -> tuple[Any, ...]:
        """What the next :meth:`append_raw` (with per-rank ``ranks`` or not) overwrites, for
        :meth:`rollback`."""
        row = self.count % self.capacity
        rank_row = self._ring.save_next() if ranks else None
        return (self.count, self._ring.count, self._last_received, self._values2[:, row].copy(),
                self._present2[:, row].copy(), self._received[row], self._step[row], rank_row)

    def rollback(self, saved: tuple[Any, ...]) -> bool:
        """Take back the append made right after :meth:`save_next` returned ``saved`` (its report
        could not be stored). Only the newest append can be taken back: False if another came
        after it (group commits fail as a whole and are taken back newest first)."""
        count, rank_count, last_received, values, present, received, step, rank_row = saved
        if self.count != count + 1:
            return False
        row, n = count % self.capacity, values.shape[1]
        self._values2[:, row, :n], self._values2[:, row, n:] = values, math.nan
        self._present2[:, row, :n], self._present2[:, row, n:] = present, False
        self._received[row], self._step[row] = received, step
        self._ring.rollback(rank_count, rank_row)
        self.count, self._last_received = count, last_received
        return True

    def restarted(self) -> "RunWindow":
        """A window without the reports held here, its sequence numbers carrying on from
        :attr:`count`: for a run whose restarted job went back to an earlier step (it resumed
        from an older checkpoint), whose reports held here are of steps it will take again."""
        fresh = RunWindow(capacity=self.capacity, rank_capacity=self._ring.capacity, world_size=self._ring.world_size,
                          created=self._last_received)
        fresh.count = self.count
        return fresh

    def resize_world(self, world_size: int) -> None:
        """A re-registration with another world size: drop the per-rank history only."""
        if world_size != self._ring.world_size:
            self._ring = RankRing(self._ring.capacity, world_size)

    def touch(self, received: float) -> None:
        """Move the last report's time forward (to a report the database no longer holds)."""
        self._last_received = max(self._last_received, received)

    # -- RuleWindow ------------------------------------------------------------------------
    @property
    def rank_capacity(self) -> int:
        """Reports whose per-rank vectors the window holds."""
        return self._ring.capacity

    @property
    def size(self) -> int:
        return min(self.count, self.capacity)

    @property
    def last_received(self) -> float:
        return self._last_received

    @property
    def last_step(self) -> int | None:
        return int(self._step[(self.count - 1) % self.capacity]) if self.count else None

    def latest(self, metric: str) -> float | None:
        col = self.columns.get(metric)
        if col is None or not self.count:
            return None
        row = (self.count - 1) % self.capacity
        return float(self._values[row, col]) if self._present[row, col] else None

    def series(self, metric: str, last: int) -> np.ndarray:
        col = self.columns.get(metric)
        if col is None or not self.count or last < 1:
            return _EMPTY
        end = (self.count - 1) % self.capacity + self.capacity + 1
        n = min(last, self.size)
        start = end - n
        if self._absent_at[col] <= self.count - n:  # the common case: every recent report carries it
            out = self._values[start:end, col]
        else:  # reports may skip a metric: take the newest ``last`` rows that carry it
            start = end - self.size
            out = self._values[start:end, col][self._present[start:end, col]][-last:]
        out.flags.writeable = False
        return out

    def rank_history(self, vector: str, last: int) -> np.ndarray:
        return self._ring.history(vector, last)

    def rank_history_index(self, vector: str, last: int) -> tuple[list[float], list[int]]:
        return self._ring.history_index(vector, last)

    def rank_values_of(self, vector: str, ids: list[int]) -> np.ndarray:
        return self._ring.values_of(vector, ids)

    @property
    def vectors_seen(self) -> set[str]:
        return self._ring.seen

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


    # -- reading for people (the console) ----------------------------------------------------------
    def rows(self, after: int = 0) -> list[tuple[int, int, float, dict[str, float]]]:
        """The reports appended after sequence number ``after`` that the window still holds, oldest
        first, as ``(seq, step_last, received, values)``; ``seq`` counts from 1 and ``values`` holds
        only the metrics that report carried (NaN stays NaN)."""
        first = max(after, self.count - min(self._written, self.capacity)) + 1
        names = list(self.columns.items())
        out = []
        for seq in range(first, self.count + 1):
            row = (seq - 1) % self.capacity
            values, present = self._values[row], self._present[row]
            out.append((seq, int(self._step[row]), float(self._received[row]),
                        {name: float(values[col]) for name, col in names if present[col]}))
        return out

    def rank_rows(self, after: int = 0) -> list[tuple[int, dict[str, list[float]]]]:
        """The per-rank vectors of reports after sequence number ``after`` still held, oldest first,
        as ``(seq, {vector: one value per rank})``; ``seq`` is the report's, as in :meth:`rows`.
        A vector the controller read back from a stored summary (a large world's older report,
        after a restart) is left out: only the values as received are shown."""
        return self._ring.rows(after)


def rank_vectors(ranks: RankValues) -> dict[str, np.ndarray]:
    """The non-empty per-rank vectors of a report as float64 arrays: JSON lists (older agents)
    converted together, packed ones (``trainguard.protocol.rank_vector``) through their buffers,
    without a Python float per rank."""
    out: dict[str, np.ndarray] = {}
    lists = {}
    for name in VECTORS:
        vec = getattr(ranks, name)
        if not len(vec):
            continue
        if isinstance(vec, Filled):
            out[name] = np.full(len(vec), vec.value)
        elif isinstance(vec, array):
            out[name] = np.frombuffer(vec, dtype=np.float32 if vec.typecode == "f" else np.float64).astype(np.float64)
        else:
            lists[name] = vec
    if len({len(vec) for vec in lists.values()}) == 1:  # (older agents) one conversion for all
        out.update(zip(lists, np.array(list(lists.values()), dtype=np.float64)))
    else:
        out.update((name, np.asarray(vec, dtype=np.float64)) for name, vec in lists.items())
    return {name: out[name] for name in VECTORS if name in out}

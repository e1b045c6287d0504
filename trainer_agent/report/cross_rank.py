"""The leader's cross-rank work of a published report, off the training thread
(``trainer_agent/report/pipeline.py`` publishes; this module resolves): :class:`RankVectors`, the per-rank
vectors made once from the host copy of the gathered rows (the ``RANK_FIELDS`` columns, the
fingerprint findings of ``trainer_agent/measure/fingerprint.py``, the data overlap of
``trainer_agent/measure/sketch.py``), and :class:`CrossRankWorker`, the daemon thread that resolves them
and hands each report on (the controller's report), never making the training thread wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from trainer_agent.measure.fingerprint import DesyncFinding
from trainer_agent.report.exchange import RANK_FIELDS, RankExchange

__all__ = ["CrossRankWorker", "Decode", "LightRankVectors", "RankVectors", "MAX_QUEUED", "LIGHT_QUEUED"]

log = logging.getLogger(__name__)

#: The leader's published reports waiting for the cross-rank worker with their whole cross-rank
#: work; beyond that the oldest runs its light form instead (the report sent without the
#: comparisons that grow with the world), and only past ``LIGHT_QUEUED`` more is one dropped
#: (counted): the training thread never waits for the worker.
MAX_QUEUED = 8
LIGHT_QUEUED = 64

#: (the fingerprint comparison's host vector, the rows' RANK_FIELDS matrix) -> (vectors, findings)
Decode = Callable[[np.ndarray, np.ndarray], tuple[dict[str, list[float]], list[DesyncFinding]]]


class RankVectors(Mapping[str, list[float]]):
    """The leader's per-rank vectors of one published report, ``{field: [rank 0, rank 1, ...]}``:
    the ``RANK_FIELDS`` columns, the fingerprint vectors and ``data_overlap``, made from the host
    copy of the gathered rows once, on first use (thread-safe: the cross-rank worker resolves it;
    any other reader waits for that or resolves it itself). ``desync``: the layers whose
    fingerprints differ. ``matrix``: the rows as they arrived, (world, RANK_FIELDS) float64."""

    def __init__(self, matrix: np.ndarray, *, sketches: np.ndarray | None = None,
                 compared: np.ndarray | None = None, decode: Decode | None = None,
                 compare: Callable[[], torch.Tensor] | None = None, absent: tuple[str, ...] = ()) -> None:
        """``compared``: the fingerprint comparison's host vector, or ``compare``: what makes it
        (at resolution); ``decode``: its findings; ``absent``: the fields whose vectors are empty
        (``exchange.absent_vectors``: the report lacks their metric)."""
        self.matrix, self.absent = matrix, absent
        self._sketches, self._compared, self._decode, self._compare = sketches, compared, decode, compare
        self._lock = threading.Lock()
        self._vectors: dict[str, list[float]] | None = None
        self._desync: list[DesyncFinding] = []

    @property
    def world(self) -> int:
        return self.matrix.shape[0]

    def column(self, name: str) -> np.ndarray:
        """One ``RANK_FIELDS`` column (a view of :attr:`matrix`, no resolution)."""
        return self.matrix[:, RANK_FIELDS.index(name)]

    def resolve(self) -> dict[str, list[float]]:
        """The vectors (computed on the first call, by whichever thread makes it)."""
        with self._lock:
            if self._vectors is None:
                vectors = RankExchange.unpack_rows(self.matrix, self.world, self.absent)
                if self._compare is not None:
                    self._compared = self._compare().cpu().numpy()
                if self._decode is not None and self._compared is not None:
                    found, self._desync = self._decode(self._compared, self.matrix)
                    vectors.update(found)
                if self._sketches is not None:
                    overlap = RankExchange.data_overlap(self._sketches)
                    if overlap is not None:
                        vectors["data_overlap"] = overlap
                self._vectors = vectors
                self._sketches = self._compared = self._compare = None  # done with them
            return self._vectors

    @property
    def desync(self) -> list[DesyncFinding]:
        """Layers whose fingerprints differ across ranks by more than the tolerance (worst first)."""
        self.resolve()
        return self._desync

    def light(self) -> "LightRankVectors":
        """The ``RANK_FIELDS`` columns alone (no data overlap, no fingerprint comparison: NaN in
        the report, which the rules read as no verdict): what the leader sends when its
        cross-rank worker falls behind."""
        with self._lock:
            if self._vectors is not None:
                return LightRankVectors(self._vectors, self._desync)
        return LightRankVectors(RankExchange.unpack_rows(self.matrix, self.world, self.absent), [])

    def __getitem__(self, key: str) -> list[float]:
        return self.resolve()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.resolve())

    def __len__(self) -> int:
        return len(self.resolve())


class CrossRankWorker:
    """The leader's daemon thread for the cross-rank work of its published reports: runs the jobs
    :meth:`submit` queues, oldest first, off the training thread. At most ``max_queued`` wait
    whole; beyond that the oldest whole job is replaced by its ``light`` form (``lightened``,
    logged once: e.g. the report sent with its per-rank columns but without the overlaps and the
    fingerprint comparison, so that a NaN it carries still reaches the controller), and a job
    without one, or past ``light_queued`` light jobs, is dropped (``dropped``, logged once). A
    job's exception is logged and passed to ``on_error``; the next job runs."""

    def __init__(self, name: str = "trainguard-ranks", *, max_queued: int = MAX_QUEUED,
                 light_queued: int = LIGHT_QUEUED,
                 on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self.name, self.max_queued, self.light_queued, self.on_error = name, max_queued, light_queued, on_error
        self.dropped = 0
        self.lightened = 0
        # [job, light] per queued report, oldest first; the light ones (light None) form a prefix
        # of ``_light`` entries, since the oldest whole job is always the one made light.
        self._jobs: deque[list[Any]] = deque()
        self._light = 0
        self._cond = threading.Condition()
        self._busy = False
        self._closing = False
        self._thread: threading.Thread | None = None
        # Objects handed over by release(), dropped here when a later job is taken
        self._garbage: deque[Any] = deque()

    def release(self, obj: Any) -> None:
        """Have the worker drop ``obj`` (never waits). A resolved report's per-rank vectors hold
        a Python float per rank and field: at 32,768 ranks, freeing them and the gathered rows
        costs ~5 ms of CPU, which must not land on the training thread. The newest object handed
        over is kept until the next one arrives, so the caller's own last reference has surely
        gone before the worker drops it (:meth:`_run`)."""
        with self._cond:
            if not self._closing:
                self._garbage.append(obj)
            stale = self._garbage.popleft() if len(self._garbage) > 2 else None  # no job came to drop them
        del stale

    def submit(self, job: Callable[[], None], light: Callable[[], None] | None = None) -> None:
        """Queue ``job`` (never waits), with ``light``: what to run instead should the queue
        overflow before its turn. Starts the thread on first use."""
        with self._cond:
            if self._closing:
                return
            if len(self._jobs) - self._light >= self.max_queued:
                oldest = self._jobs[self._light]
                if oldest[1] is not None:
                    oldest[0], oldest[1] = oldest[1], None
                    self._light += 1
                    self.lightened += 1
                    if self.lightened == 1:
                        log.warning("trainguard: the leader's cross-rank work falls behind the reports; the "
                                    "oldest waiting report goes without its cross-rank comparisons (data overlap, "
                                    "fingerprints): reports come faster than %s can resolve them", self.name)
                else:
                    del self._jobs[self._light]
                    self._drop()
            if self._light > self.light_queued:
                self._jobs.popleft()
                self._light -= 1
                self._drop()
            self._jobs.append([job, light])
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _drop(self) -> None:
        self.dropped += 1
        if self.dropped == 1:
            log.warning("trainguard: the leader's cross-rank work falls behind the reports; the oldest waiting "
                        "report is dropped (reports come faster than %s can send them)", self.name)

    def flush(self, timeout: float | None = None, *, stop: bool = False) -> bool:
        """Wait until every queued job has run (at most ``timeout`` s); with ``stop``, then end
        the thread (later submissions are ignored). True when nothing was left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            done = not (self._jobs or self._busy)
            if stop:
                self._closing = True
                self._jobs.clear()
                self._garbage.clear()
                self._light = 0
                self._cond.notify_all()
            return done

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._jobs or self._closing):
                    self._cond.wait()
                if not self._jobs:
                    self._garbage.clear()
                    return
                job = self._jobs.popleft()[0]
                if self._light:
                    self._light -= 1
                self._busy = True
                garbage = [self._garbage.popleft() for _ in range(len(self._garbage) - 1)]
            garbage.clear()  # freed here, off the training thread (see release)
            try:
                job()
            except Exception as exc:  # noqa: BLE001 - one report's failure must not stop the next
                if self.on_error is not None:
                    self.on_error("cross_rank", exc)
                else:
                    log.warning("trainguard: cross-rank work of a report failed: %r", exc)
            finally:
                job = None  # noqa: F841 - holds the report (and the agent) no longer than it runs
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class LightRankVectors(dict):
    """Per-rank vectors of a report sent without its cross-rank comparisons (``RankVectors.light``)."""

    def __init__(self, vectors: Mapping[str, list[float]], desync: list[DesyncFinding]) -> None:
        super().__init__(vectors)
        self.desync = desync

"""The loader of a sharded token dataset (``trainer_agent/data/sharded_dataset.py``: its order,
resume and quarantine): :class:`TokenLoader` iterates a ``TokenBatches`` through a ``DataLoader``
and a prefetch thread, keeps its position for a resume, and the skip list of quarantined samples."""

from __future__ import annotations
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping


from typing import Any
import numpy as np
import torch
from torch.utils.data import DataLoader


from trainer_agent.data.sharded_dataset import TokenBatches

__all__ = ["TokenLoader"]


_END = object()


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class TokenLoader:
    """Iterates a :class:`TokenBatches` through a ``DataLoader`` (``num_workers`` processes) and
    a prefetch thread that keeps up to ``prefetch`` batches ready (in pinned memory when CUDA is
    available: the ``DataLoader``'s ``pin_memory``). Iterating yields the batches of the current
    epoch from the current position; a completed pass moves to the next epoch. Breaking out of
    the loop keeps the position (the batches received so far).

    ``values()`` gives the reader's metrics (host values; safe from another thread):
    ``trainguard_input_prefetch_depth`` and ``trainguard_input_tokens_per_second``.
    """

    def __init__(self, dataset: TokenBatches, *, num_workers: int = 2, prefetch: int = 8,
                 pin_memory: bool | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        if not isinstance(dataset, TokenBatches):
            raise ValueError(f"dataset must be a TokenBatches, got {type(dataset).__name__}")
        if type(num_workers) is not int or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        if type(prefetch) is not int or prefetch < 1:
            raise ValueError(f"prefetch must be an integer >= 1, got {prefetch!r}")
        self.dataset = dataset
        self.num_workers = num_workers
        self.prefetch = prefetch
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self._clock = clock
        self.epoch = 0
        self.batch = 0
        self._last: tuple[int, int] | None = None  # (epoch, batch) the training loop received last
        self._queue: queue.Queue[Any] | None = None
        self._tokens = 0
        self._rate = (clock(), 0)  # (time, tokens) at the last values() call
        self._tokens_per_second = float("nan")
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.dataset.batches_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch at the next iteration."""
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"epoch must be an integer >= 0, got {epoch!r}")
        self.epoch, self.batch = epoch, 0

    def quarantine(self, ids: Iterable[int]) -> None:
        """Leave the samples ``ids`` (global sequence numbers) out of every batch from the next
        pass on, and after a resume (module docstring). ``ValueError`` for a number outside the
        data set."""
        new = {int(i) for i in ids}
        if new and (min(new) < 0 or max(new) >= self.dataset.sequences):
            raise ValueError(f"sequence numbers must lie in [0, {self.dataset.sequences})")
        with self._lock:
            self.dataset.skip = self.dataset.skip | new

    def quarantine_last(self) -> list[int]:
        """Quarantine the samples of the batch the training loop received last; returns them."""
        last = self._last
        if last is None:
            return []
        ids = self.dataset.sequence_ids(*last).tolist()
        self.quarantine(ids)
        return ids

    def located_last(self) -> dict[str, list[int]]:
        """Where the samples of the batch the training loop received last lie, on every rank
        (``{shard base path: [index in the shard]}``): each rank's loader is at the same batch of
        the same epoch, so one rank can name them all; empty before the first batch."""
        last = self._last
        if last is None:
            return {}
        ds = self.dataset
        positions = (last[1] * ds.batch_size + np.arange(ds.batch_size, dtype=np.int64)) * ds.world_size
        everywhere = (positions[:, None] + np.arange(ds.world_size, dtype=np.int64)[None, :]).ravel()
        return ds.locate(ds.order(last[0])(everywhere).tolist())

    def quarantined(self) -> dict[str, list[int]]:
        """The quarantined samples by shard: ``{shard base path: [index in the shard]}``."""
        return self.dataset.locate(self.dataset.skip)

    def state_dict(self) -> dict[str, Any]:
        """The position: epoch and batches received in it (plus what must match to resume), and
        the quarantined samples."""
        ds = self.dataset
        return {"version": 1, "epoch": self.epoch, "batch": self.batch, "seed": ds.seed,
                "rank": ds.rank, "world_size": ds.world_size, "batch_size": ds.batch_size,
                "sequences": ds.sequences, "skip": sorted(ds.skip)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at ``state``'s position. ``ValueError`` for a foreign dict or one saved with
        another seed, rank, world size, batch size or data set."""
        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise ValueError("not a TokenLoader state dict (version 1)")
        ds = self.dataset
        expected = {"seed": ds.seed, "rank": ds.rank, "world_size": ds.world_size,
                    "batch_size": ds.batch_size, "sequences": ds.sequences}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(f"loader state has {key}={state.get(key)!r}, this loader {value!r}")
        epoch, batch = state.get("epoch"), state.get("batch")
        if type(epoch) is not int or epoch < 0 or type(batch) is not int or not 0 <= batch <= ds.batches_per_epoch:
            raise ValueError(f"loader state has an invalid position: epoch {epoch!r}, batch {batch!r}")
        skip = state.get("skip", [])
        if not isinstance(skip, (list, tuple)) or any(type(i) is not int or not 0 <= i < ds.sequences for i in skip):
            raise ValueError(f"loader state has an invalid skip list (sequence numbers in [0, {ds.sequences}))")
        self.epoch, self.batch = epoch, batch
        ds.skip = frozenset(skip)

    def values(self) -> dict[str, float]:
        """``trainguard_input_prefetch_depth`` (batches ready now) and
        ``trainguard_input_tokens_per_second`` (tokens received since the previous call divided by
        the time since; absent before a second call)."""
        now = self._clock()
        with self._lock:
            tokens = self._tokens
            last_t, last_tokens = self._rate
            if now > last_t:
                self._tokens_per_second = (tokens - last_tokens) / (now - last_t)
                self._rate = (now, tokens)
            rate = self._tokens_per_second
        q = self._queue
        out = {"trainguard_input_prefetch_depth": float(q.qsize()) if q is not None else 0.0}
        if rate == rate:
            out["trainguard_input_tokens_per_second"] = rate
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self.batch >= self.dataset.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0
        ds = self.dataset
        ds.epoch, ds.start = self.epoch, self.batch
        loader = DataLoader(ds, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                            prefetch_factor=max(1, self.prefetch // max(self.num_workers, 1)) if self.num_workers else None)
        q: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def fill() -> None:
            try:
                for item in loader:
                    if not put(item):
                        return
                put(_END)
            except BaseException as exc:  # handed to the training loop, which raises it
                put(_Failed(exc))

        thread = threading.Thread(target=fill, name="trainguard-token-loader", daemon=True)
        self._queue = q
        thread.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    break
                if isinstance(item, _Failed):
                    raise item.exc
                with self._lock:
                    self._last = (self.epoch, self.batch)
                    self.batch += 1
                    self._tokens += item["tokens"]
                yield item
            self.epoch, self.batch = self.epoch + 1, 0
        finally:
            stop.set()
            thread.join(timeout=10.0)
            self._queue = None

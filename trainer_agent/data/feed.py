"""``DataFeed``: feeds a ``DataMonitor`` from the training loop off the step (worker thread)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import numpy as np
import torch

from trainer_agent.data.monitor import DataMonitor
from trainer_agent.data.settings import int_setting

_LOG = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Background feeding for the training loop.


class DataFeed:
    """Feeds a ``DataMonitor`` from the training loop without ever syncing the step or raising.

        feed = DataFeed(monitor, max_pending=16)
        for input_ids, attention_mask in loader:        # inside the training step
            feed.submit(input_ids, attention_mask)      # returns at once; never raises
            ...
        feed.values()            # at the report interval: the monitor's values
        feed.errors, feed.dropped
        feed.close(timeout=1.0)  # at shutdown

    Design:
    * ``submit`` on a CUDA tensor allocates a pinned host buffer (PyTorch's caching host
      allocator), enqueues ``copy_(non_blocking=True)`` on the current stream and records a CUDA
      event after it. Nothing waits on the device in the caller's thread: the copy is ordered on the
      stream with the step's kernels. The daemon worker thread waits on the event
      (``event.synchronize()``, which blocks only the worker) and then runs the numpy work of the
      monitor. CPU tensors and arrays are copied (cheap, and safe against loaders that reuse their
      buffers).
    * The queue is bounded (``max_pending`` batches). When it is full the batch is dropped and
      counted in ``dropped``: the monitor sees a sample of the stream, the step never waits.
    * Any exception (``ValueError`` for an empty batch or an id outside the vocabulary, or anything
      else) is counted in ``errors`` and logged once per exception type; it never reaches the caller.
    * ``flush(timeout)`` waits until every batch submitted before the call is processed (for tests
      and report steps); ``close(timeout)`` stops the worker within the deadline. The worker is a
      daemon thread, so it never keeps the process from exiting.
    """

    def __init__(self, monitor: DataMonitor, *, max_pending: int = 16,
                 logger: logging.Logger | None = None) -> None:
        max_pending = int_setting("max_pending", max_pending)
        self.monitor = monitor
        self.errors = 0
        self.dropped = 0
        self._log = logger or _LOG
        self._logged: set[type[BaseException]] = set()
        self._queue: queue.Queue[tuple[Any, Any, Any] | None] = queue.Queue(maxsize=max_pending)
        self._cond = threading.Condition()
        self._submitted = 0  # accepted into the queue
        self._done = 0       # processed (successfully or not)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="trainguard-data-feed", daemon=True)
        self._thread.start()

    def submit(self, input_ids: Any, attention_mask: Any = None) -> bool:
        """Hand a batch to the worker; False when it was dropped (queue full, closed) or failed."""
        if self._closed:
            self.dropped += 1
            return False
        try:
            item = (*self._stage(input_ids, attention_mask),)
        except Exception as exc:  # never raise into the training loop
            self._count_error(exc)
            return False
        with self._cond:
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.dropped += 1
                return False
            self._submitted += 1
        return True

    @staticmethod
    def _stage(input_ids: Any, attention_mask: Any) -> tuple[Any, Any, Any]:
        event = None
        staged = []
        for x in (input_ids, attention_mask):
            if isinstance(x, torch.Tensor) and x.is_cuda:
                host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                # No host-device sync: an asynchronous device-to-pinned-host copy on the current
                # stream; the worker waits on the event recorded after it.
                host.copy_(x.detach(), non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                staged.append(host)
            elif isinstance(x, torch.Tensor):
                staged.append(x.detach().clone())
            elif isinstance(x, np.ndarray):
                staged.append(x.copy())
            else:
                staged.append(x)
        return staged[0], staged[1], event

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ids, mask, event = item
            try:
                if event is not None:
                    event.synchronize()  # blocks this worker thread only, until the copy landed
                self.monitor.observe_batch(ids, mask)
            except Exception as exc:
                self._count_error(exc)
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()
            if self._closed and self._queue.empty():
                return  # closed while the queue was full (no room for the stop signal): drained

    def _count_error(self, exc: Exception) -> None:
        with self._cond:  # the training thread (staging) and the worker both count
            self.errors += 1
        if type(exc) not in self._logged:
            self._logged.add(type(exc))
            self._log.warning("trainguard data monitor: batch skipped (%s: %s); further %s are counted, "
                              "not logged", type(exc).__name__, exc, type(exc).__name__)

    def values(self) -> dict[str, float]:
        """The monitor's values (batches still queued are not in them; ``flush`` first if needed)."""
        return self.monitor.values()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every batch submitted before this call is processed; False on timeout."""
        with self._cond:
            target = self._submitted
            return self._cond.wait_for(lambda: self._done >= target or not self._thread.is_alive(),
                                       timeout)

    def close(self, timeout: float | None = 1.0) -> bool:
        """Stop the worker after the queued batches; True when it stopped within ``timeout`` (in
        all: the hand-off of the stop signal and the wait share it)."""
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()



"""DataFeed.close with a full queue (the monitor is behind) must not leave the worker thread
alive for ever: it stops once it has drained what was queued."""

from __future__ import annotations

import threading
import time

import torch

from trainer_agent.data import DataFeed


class _SlowMonitor:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen = 0

    def observe_batch(self, input_ids, attention_mask=None) -> None:  # type: ignore[no-untyped-def]
        self.release.wait(10)
        self.seen += 1

    def values(self) -> dict[str, float]:
        return {}


def test_close_with_a_full_queue_still_stops_the_worker() -> None:
    monitor = _SlowMonitor()
    feed = DataFeed(monitor, max_pending=1)  # type: ignore[arg-type]
    assert feed.submit(torch.ones(2, 3, dtype=torch.long))
    deadline = time.monotonic() + 5
    while feed._queue.qsize() and time.monotonic() < deadline:  # the worker took the first batch
        time.sleep(0.01)
    assert feed.submit(torch.ones(2, 3, dtype=torch.long))  # queued: the queue is now full
    t0 = time.monotonic()
    assert feed.close(timeout=0.2) is False  # no room for the stop signal within the deadline
    assert time.monotonic() - t0 < 1.0
    monitor.release.set()
    feed._thread.join(5)
    assert not feed._thread.is_alive()
    assert monitor.seen == 2  # what was queued before close was still observed

"""DataFeed.close with a full queue (the monitor is behind) must not leave the worker thread
alive for ever: it stops once it has drained what was queued."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from trainer_agent.data import DataFeed

pytestmark = pytest.mark.timing


def _taken(feed: DataFeed) -> bool:
    """Wait until the worker took what was queued (it is now inside observe_batch)."""
    deadline = time.monotonic() + 10
    while feed._queue.qsize() and time.monotonic() < deadline:
        time.sleep(0.005)
    return feed._queue.qsize() == 0


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
    assert _taken(feed)  # the worker took the first batch
    assert feed.submit(torch.ones(2, 3, dtype=torch.long))  # queued: the queue is now full
    t0 = time.monotonic()
    assert feed.close(timeout=0.2) is False  # no room for the stop signal within the deadline
    assert time.monotonic() - t0 < 5.0  # the monitor is held for 10 s: a close that waited would last that
    monitor.release.set()
    feed._thread.join(5)
    assert not feed._thread.is_alive()
    assert monitor.seen == 2  # what was queued before close was still observed


class _TimedMonitor:
    """Each batch takes ``seconds`` to observe."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def observe_batch(self, input_ids, attention_mask=None) -> None:  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)

    def values(self) -> dict[str, float]:
        return {}


def test_close_keeps_one_deadline_for_the_hand_off_and_the_wait() -> None:
    feed = DataFeed(_TimedMonitor(2.0), max_pending=1)  # type: ignore[arg-type]
    batch = torch.ones(2, 3, dtype=torch.long)
    assert feed.submit(batch)  # the worker takes it and works 2 s
    assert _taken(feed)
    assert feed.submit(batch)  # queued: the queue is full
    t0 = time.monotonic()
    stopped = feed.close(timeout=3.0)  # the stop signal waits < 2 s for room, then the join
    elapsed = time.monotonic() - t0
    # One deadline for both waits: the second batch ends at ~4 s, after it, so the join gives up
    # at 3 s. A deadline for each wait (< 2 s + 3 s) would see the worker stop at ~4 s instead.
    assert stopped is False
    assert elapsed < 3.0 + 0.9, elapsed

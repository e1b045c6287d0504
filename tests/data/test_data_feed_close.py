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


class _TimedMonitor:
    """Each batch takes ``seconds`` to observe."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def observe_batch(self, input_ids, attention_mask=None) -> None:  # type: ignore[no-untyped-def]
        time.sleep(self.seconds)

    def values(self) -> dict[str, float]:
        return {}


def test_close_keeps_one_deadline_for_the_hand_off_and_the_wait() -> None:
    feed = DataFeed(_TimedMonitor(0.4), max_pending=1)  # type: ignore[arg-type]
    batch = torch.ones(2, 3, dtype=torch.long)
    assert feed.submit(batch)  # the worker takes it and works 0.4 s
    time.sleep(0.05)
    assert feed.submit(batch)  # queued: the queue is full
    t0 = time.monotonic()
    stopped = feed.close(timeout=0.6)  # the stop signal waits ~0.35 s for room, then the join
    elapsed = time.monotonic() - t0
    assert elapsed < 0.6 + 0.15, elapsed  # one deadline, not one for each wait
    assert stopped is False  # the second batch needs until ~0.8 s

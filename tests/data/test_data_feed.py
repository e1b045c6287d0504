"""DataFeed (``trainer_agent/data/feed.py``): background feeding, error counting, flush, and a close
that never leaves the worker thread alive for ever (with a full queue, once the monitor is behind,
it stops once it has drained what was queued)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from trainer_agent.data import DataFeed, DataMonitor


def test_feed_processes_batches_and_counts_errors_without_raising(caplog):
    monitor = DataMonitor(100, window=50)
    feed = DataFeed(monitor, max_pending=64)
    try:
        with caplog.at_level(logging.WARNING, logger="trainer_agent.data"):
            assert feed.submit(torch.tensor([[1, 2, 3], [1, 2, 3]]))
            feed.submit(torch.tensor([[1.0, 2.0]]))       # float ids
            feed.submit(torch.tensor([5, 100]))            # out of vocabulary
            feed.submit(torch.zeros(0, dtype=torch.long))  # empty
            feed.submit(object())                          # not an array at all
            assert feed.submit(torch.tensor([4, 5, 6]), torch.tensor([1, 1, 0]))
            assert feed.flush(timeout=10)
        assert feed.errors == 4
        assert feed.dropped == 0
        v = feed.values()
        assert v["trainguard_data_sequences_total"] == 3.0
        assert v["trainguard_data_tokens_total"] == 8.0
        assert v["trainguard_data_duplicate_ratio"] == pytest.approx(1 / 3)
        # All four are ValueErrors: logged once, counted four times.
        assert sum("batch skipped" in r.message for r in caplog.records) == 1
    finally:
        assert feed.close(timeout=5)


def test_feed_copies_cpu_batches_so_later_mutation_is_not_seen():
    monitor = DataMonitor(100, window=10)
    feed = DataFeed(monitor)
    ids = torch.tensor([[1, 2, 3]])
    feed.submit(ids)
    ids.fill_(99)  # a loader reusing its buffer
    feed.submit(ids)
    assert feed.flush(timeout=10)
    assert monitor.values()["trainguard_data_duplicate_ratio"] == 0.0
    assert feed.close(timeout=5)


class _BlockingMonitor(DataMonitor):
    def __init__(self) -> None:
        super().__init__(100, window=10)
        self.release = threading.Event()

    def observe_batch(self, input_ids, attention_mask=None) -> None:
        self.release.wait(10)
        super().observe_batch(input_ids, attention_mask)


def test_feed_drops_when_full_and_flush_times_out_while_busy():
    monitor = _BlockingMonitor()
    feed = DataFeed(monitor, max_pending=2)
    accepted = sum(feed.submit(torch.tensor([i, i + 1])) for i in range(6))
    # The worker holds at most one batch, the queue two: at least 3 of 6 are dropped, never blocked.
    assert 2 <= accepted <= 3 and feed.dropped == 6 - accepted
    assert not feed.flush(timeout=0.05)
    monitor.release.set()
    assert feed.flush(timeout=10)
    assert monitor.values()["trainguard_data_sequences_total"] == accepted
    assert feed.close(timeout=5)
    assert not feed.submit(torch.tensor([1, 2]))  # closed: dropped, not raised
    with pytest.raises(ValueError):
        DataFeed(monitor, max_pending=0)


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


@pytest.mark.timing
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


@pytest.mark.timing
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


@pytest.mark.parametrize("max_pending", ["4", None, 2.5, True, 0])
def test_a_queue_bound_that_is_not_a_positive_integer_is_a_value_error(max_pending) -> None:
    # "4" and None raised TypeError; 2.5 and True (a queue of one) were taken.
    with pytest.raises(ValueError, match=f"max_pending must be an integer >= 1, got {max_pending!r}"):
        DataFeed(DataMonitor(100), max_pending=max_pending)

"""DataFeed (background feeding, error counting, flush) and dynamic cleaning (schedule, filter)."""

from __future__ import annotations

import logging
import math
import threading

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import trainer_agent
from trainer_agent.data import DataFeed, DataMonitor, DefaultQualityScore, QualityFilter, dynamic_threshold


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


@pytest.mark.parametrize("step", [0, 1, 500, 6931.47, 10_000, 50_000, 1e9])
def test_dynamic_threshold_matches_its_formula(step):
    assert dynamic_threshold(step) == pytest.approx(0.95 - (0.95 - 0.8) * math.exp(-step / 10_000), abs=1e-15)
    assert dynamic_threshold(step, 0.5, 0.9, 100) == pytest.approx(0.9 - 0.4 * math.exp(-step / 100), abs=1e-15)


def test_dynamic_threshold_end_points_and_bad_input():
    assert dynamic_threshold(0) == pytest.approx(0.8)
    assert dynamic_threshold(10_000) == pytest.approx(0.95 - 0.15 / math.e)
    assert trainer_agent.dynamic_threshold is dynamic_threshold
    with pytest.raises(ValueError):
        dynamic_threshold(-1)
    with pytest.raises(ValueError):
        dynamic_threshold(1, decay_steps=0)


def test_quality_filter_follows_the_schedule_and_counts():
    registry = CollectorRegistry()
    scores = [0.85, 0.79, 0.9, float("nan"), 0.97, 0.93]
    filt = QualityFilter(range(len(scores)), score=lambda i: scores[i], registry=registry,
                         labels={"job": "j", "run": "r"})
    assert list(filt) == [0, 2, 4, 5]  # step 0: threshold 0.8; NaN is dropped
    filt.step = 20_000  # threshold 0.95 - 0.15 e^-2 = 0.9297
    assert list(filt) == [4, 5]
    assert (filt.kept, filt.dropped) == (6, 6)
    base = {"job": "j", "run": "r", "rank": "0"}
    assert registry.get_sample_value("trainguard_data_filtered_total", {**base, "decision": "kept"}) == 6
    assert registry.get_sample_value("trainguard_data_filtered_total", {**base, "decision": "dropped"}) == 6
    step = iter([0, 0, 10**9])
    late = QualityFilter([0, 1, 2], score=lambda i: 0.9, current_step=lambda: next(step))
    assert list(late) == [0, 1]


def test_default_score_penalises_duplicates_and_special_tokens():
    score = DefaultQualityScore(special_ids=(0,), window=2)
    a, b, c = [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    assert score(torch.tensor(a)) == 1.0
    assert score({"input_ids": [0, 6, 7, 8]}) == 0.75  # one special token in four
    assert score(np.array(a)) == pytest.approx(0.9)   # duplicate within the window
    assert score(b) == 1.0
    assert score(c) == 1.0
    assert score(a) == 1.0                             # a left the 2-sample window
    padded = {"input_ids": torch.tensor([9, 10, 11, 12, 1]), "attention_mask": torch.tensor([1, 1, 1, 1, 0])}
    assert score(padded) == 1.0  # b left the window too (window holds c, a)
    assert score(padded) == pytest.approx(0.9)
    filt = QualityFilter([a, a, b], score=DefaultQualityScore(duplicate_score=0.9))
    filt.step = 100_000  # threshold ~0.95: the duplicate is dropped
    assert list(filt) == [a, b] and filt.dropped == 1


def test_a_sample_without_a_token_is_dropped_and_counted_not_raised():
    # An empty sample or one that is all padding raised ValueError out of the filter's iteration:
    # the training loop stopped on one bad sample.
    empty, padding = torch.zeros(0, dtype=torch.long), {"input_ids": [3, 4], "attention_mask": [0, 0]}
    a, b = [5, 6, 7], [8, 9]
    filt = QualityFilter([a, empty, padding, b, a], score=DefaultQualityScore(window=10))
    assert list(filt) == [a, b, a]  # step 0: threshold 0.8, the duplicate (0.9) kept
    assert (filt.kept, filt.dropped) == (3, 2)
    score = DefaultQualityScore(pad_id=0)
    assert score([0, 0, 0]) == 0.0 and score([[1, 2], [0, 0]]) == 1.0 and score([1, 2]) == pytest.approx(0.9)


@pytest.mark.parametrize("call, match", [
    (lambda: dynamic_threshold(math.nan), "step"),                     # a NaN threshold dropped every sample
    (lambda: dynamic_threshold(1, decay_steps=math.nan), "decay_steps"),
    (lambda: dynamic_threshold(1, initial=math.nan), "finite"),
    (lambda: DefaultQualityScore(window=5.5), "window"),                # a TypeError
    (lambda: DefaultQualityScore(duplicate_score="0.9"), "duplicate_score"),
    (lambda: QualityFilter([], seed="a"), "seed"),
])
def test_bad_cleaning_settings_are_value_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_numpy_integer_settings_are_taken():
    assert DefaultQualityScore(window=np.int64(3))([1, 2]) == 1.0
    assert list(QualityFilter([[1]], score=lambda s: 1.0, seed=np.int64(3))) == [[1]]

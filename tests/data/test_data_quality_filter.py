"""Dynamic cleaning (``trainer_agent/data/quality_filter.py``): the threshold's schedule, the filter
and its default score, and the per-sample loss feedback (well-learned samples are down-sampled at
the stated rate, the others are untouched, and bad feedback is refused)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

import trainer_agent
from trainer_agent.data import DefaultQualityScore, QualityFilter, dynamic_threshold, sample_identity


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


def _samples(n: int) -> list[dict]:
    return [{"id": i, "input_ids": torch.tensor([i, i + 1, i + 2])} for i in range(n)]


def test_well_learned_samples_are_downsampled_at_the_stated_rate() -> None:
    samples = _samples(4000)
    registry = CollectorRegistry()
    filt = QualityFilter(samples, score=lambda s: 1.0, learned_quantile=0.3, learned_keep=0.25, seed=7,
                         registry=registry)
    # losses: every 4th sample is learned (0.01), the rest are not (1.0 .. 2.0); one NaN
    losses = [0.01 if i % 4 == 0 else 1.0 + (i % 97) / 97 for i in range(4000)]
    losses[8] = math.nan
    filt.record_losses(samples, torch.tensor(losses))
    # independent reference: the 30% quantile of the finite losses
    finite = np.array([v for v in losses if not math.isnan(v)])
    cutoff = np.quantile(finite, 0.3)
    assert filt.learned_cutoff() == pytest.approx(cutoff)
    kept = list(filt)
    kept_ids = {s["id"] for s in kept}
    learned = [i for i in range(4000) if losses[i] < cutoff]  # NaN < x is False
    assert 1000 < len(learned) < 1300
    others = [i for i in range(4000) if i not in set(learned)]
    assert set(others) <= kept_ids  # never learned (sample 8's loss is NaN): always kept
    kept_learned = sum(i in kept_ids for i in learned)
    # binomial(n, 0.25): sd < 16; a generous band of 6 sd
    assert abs(kept_learned - 0.25 * len(learned)) < 96
    assert filt.downsampled == len(learned) - kept_learned and filt.dropped == 0
    base = {"job": "", "run": "", "rank": "0"}
    assert registry.get_sample_value("trainguard_data_filtered_total", {**base, "decision": "downsampled"}) == filt.downsampled
    # the same seed draws the same samples
    again = QualityFilter(samples, score=lambda s: 1.0, learned_quantile=0.3, learned_keep=0.25, seed=7)
    again.record_losses(samples, losses)
    assert [s["id"] for s in again] == [s["id"] for s in kept]


def test_keys_by_content_and_bounded_memory() -> None:
    a, b = [5, 6, 7], [8, 9, 10]
    assert sample_identity(torch.tensor(a)) == sample_identity(np.array(a)) == sample_identity({"input_ids": a})
    assert sample_identity(a) != sample_identity(b)
    filt = QualityFilter([a, b, a], score=lambda s: 1.0, learned_quantile=0.5, learned_keep=0.0, max_tracked=2)
    filt.record_losses([a, b], [0.1, 5.0])
    assert list(filt) == [b]  # a is learned and never kept at learned_keep=0
    filt.record_losses([[1, 2], [3, 4]], [1.0, 1.0])  # a and b forgotten (max_tracked=2)
    assert list(filt) == [a, b, a]


def test_bad_feedback_is_refused() -> None:
    filt = QualityFilter(_samples(3), score=lambda s: 1.0)
    with pytest.raises(ValueError, match="2 samples but 3 losses"):
        filt.record_losses(_samples(2), [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="numbers"):
        filt.record_losses(_samples(1), np.array(["x"]))
    with pytest.raises(ValueError, match="learned_quantile"):
        QualityFilter([], learned_quantile=1.0)
    with pytest.raises(ValueError, match="learned_keep"):
        QualityFilter([], learned_keep=-0.1)
    with pytest.raises(ValueError, match="integers"):
        sample_identity([0.5, 1.5])
    filt.record_losses([0, 1], [0.5, 0.7], keys=True)  # keys given directly
    assert filt.learned_cutoff() == pytest.approx(np.quantile([0.5, 0.7], 0.2))


@pytest.mark.parametrize("column", [np.array([[0.1], [5.0]]), torch.tensor([[0.1], [5.0]])])
def test_losses_of_shape_b_by_1_are_one_per_sample(column) -> None:
    # A [B, 1] array or tensor raised TypeError half-way, leaving a list stored as a loss: the
    # filter's next iteration then raised TypeError in the training loop.
    a, b = [5, 6, 7], [8, 9, 10]
    filt = QualityFilter([a, b], score=lambda s: 1.0, learned_quantile=0.5, learned_keep=0.0)
    filt.record_losses([a, b], column)
    assert filt.learned_cutoff() == pytest.approx(np.quantile([0.1, 5.0], 0.5))
    assert list(filt) == [b] and filt.downsampled == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"special_ids": "12"}, "special_ids must be a collection of token ids, got '12'"),  # read as ids 1 and 2
    ({"special_ids": [1.7]}, "special ids must be integers, got 1.7"),  # read as id 1
    ({"special_ids": [True]}, "special ids must be integers, got True"),  # read as id 1
    ({"pad_id": "0"}, "pad_id must be an integer or None, got '0'"),  # no padding at all
    ({"pad_id": 0.0}, "pad_id must be an integer or None, got 0.0"),
])
def test_special_ids_and_a_pad_id_that_are_no_token_ids_are_value_errors(kwargs, message) -> None:
    with pytest.raises(ValueError) as raised:
        DefaultQualityScore(**kwargs)
    assert str(raised.value) == message


def test_the_token_ids_of_a_score_may_be_numpy_or_torch_integers() -> None:
    score = DefaultQualityScore(special_ids=torch.tensor([0, 5]), pad_id=np.int64(9))
    assert score([0, 6, 7, 9]) == pytest.approx(2 / 3)  # one special token in three, the pad left out
    assert DefaultQualityScore(special_ids=np.array([3]))([3, 4]) == 0.5


@pytest.mark.parametrize("call, message", [
    (lambda: QualityFilter([], learned_quantile="0.2"), "learned_quantile must lie in (0, 1), got '0.2'"),  # a TypeError
    (lambda: QualityFilter([], learned_keep=None), "learned_keep must lie in [0, 1], got None"),  # a TypeError
    (lambda: QualityFilter([], learned_keep=True), "learned_keep must lie in [0, 1], got True"),  # read as 1.0
    (lambda: DefaultQualityScore(duplicate_score=False), "duplicate_score must lie in [0, 1], got False"),  # 0.0
])
def test_shares_that_are_no_numbers_are_value_errors(call, message) -> None:
    with pytest.raises(ValueError) as raised:
        call()
    assert str(raised.value) == message


def test_numpy_shares_are_taken() -> None:
    filt = QualityFilter([[1]], score=lambda s: 1.0, learned_quantile=np.float64(0.5), learned_keep=np.float32(0.5))
    assert list(filt) == [[1]]
    assert DefaultQualityScore(duplicate_score=np.float64(0.5))([1, 2]) == 1.0

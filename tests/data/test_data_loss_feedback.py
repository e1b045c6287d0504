"""QualityFilter's per-sample loss feedback (trainer_agent/data.py): well-learned samples are
down-sampled at the stated rate, the others are untouched, and bad feedback is refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from trainer_agent.data import QualityFilter, sample_identity


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

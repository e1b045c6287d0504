"""BatchSizeAdvisor (trainer_agent/measure/batch_size.py): the running ratio of averages."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer_agent.measure.batch_size import BatchSizeAdvisor


def test_ratio_of_averages_with_negative_and_skipped_estimates() -> None:
    adv = BatchSizeAdvisor(decay=0.5)
    assert math.isnan(adv.recommended())
    pairs = [(4.0, 2.0), (-3.0, 1.0), (math.nan, 1.0), (0.0, 0.0), (math.inf, 5.0), (5.0, 0.0)]  # (trace, |G|^2)
    ema_t = ema_g = 0.0
    for t, g in pairs:
        b = t / g if g else (math.inf if t else math.nan)
        if not math.isfinite(t) or math.isnan(b) or b == 0.0:  # skipped
            adv.update(b, t)
            continue
        adv.update(b, t)
        ema_t, ema_g = 0.5 * ema_t + 0.5 * t, 0.5 * ema_g + 0.5 * g
    assert adv.updates == 3
    assert adv.recommended() == pytest.approx(ema_t / ema_g)


def test_clipped_and_validated() -> None:
    adv = BatchSizeAdvisor(min_batch=8, max_batch=64)
    adv.update(2.0, 1.0)
    assert adv.recommended() == 8
    adv = BatchSizeAdvisor(min_batch=8, max_batch=64)
    adv.update(1000.0, 1000.0)
    assert adv.recommended() == 64
    for kw in ({"decay": 1.0}, {"min_batch": 0}, {"min_batch": 10, "max_batch": 5}):
        with pytest.raises(ValueError):
            BatchSizeAdvisor(**kw)


def test_converges_to_the_true_noise_scale_from_noisy_reports() -> None:
    rng = np.random.default_rng(0)
    adv = BatchSizeAdvisor(decay=0.98)
    true_trace, true_g = 300.0, 2.0  # B_noise = 150
    for _ in range(2000):
        t = true_trace + rng.normal(0, 100)
        g = true_g + rng.normal(0, 1.5)  # often negative, as single-step estimates are
        adv.update(t / g, t)
    assert adv.recommended() == pytest.approx(150, rel=0.15)

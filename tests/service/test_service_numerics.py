"""The small-array helpers rules evaluate with, against numpy's own spellings of the same thing."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainguard.service.numerics import all_finite, finite_range, mean_of, median, power_spectrum


@pytest.mark.parametrize("n", [1, 2, 3, 31, 64, 100, 1023, 1024, 1025, 5000])
def test_all_finite_and_finite_range_agree_with_isfinite(n: int) -> None:
    rng = np.random.default_rng(n)
    x = rng.normal(0, 1e300, n)  # huge but finite
    assert all_finite(x) and finite_range(x) == (x.min(), x.max())
    for bad in (math.nan, math.inf, -math.inf):
        for where in {0, n // 2, n - 1}:
            y = x.copy()
            y[where] = bad
            assert not all_finite(y) and finite_range(y) is None
    strided = np.stack([x, x], axis=1)[:, 0]  # a column of a matrix: what a window's series is
    assert (n == 1 or not strided.flags.c_contiguous) and all_finite(strided)
    assert all_finite(np.empty(0))


@pytest.mark.parametrize("n", [1, 2, 5, 32, 64, 65])
def test_median_and_mean_agree_with_numpy(n: int) -> None:
    x = np.random.default_rng(n).normal(3, 2, n)
    before = x.copy()
    assert median(x) == np.median(x)
    assert mean_of(x) == pytest.approx(np.mean(x), rel=1e-15)
    assert np.array_equal(x, before)  # the input is not sorted in place


@pytest.mark.parametrize("n", [8, 9, 16, 63, 64, 100, 128, 256, 257, 1000])
def test_power_spectrum_is_the_squared_magnitude_of_the_fft(n: int) -> None:
    rng = np.random.default_rng(n)
    t = np.arange(n)
    x = rng.normal(0, 1, n) + 3 * np.sin(2 * np.pi * t / 7.3) + 100.0
    want = np.abs(np.fft.rfft(x)) ** 2
    got = power_spectrum(x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * want.max())
    assert int(np.argmax(got[1:])) == int(np.argmax(want[1:]))

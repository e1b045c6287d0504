"""Numerics on the small arrays rules read (a window of 32-128 reports, one report's ranks).

On arrays this small a numpy call costs more in overhead than in arithmetic, and some of the
usual spellings go through a Python-level wrapper first: ``np.sort``, ``np.median`` and the array
methods ``min``, ``max``, ``all``, ``sum`` and ``mean`` cost 1-30 us each where the work is tens
of nanoseconds. A report is evaluated against every rule, so these helpers take the short path:
the ufuncs' own ``reduce``, an in-place sort of a copy, a count of finite values, and
a DFT by one matrix product for the short windows the oscillation rule reads.
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["all_finite", "finite_range", "mean_of", "median", "power_spectrum"]

_MIN, _MAX, _SUM = np.minimum.reduce, np.maximum.reduce, np.add.reduce
_isfinite, _count_nonzero = np.isfinite, np.count_nonzero


def all_finite(x: np.ndarray) -> bool:
    """Whether every value of ``x`` is finite: two C calls (``ndarray.all`` adds a Python-level
    wrapper)."""
    return _count_nonzero(_isfinite(x)) == x.size


def finite_range(x: np.ndarray) -> tuple[float, float] | None:
    """(min, max) of ``x`` when every value is finite, else None: two reductions instead of an
    ``isfinite`` pass (a NaN makes both NaN, an infinity shows as the min or the max)."""
    lo, hi = float(_MIN(x)), float(_MAX(x))
    return (lo, hi) if -math.inf < lo and hi < math.inf else None


def median(x: np.ndarray) -> float:
    """The median of a 1-D array without NaN."""
    s = x.copy()
    s.sort()
    n = len(s)
    return float(s[n // 2]) if n % 2 else 0.5 * (float(s[n // 2 - 1]) + float(s[n // 2]))


def mean_of(x: np.ndarray) -> float:
    """The mean of a 1-D array: its sum over n."""
    return float(_SUM(x)) / len(x)


#: Windows up to this length get their spectrum from a cached DFT matrix (one matrix product);
#: longer ones from the FFT, whose fixed cost is then small beside its work.
_DFT_MAX = 256


@functools.lru_cache(maxsize=16)
def _dft_basis(n: int) -> np.ndarray:
    """The rows cos(2 pi k t / n) and then sin(2 pi k t / n) for k = 0..n//2, t = 0..n-1."""
    k = np.arange(n // 2 + 1, dtype=np.float64)[:, None]
    angle = 2.0 * np.pi * ((k * np.arange(n)) % n) / n  # (k t mod n): exact angles for large k t
    basis = np.concatenate([np.cos(angle), np.sin(angle)])
    basis.flags.writeable = False
    return basis


def power_spectrum(x: np.ndarray) -> np.ndarray:
    """|rfft(x)|^2: the power at each frequency k = 0..n//2 of the 1-D array ``x``."""
    n = len(x)
    if n > _DFT_MAX:
        return np.abs(np.fft.rfft(x)) ** 2
    proj = _dft_basis(n) @ x
    half = n // 2 + 1
    return proj[:half] * proj[:half] + proj[half:] * proj[half:]

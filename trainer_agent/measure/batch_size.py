"""A recommended global batch size from the gradient noise scale (the stability guide, section
4.2: adapt the batch size to the gradient variance).

McCandlish et al. (2018) show that the critical batch size, beyond which a larger batch buys
little more progress per step, is about the noise scale B_noise, estimated by B_simple =
tr(Sigma) / |G|^2. One report's estimate is noisy (either part can come out negative), so the
advisor keeps exponential moving averages of tr(Sigma) and of |G|^2 separately and recommends
their ratio, as the paper does (the ratio of averages, not the average of ratios)::

    trace_avg = decay * trace_avg + (1 - decay) * tr(Sigma)
    grad_avg  = decay * grad_avg  + (1 - decay) * |G|^2
    recommended = clip(trace_avg / grad_avg, min_batch, max_batch)

(both averages start at 0, so the bias of an early average cancels in the ratio). The unit is the
noise scale's: tokens when ``end_step`` is given ``tokens=``, else micro-batches.
"""

from __future__ import annotations

import math

__all__ = ["BatchSizeAdvisor"]


class BatchSizeAdvisor:
    """Running recommendation of the global batch size; see the module docstring."""

    def __init__(self, *, decay: float = 0.95, min_batch: float = 1.0, max_batch: float = math.inf) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1), got {decay}")
        if not (0.0 < min_batch <= max_batch):
            raise ValueError(f"need 0 < min_batch <= max_batch, got {min_batch}, {max_batch}")
        self.decay = decay
        self.min_batch, self.max_batch = float(min_batch), float(max_batch)
        self._trace = 0.0
        self._grad_sq = 0.0
        self.updates = 0

    def update(self, noise_scale: float, trace: float) -> None:
        """One report's B_simple and tr(Sigma) (as the agent reports them). |G|^2 is
        tr(Sigma) / B_simple (0 when B_simple is infinite). A non-finite trace, a NaN or zero
        B_simple (|G|^2 undetermined) is skipped."""
        b, t = float(noise_scale), float(trace)
        if not math.isfinite(t) or math.isnan(b) or b == 0.0:
            return
        grad_sq = 0.0 if math.isinf(b) else t / b
        self._trace = self.decay * self._trace + (1.0 - self.decay) * t
        self._grad_sq = self.decay * self._grad_sq + (1.0 - self.decay) * grad_sq
        self.updates += 1

    @property
    def noise_scale(self) -> float:
        """The running B_simple: trace_avg / grad_avg (NaN before any update or while grad_avg
        is not positive)."""
        if self.updates == 0 or not self._grad_sq > 0:
            return math.nan
        return self._trace / self._grad_sq

    def recommended(self) -> float:
        """The recommended global batch size (NaN when there is none yet)."""
        b = self.noise_scale
        if math.isnan(b):
            return math.nan
        return min(max(b, self.min_batch), self.max_batch)

"""The simple gradient noise scale (McCandlish et al. 2018, appendix A.1) from the squared norms of
small-batch gradients and of their mean: device scalars in, device scalars out (no host read).
``trainer_agent.measure.stats`` re-exports it."""

from __future__ import annotations

import torch

__all__ = ["noise_scale"]


def noise_scale(
    small_sq: torch.Tensor, big_sq: torch.Tensor, count: int, micro_size: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Simple gradient noise scale from ``count`` >= 2 small-batch gradients (McCandlish et al.
    2018, appendix A.1): returns ``(B_simple, tr(Sigma))`` as scalars on the input's device.

    ``small_sq`` is |G_small|^2, the mean squared norm of the ``count`` small-batch gradient
    estimates, each of ``b = micro_size`` samples; ``big_sq`` is |G_big|^2, the squared norm of
    their mean (the gradient of the big batch of ``count * b`` samples). Unbiased estimates:

        |G|^2     = (n |G_big|^2 - |G_small|^2) / (n - 1)
        tr(Sigma) = b n (|G_small|^2 - |G_big|^2) / (n - 1)
        B_simple  = tr(Sigma) / |G|^2                       (n = count)

    B_simple is in the unit of ``b`` and does not change when both inputs are multiplied by the
    same factor (a loss scale, a loss divided by the accumulation count). Estimates from a single
    step are noisy: tr(Sigma) and B_simple can come out negative; they are reported as they are.
    """
    assert count >= 2, "the noise scale needs at least two small-batch gradients"
    grad_sq = (count * big_sq - small_sq) / (count - 1)
    trace = micro_size * count * (small_sq - big_sq) / (count - 1)
    return trace / grad_sq, trace

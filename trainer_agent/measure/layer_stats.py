"""Per-layer gradient statistics of a report step (the triage's step 1, ``trainer_agent/measure/triage_stats.py``)
in a number of device operators that does not grow with the tensor count.

Split where it costs least:

- on the device, :meth:`LayerGradStats.measure`: per tensor the five
  :data:`~trainer_agent.measure.stats.MOMENTS` of its ``.grad`` (``stats.tensor_moments``: eight fused
  ``torch._foreach_*`` passes per (device, dtype) chunk and one ``stack`` into one flat float64
  vector; on the CPU a large gradient chunk by chunk, ``chunked_moments.py``) -- the part that
  reads the gradients;
- on the host, once the report's one device-to-host copy has brought that vector over
  (:meth:`GradMoments.per_layer`): the per-layer sums (``np.bincount``) and extremes
  (``np.maximum.at``), the mean ``2 E[relu(g)] - E|g|`` and the standard deviation
  ``sqrt(E[g^2] - mean^2)``: O(tensors + layers) host arithmetic in float64, instead of a dozen
  tiny device operators (kernel launches on a GPU) on (layers,) vectors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer_agent.measure import stats

__all__ = ["GradMoments", "LayerGradStats"]

#: How each of :data:`~trainer_agent.measure.stats.MOMENTS` scales with the gradients (||g||^2: squared).
_MOMENT_POWERS = (1, 1, 2, 1, 1)


@dataclass(frozen=True, slots=True)
class GradMoments:
    """The gradients' moments of one report step: ``values`` (device, ``stats.MOMENTS`` blocks
    of ``len(measured)``), the parameter index of each measured gradient (``measured``), their
    layers and element counts (host arrays), and the parameter and layer counts."""

    values: torch.Tensor
    measured: np.ndarray
    layer_of: np.ndarray
    numels: np.ndarray
    params: int
    layers: int
    in_order: bool
    """Every parameter measured, in parameter order (then block 2 is the ``||g||^2`` vector)."""

    def blocks(self, host: np.ndarray) -> np.ndarray:
        """``host`` (the host copy of :attr:`values`) as (len(MOMENTS), measured) rows."""
        return host.reshape(len(stats.MOMENTS), len(self.measured))

    def device_sq(self) -> torch.Tensor | None:
        """Each parameter's ``||g||^2`` on the device (a view of :attr:`values`) when
        :attr:`in_order`, else None."""
        n = len(self.measured)
        return self.values[2 * n:3 * n] if self.in_order else None

    def grad_sq(self, host: np.ndarray) -> np.ndarray:
        """Each parameter's ``||g||^2`` (0 without a gradient), in parameter order."""
        out = np.zeros(self.params)
        out[self.measured] = self.blocks(host)[2]
        return out

    def max_abs(self, host: np.ndarray) -> float:
        """The largest |g| over every gradient (-inf without any; NaN when one is NaN)."""
        top = self.blocks(host)[3]
        return float(np.max(top)) if top.size else -math.inf

    def per_layer(self, host: np.ndarray) -> np.ndarray:
        """(layers, 4) float64: per layer (mean, std, max |g|, min |g|) of the gradient elements;
        NaN for a layer without any."""
        pos, l1, sq, top, neg_low = self.blocks(host)
        n, ids = self.layers, self.layer_of
        count = np.bincount(ids, weights=self.numels, minlength=n)
        sums = [np.bincount(ids, weights=w, minlength=n) for w in (pos, l1, sq)]
        high, neg = np.full(n, -math.inf), np.full(n, -math.inf)
        np.maximum.at(high, ids, top)
        np.maximum.at(neg, ids, neg_low)
        with np.errstate(divide="ignore", invalid="ignore"):
            mean = sums[0] / (count / 2) - sums[1] / count  # (halving is exact)
            std = np.sqrt(np.maximum(sums[2] / count - mean * mean, 0.0))
        out = np.stack([mean, std, high, -neg], axis=1)
        out[count == 0] = math.nan
        return out


class LayerGradStats:
    """The device part of the per-layer gradient statistics (see the module docstring), with the
    host arrays of each set of measured gradients cached. ``layer_ids``: the layer of each
    parameter (host sequence or long tensor); ``layers``: how many layers."""

    def __init__(self, layer_ids: Sequence[int] | torch.Tensor, layers: int, device: torch.device) -> None:
        ids = layer_ids.tolist() if isinstance(layer_ids, torch.Tensor) else list(layer_ids)
        self.layer_ids = np.asarray(ids, dtype=np.int64)
        self.layers = layers
        self.device = device
        self._plans: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._cache: dict = {}  # stats.tensor_moments' buffer on the CPU

    def measure(self, params: Sequence[torch.Tensor], *, scale: torch.Tensor | None = None) -> GradMoments:
        """The moments of the current ``.grad`` of ``params`` (a parameter without one, or with
        an empty one, is left out); ``scale``: the loss scale the gradients still carry (a fused
        optimizer under a GradScaler, ``optim.applied_grad_scale``), divided out."""
        every = [p.grad for p in params]
        numels = [0 if g is None else g.numel() for g in every]
        used = [i for i, n in enumerate(numels) if n] if 0 in numels else list(range(len(every)))
        grads = [every[i] for i in used] if len(used) < len(every) else every
        values, order = stats.tensor_moments(grads, self.device, cache=self._cache)
        if scale is not None and len(order):
            inv = scale.detach().to(values.device, torch.float64).reciprocal().reshape(())
            per_block = torch.stack([inv ** power for power in _MOMENT_POWERS]).unsqueeze(1)
            values = (values.view(len(stats.MOMENTS), -1) * per_block).reshape(-1)
        ordered = used if order == list(range(len(used))) else [used[i] for i in order]
        key = (tuple(ordered), tuple([numels[i] for i in ordered]))
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= 8:  # another set of gradients each time: keep a few
                self._plans.clear()
            measured = np.asarray(key[0], dtype=np.int64)
            plan = self._plans[key] = (measured, self.layer_ids[measured], np.asarray(key[1], dtype=np.float64))
        return GradMoments(values, *plan, params=len(params), layers=self.layers,
                           in_order=key[0] == tuple(range(len(params))))

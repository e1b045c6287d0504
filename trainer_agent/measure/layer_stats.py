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

from trainer_agent.measure import staged, stats

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

    def max_abs(self, host: np.ndarray) -> float | None:
        """The largest |g| over every gradient (None without any, as a layer without one has no
        statistics; NaN when one is NaN)."""
        top = self.blocks(host)[3]
        return float(np.max(top)) if top.size else None

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
        self._everything: tuple | None = None  # (bucket layouts, host arrays of every parameter)

    def measure(self, params: Sequence[torch.Tensor], *, scale: torch.Tensor | None = None,
                grads: Sequence[Sequence[torch.Tensor]] | None = None) -> GradMoments:
        """The moments of the current ``.grad`` of ``params`` (a parameter without one, or with
        an empty one, is left out); ``scale``: the loss scale the gradients still carry (a fused
        optimizer under a GradScaler, ``optim.applied_grad_scale``), divided out. ``grads``: those
        gradients per bucket, as ``ParamIndex.grads()`` reads them: where every bucket is settled
        (``staged.Settled``: no gradient missing) and taken by the staged passes (many tensors on
        an accelerator), they are measured with no host work per tensor."""
        settled = None if grads is None else self._settled(grads)
        if settled is not None:
            values, (measured, layer_of, numels) = settled
            return GradMoments(self._unscaled(values, scale), measured, layer_of, numels,
                               params=len(params), layers=self.layers, in_order=True)
        every = [p.grad for p in params]
        numels = [0 if g is None else g.numel() for g in every]
        used = [i for i, n in enumerate(numels) if n] if 0 in numels else list(range(len(every)))
        grads = [every[i] for i in used] if len(used) < len(every) else every
        values, order = stats.tensor_moments(grads, self.device, cache=self._cache)
        values = self._unscaled(values, scale) if len(order) else values
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

    def _settled(self, grads: Sequence[Sequence[torch.Tensor]]
                 ) -> tuple[torch.Tensor, tuple[np.ndarray, np.ndarray, np.ndarray]] | None:
        """Every gradient's moments in parameter order from the staged passes, with the host
        arrays of all parameters (made once per set of layouts), or None where a bucket is not
        settled, holds an empty parameter or is not taken by them."""
        if not grads or not all(isinstance(b, staged.Settled) for b in grads):
            return None
        key = tuple(id(b.layout) for b in grads)
        if self._everything is None or self._everything[0] != key:
            numels = np.asarray([math.prod(s) for b in grads for s in b.layout.shapes], dtype=np.float64)
            measured = np.arange(len(numels), dtype=np.int64)
            self._everything = (key, (measured, self.layer_ids[measured], numels) if numels.all() else None)
        arrays = self._everything[1]
        if arrays is None or len(arrays[0]) != len(self.layer_ids):
            return None
        plans = [staged.plan_for(bucket, self.device) for bucket in grads]
        if None in plans:  # (before any pass: a bucket the staged passes do not take sends all to the other path)
            return None
        parts = []
        for bucket, plan in zip(grads, plans):
            values = staged.attempt(staged.staged_moments, bucket, plan)
            if values is None:
                return None
            parts.append(values)
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).reshape(-1), arrays

    @staticmethod
    def _unscaled(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """``values`` (the moments' blocks) with the loss ``scale`` divided out of each."""
        if scale is None:
            return values
        inv = scale.detach().to(values.device, torch.float64).reciprocal().reshape(())
        per_block = torch.stack([inv ** power for power in _MOMENT_POWERS]).unsqueeze(1)
        return (values.view(len(stats.MOMENTS), -1) * per_block).reshape(-1)

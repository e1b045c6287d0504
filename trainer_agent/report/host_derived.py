"""Report values the host derives from the report's one device-to-host copy.

A report step's device work is the reductions that read the model (norms, sums, extremes: fused
over every tensor). What is derived from their results -- square roots, ratios, per-layer and
per-param-group sums of per-tensor values, the update size the optimizer's rule predicts, the
noise scale -- is O(tensors + layers) arithmetic that, on the device, costs one operator (one
kernel launch on a GPU) per formula. None of it feeds the report step's collective (its row
values are computed on the device, ``trainer_agent/report/rank_row.py``), so it runs on the host
instead, in float64 like on the device, when the report is published (``InFlight.read``): a
:class:`HostDerived` lists the device vectors and scalars to bring along in the report's copy
(no operator: they join the ``torch.stack``/``torch.cat`` that makes the copied vector) and
the host jobs that turn them into report values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer_agent.measure import stats
from trainer_agent.measure.layer_stats import GradMoments
from trainer_agent.report.exchange import RANK_FIELDS
from trainer_agent.measure.triage_stats import LAYER_STATS, UpdateModel

__all__ = ["HostDerived", "PerTensor", "Raw", "update_values", "layer_vectors", "noise_scale_values"]


@dataclass(frozen=True, slots=True)
class Raw:
    """The host copies of one report's :class:`HostDerived` inputs; ``rows``: the gathered rows
    the host has ((ranks, RANK_FIELDS): every rank's on the leader, this rank's own elsewhere)."""

    scalars: dict[str, float]
    vectors: list[np.ndarray]
    rows: np.ndarray | None


#: A host job: adds report values from the raw copies.
Job = Callable[[Raw, dict[str, float]], None]


class HostDerived:
    """What one report brings to the host for its derived values (see the module docstring)."""

    def __init__(self) -> None:
        #: hidden key -> 0-dim device tensor (copied among the report's scalars, then removed)
        self.scalars: dict[str, torch.Tensor] = {}
        #: 1-D device tensors, copied after the report's keyed values
        self.vectors: list[torch.Tensor] = []
        self._jobs: list[Job] = []

    def scalar(self, value: torch.Tensor) -> str:
        """Bring the 0-dim ``value`` along; returns its key in :attr:`Raw.scalars`."""
        key = f"_host_derived_{len(self.scalars)}"
        self.scalars[key] = value
        return key

    def vector(self, value: torch.Tensor) -> int:
        """Bring the 1-D ``value`` along; returns its index in :attr:`Raw.vectors`."""
        self.vectors.append(value)
        return len(self.vectors) - 1

    def job(self, fn: Job) -> None:
        self._jobs.append(fn)

    @property
    def length(self) -> int:
        """Values the vectors occupy in the copied buffer (host-known shapes: no device read)."""
        return sum(v.numel() for v in self.vectors)

    def apply(self, values: dict[str, float], flat: np.ndarray, rows: np.ndarray | None) -> None:
        """Remove the hidden scalars from ``values`` and add what the jobs derive; ``flat``: the
        host copy of the vectors, in order."""
        scalars = {k: values.pop(k) for k in self.scalars}
        cuts = np.cumsum([v.numel() for v in self.vectors])[:-1] if self.vectors else []
        raw = Raw(scalars, np.split(np.asarray(flat, dtype=np.float64), cuts) if self.vectors else [], rows)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            for fn in self._jobs:
                fn(raw, values)


@dataclass(frozen=True, slots=True)
class PerTensor:
    """Where a report's per-tensor vectors are in its :class:`HostDerived` (indices into
    :attr:`Raw.vectors`; None: absent): the squared norms of the parameters, of the update and of
    the weights before it, and the gradients' moments (with their ``GradMoments``)."""

    param: int
    delta: int | None
    before: int | None
    moments: tuple[int, GradMoments] | None


def _sqrt_sum(v: np.ndarray) -> np.float64:
    return np.sqrt(np.float64(v.sum()))


def update_values(raw: Raw, values: dict[str, float], *, numel: int, param: int, delta: int | None,
                  before: int | None, moments: tuple[int, GradMoments] | None, applied: float | None,
                  lrs: Sequence[float | str] | None, model: UpdateModel) -> None:
    """The parameter scale, the update ratio (per unit of LR), the effective LR, the update-size
    ratio against the optimizer's rule and the largest |g| (``trainer_agent/measure/triage_stats.py``).
    ``lrs``: per param group a host LR, or the report key of a tensor LR's value. A step without
    any gradient (no ``trainguard_grad_norm``) has none of the update values: its weights did not
    move because nothing trained, and a 0 would read as a stalled run; the effective LR is absent
    where every gradient is exactly 0 too (0/0, or an update by momentum per no gradient: no LR)."""
    values["trainguard_param_scale"] = float(np.sqrt(np.float64(raw.vectors[param].sum()) / numel))
    grad_norm = values.get("trainguard_grad_norm")
    if delta is not None and before is not None and grad_norm is not None:
        size = _sqrt_sum(raw.vectors[delta])
        ratio = size / _sqrt_sum(raw.vectors[before])
        values["trainguard_update_ratio"] = float(ratio)
        if applied is not None:
            values["trainguard_update_ratio_per_lr"] = float(ratio / applied)
        if grad_norm != 0:  # (NaN: a real NaN gradient, NaN here too)
            values["trainguard_effective_lr"] = float(size / np.float64(grad_norm))
        if moments is not None and lrs is not None:
            host_lrs = [values[lr] if isinstance(lr, str) else lr for lr in lrs]
            grad_sq = moments[1].grad_sq(raw.vectors[moments[0]])
            expected = model.expected(host_lrs, grad_sq, raw.vectors[before])
            if expected is not None:
                values["trainguard_update_size_ratio"] = float(size / np.float64(expected))
    top = moments[1].max_abs(raw.vectors[moments[0]]) if moments is not None else None
    if top is not None:  # (no gradient: absent)
        values["trainguard_grad_max_abs"] = top


def layer_vectors(raw: Raw, values: dict[str, float], *, layer_of: np.ndarray, keys: Callable[..., list[str]],
                 grads: int | None, scale: str | None, param: int, delta: int | None, before: int | None,
                 moments: tuple[int, GradMoments] | None, ungraded: np.ndarray | None = None) -> None:
    """The per-layer vectors: the gradient norm (unscaled), the parameter norm, the update ratio
    (per-tensor squares summed per layer), and the gradient statistics (``layer_stats``).
    ``ungraded``: the parameters without a gradient at the step (None: none): a layer of only
    those that did not move has no update ratio (frozen, unused on the step, an expert no token
    reached: not measured, where a 0 would read as a layer that stopped learning)."""
    layers = len(keys("trainguard_layer_param_norm"))

    def layer_norms(v: np.ndarray) -> np.ndarray:
        return np.sqrt(np.bincount(layer_of, weights=v, minlength=layers))

    if grads is not None:
        g = raw.vectors[grads]
        norms = layer_norms(g * g)
        if scale is not None:
            norms = norms / np.float64(raw.scalars[scale])
        values.update(zip(keys("trainguard_layer_grad_norm"), norms.tolist()))
    values.update(zip(keys("trainguard_layer_param_norm"), layer_norms(raw.vectors[param]).tolist()))
    if moments is not None:
        _layer_grad_stats(values, keys(*LAYER_STATS), moments[1], raw.vectors[moments[0]])
    if delta is not None and before is not None:
        moved = layer_norms(raw.vectors[delta])
        ratio = moved / layer_norms(raw.vectors[before])
        measured = np.ones(layers, dtype=bool)
        if ungraded is not None:  # a layer is without a gradient where each of its parameters is
            idle = np.bincount(layer_of[ungraded], minlength=layers) == np.bincount(layer_of, minlength=layers)
            measured = ~(idle & (moved == 0))
        ratio_keys = keys("trainguard_layer_update_ratio")
        values.update((ratio_keys[i], float(ratio[i])) for i in np.flatnonzero(measured).tolist())


def _layer_grad_stats(values: dict[str, float], keys: list[str], moments: GradMoments, host: np.ndarray) -> None:
    """The gradient statistics (``LAYER_STATS``) of each layer with a gradient on this report;
    a layer without any (every parameter unused on the step: no ``.grad``) has none, not NaN,
    which reads as a non-finite gradient. ``keys``: layer by layer, ``LAYER_STATS`` each."""
    has_grad = np.bincount(moments.layer_of, weights=moments.numels, minlength=moments.layers) > 0
    per_layer = moments.per_layer(host)
    for layer in np.flatnonzero(has_grad).tolist():
        values.update(zip(keys[layer * len(LAYER_STATS):(layer + 1) * len(LAYER_STATS)], per_layer[layer].tolist()))


def noise_scale_values(raw: Raw, values: dict[str, float], *, micro_count: int, world_size: int,
                       tokens: int | None) -> None:
    """The gradient noise scale of the job (``stats.noise_scale``) from every rank's micro-batch
    sums (the gathered rows) and the step's gradient norm: the leader's."""
    grad_norm = values.get("trainguard_grad_norm")
    total_count = micro_count * world_size  # every rank runs the same loop
    if raw.rows is None or grad_norm is None or total_count < 2:
        return
    small_sum = np.float64(raw.rows[:, RANK_FIELDS.index("micro_sq_sum")].sum())
    # Small gradients k*h_j have the expectation of the accumulated gradient H.
    micro_size = tokens / micro_count if tokens else 1.0
    small_sq = micro_count**2 * small_sum / total_count
    big = np.float64(grad_norm)
    b_simple, trace = stats.noise_scale(small_sq, big * big, total_count, micro_size)
    values["trainguard_grad_noise_scale"] = float(b_simple)
    values["trainguard_grad_variance"] = float(trace)


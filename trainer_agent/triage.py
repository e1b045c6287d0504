"""Triage statistics of the loss-triage procedure (the stability guide, 5.1, steps 1 and 2), on the
device, on report steps only.

Step 1, "check gradient statistics (mean / variance / max / min)": per layer, the mean, standard
deviation, largest and smallest absolute value of the gradient elements the optimizer applies
(measured in its pre-hook, so after unscaling and clipping), and their largest absolute value over
the model (the pre-flight bound of 1e3, 6.1, applies to it).

Step 2, "verify the size of the updates (delta W about lr x g)": the size the optimizer's update
rule predicts for the step, and the measured ``||W_after - W_before||`` over it:

- SGD-like (``torch.optim.SGD``): ``lr (||g|| + wd ||W||) / (1 - momentum)``, the steady-state
  bound of the momentum buffer (plain SGD: exactly ``lr ||g||``);
- Adam-like (Adam, AdamW, Adamax, NAdam, RAdam, Adagrad, RMSprop: per-element normalised updates
  of at most about ``lr``): ``lr (sqrt(n) + wd ||W||)``, ``n`` the group's element count;

summed in quadrature over param groups. ``trainguard_update_size_ratio`` = measured / predicted:
about 1 or below in a healthy run (exactly 1 for plain SGD and for Adam's first step). Far above
1: something else changes the weights (a second optimizer, weights written by hand, an LR other
than the one the optimizer reports). Far below: the updates vanish (an epsilon that dominates
Adam's denominator, frozen or masked parameters, clipping that removes almost everything).

Metric keys (``trainguard/protocol/catalog.py``): ``trainguard_layer_grad_mean``,
``trainguard_layer_grad_std``, ``trainguard_layer_grad_max_abs``, ``trainguard_layer_grad_min_abs``
(label ``layer``), ``trainguard_grad_max_abs``, ``trainguard_update_size_ratio``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from trainer_agent import stats

__all__ = ["LAYER_STATS", "ADAPTIVE", "grad_stats", "UpdateModel"]

#: Per-layer metrics of :func:`grad_stats`, in its column order.
LAYER_STATS: tuple[str, ...] = (
    "trainguard_layer_grad_mean",
    "trainguard_layer_grad_std",
    "trainguard_layer_grad_max_abs",
    "trainguard_layer_grad_min_abs",
)

#: Optimizers whose per-element update is normalised to about ``lr``.
ADAPTIVE: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
                              torch.optim.RAdam, torch.optim.Adagrad, torch.optim.RMSprop)


def grad_stats(params: Sequence[torch.Tensor], layer_ids: torch.Tensor, layers: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(per_layer, sq, max_abs)``: per layer (mean, std, max |g|, min |g|) of the elements of the
    current ``.grad`` of ``params`` (float64 device tensor (layers, 4); NaN for a layer without
    gradients), each parameter's ``||g||^2`` (float64 device vector, 0 without a gradient) and
    the largest |g| over all of them (-inf without any; NaN when one is NaN)."""
    present = [i for i, p in enumerate(params) if p.grad is not None]
    ids = layer_ids if len(present) == len(params) else layer_ids[torch.tensor(present, dtype=torch.long, device=device)]
    grads = [params[i].grad for i in present]
    sq = torch.zeros(len(params), dtype=torch.float64, device=device)
    per_layer = torch.full((layers, 4), math.nan, dtype=torch.float64, device=device)
    if not grads:
        return per_layer, sq, torch.full((), -math.inf, dtype=torch.float64, device=device)
    groups = stats.buckets(grads)
    order = [i for g in groups for i in g]
    norms = stats.bucket_norms([[grads[i] for i in g] for g in groups], device).to(torch.float64)
    sums = torch.stack([grads[i].sum(dtype=torch.float32).to(device, torch.float64) for i in order])
    # min and max |g| from one pass over |g| per tensor (on the CPU the fused inf-norms are ~5x slower).
    extremes = torch.stack([torch.stack(torch.aminmax(grads[i].abs())).float().to(device) if grads[i].numel() else
                            torch.tensor([math.inf, -math.inf], device=device) for i in order])
    extremes = extremes.to(device, torch.float64)
    mins, maxes = extremes[:, 0], extremes[:, 1]
    counts = torch.tensor([float(grads[i].numel()) for i in order], dtype=torch.float64, device=device)
    ids = ids[torch.tensor(order, dtype=torch.long, device=device)]
    g_sq = norms * norms
    sq[torch.tensor([present[i] for i in order], dtype=torch.long, device=device)] = g_sq
    n = stats.segment_sum(counts, ids, layers)
    mean = stats.segment_sum(sums, ids, layers) / n
    var = (stats.segment_sum(g_sq, ids, layers) / n - mean * mean).clamp_min(0)
    top = torch.full((layers,), -math.inf, dtype=torch.float64, device=device).scatter_reduce(0, ids, maxes, "amax")
    low = torch.full((layers,), math.inf, dtype=torch.float64, device=device).scatter_reduce(0, ids, mins, "amin")
    has = n > 0
    per_layer = torch.stack([mean, var.sqrt(), top, low], dim=1)
    per_layer = torch.where(has.unsqueeze(1), per_layer, math.nan)
    return per_layer, sq, maxes.amax()


class UpdateModel:
    """The update size the optimizer's rule predicts (see the module docstring); ``None`` from
    :meth:`expected` for an optimizer it does not know."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], device: torch.device) -> None:
        self.adaptive = isinstance(optimizer, ADAPTIVE)
        self.known = self.adaptive or isinstance(optimizer, torch.optim.SGD)
        group_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.groups = len(optimizer.param_groups)
        self.group_ids = torch.tensor([group_of[id(p)] for p in params], dtype=torch.long, device=device)
        self.numel = torch.tensor([float(p.numel()) for p in params], dtype=torch.float64, device=device)
        self.optimizer = optimizer
        self.device = device

    def expected(self, lrs: Sequence[float | torch.Tensor], grad_sq: torch.Tensor,
                 param_sq: torch.Tensor) -> torch.Tensor | None:
        """Predicted ``||delta W||`` (float64 device scalar) from the step's LRs, the applied
        gradients' per-parameter ``||g||^2`` and the weights' ``||W||^2`` before the step."""
        if not self.known:
            return None
        g = stats.segment_sum(grad_sq, self.group_ids, self.groups).sqrt()
        w = stats.segment_sum(param_sq, self.group_ids, self.groups).sqrt()
        n = stats.segment_sum(self.numel, self.group_ids, self.groups)
        parts = []
        for k, group in enumerate(self.optimizer.param_groups):
            lr = lrs[k] if k < len(lrs) else group["lr"]
            lr = lr.to(self.device, torch.float64) if isinstance(lr, torch.Tensor) else float(lr)
            wd = float(group.get("weight_decay", 0.0) or 0.0)
            if self.adaptive:
                parts.append(lr * (n[k].sqrt() + wd * w[k]))
            else:
                momentum = float(group.get("momentum", 0.0) or 0.0)
                parts.append(lr * (g[k] + wd * w[k]) / (1.0 - momentum))
        return torch.linalg.vector_norm(torch.stack(parts))

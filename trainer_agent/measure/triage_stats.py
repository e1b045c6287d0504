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
- Adam-like (Adam, AdamW, Adamax, NAdam, RAdam, Adagrad, RMSprop, and by class name fused, paged
  and 8-bit Adam variants of other libraries and Lion: per-element updates of at most about
  ``lr``): ``lr (sqrt(n) + wd ||W||)``, ``n`` the group's element count;
- Adafactor (``torch.optim.Adafactor``; by its group keys the Hugging Face one too): a relative
  step, ``rho_t = min(lr, 1 / sqrt(t))`` (Hugging Face's ``relative_step``: ``min(1e-2, 1 /
  sqrt(t))``), times each tensor's ``max(eps2, RMS(W))``, on an update whose RMS is clipped to
  ``d`` (``clip_threshold``): ``rho_t d sqrt(sum max(eps2^2 n, ||W||^2))`` over the group's
  tensors, plus ``lr wd ||W||``;
- trust-ratio optimizers (LAMB, LARS, by class name): the trust ratio rescales each tensor's step to
  ``lr ||W||``: ``lr ||W||`` for the group;
- Muon (``torch.optim.Muon``): each matrix's update is its momentum orthogonalised (singular values
  about 1, so a Frobenius norm of about ``sqrt(min(A, B))`` for an A x B matrix) times the LR that
  ``adjust_lr_fn`` scales by its shape: ``lr sqrt(sum r^2 min(A, B)) + lr wd ||W||`` over the
  group's matrices, ``r = sqrt(max(1, A / B))`` (the default) or ``0.2 sqrt(max(A, B))``
  (``"match_rms_adamw"``);

summed in quadrature over param groups. Any other optimizer has no prediction (the ratio is not
reported, and the pre-flight says its rule is unknown): :func:`update_rule` names the families. ``trainguard_update_size_ratio`` = measured / predicted:
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
import sys
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from trainer_agent.measure.layer_stats import LayerGradStats

__all__ = ["LAYER_STATS", "ADAPTIVE", "KNOWN_RULES", "bound_sq", "grad_stats", "group_lrs", "orthogonal_sq", "update_rule",
           "UpdateModel"]

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

UpdateRule = Literal["sgd", "adaptive", "adafactor", "trust_ratio", "orthogonal"]
#: Class-name fragments of other libraries' optimizers (apex, bitsandbytes, timm, torch_optimizer,
#: transformers), checked over the class's MRO, most specific family first.
_NAMED_RULES: tuple[tuple[str, UpdateRule], ...] = (
    ("adafactor", "adafactor"), ("lamb", "trust_ratio"), ("lars", "trust_ratio"), ("adam", "adaptive"),
    ("lion", "adaptive"), ("rmsprop", "adaptive"), ("adagrad", "adaptive"), ("sgd", "sgd"))
#: What the update-size triage and the pre-flight understand, for messages.
KNOWN_RULES = "SGD, the Adam family (fused, paged and 8-bit variants too), Lion, Adafactor, LAMB, LARS and Muon"


def update_rule(optimizer: torch.optim.Optimizer) -> UpdateRule | None:
    """The family of ``optimizer``'s update rule, None for one trainguard does not know.
    ``torch.distributed.optim.ZeroRedundancyOptimizer``: its local optimizer's (each rank steps its
    partition with it and the ranks then broadcast theirs, so every parameter moves by that rule)."""
    zero = _zero_redundancy()
    if zero is not None and isinstance(optimizer, zero) and isinstance(getattr(optimizer, "optim", None), torch.optim.Optimizer):
        return update_rule(optimizer.optim)
    if isinstance(optimizer, torch.optim.Adafactor):
        return "adafactor"
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None and isinstance(optimizer, muon):
        return "orthogonal"
    if isinstance(optimizer, ADAPTIVE):
        return "adaptive"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    names = [c.__name__.lower() for c in type(optimizer).__mro__ if c not in (torch.optim.Optimizer, object)]
    for fragment, rule in _NAMED_RULES:
        if any(fragment in n for n in names):
            return rule
    return None


def _zero_redundancy() -> type | None:
    """``torch.distributed.optim.ZeroRedundancyOptimizer`` when its module is loaded (an instance
    exists only then; importing it here would cost every attach the import), else None."""
    return getattr(sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer"), "ZeroRedundancyOptimizer", None)


def _adafactor_rho(group: dict, step: float, lr: float | None = None) -> tuple[float, float]:
    """(rho_t, clip d) of an Adafactor param group at step ``step`` (torch's or Hugging Face's keys);
    ``lr``: the LR that step applied (default: the group's LR now, which a scheduler may have moved
    on since)."""
    t = max(step, 1.0)
    if group.get("relative_step"):  # Hugging Face: lr is ignored
        start = 1e-6 * t if group.get("warmup_init") else 1e-2
        rho = min(start, 1.0 / math.sqrt(t))
    else:
        rho = min(float(group["lr"] if lr is None else lr), 1.0 / math.sqrt(t))
    return rho, float(group.get("d", group.get("clip_threshold", 1.0)))


def group_lrs(optimizer: torch.optim.Optimizer) -> list[float | torch.Tensor]:
    """Each param group's LR as the step uses it: ``group["lr"]`` (a float, or a copy of a tensor
    LR), or for Hugging Face's Adafactor with ``relative_step`` (``lr=None``) its relative step
    rho_t at the group's step count."""
    out: list[float | torch.Tensor] = []
    for g in optimizer.param_groups:
        lr = g["lr"]
        if isinstance(lr, torch.Tensor):
            out.append(lr.detach().clone())
        elif lr is None and g.get("relative_step"):
            step = next((optimizer.state[p]["step"] for p in g["params"] if "step" in optimizer.state.get(p, {})), 0)
            out.append(_adafactor_rho(g, float(step) + 1.0)[0])
        else:
            out.append(float(lr) if lr is not None else math.nan)
    return out


def orthogonal_sq(group: dict, shape: Sequence[int]) -> float:
    """Muon's update of an A x B matrix, squared, per unit of LR: ``r^2 min(A, B)``, ``r`` the
    factor ``torch.optim.Muon``'s ``adjust_lr_fn`` puts on the group's LR for that shape."""
    a, b = (int(shape[0]), int(shape[1])) if len(shape) >= 2 else (int(shape[0]) if shape else 1, 1)
    how = group.get("adjust_lr_fn")
    r = math.sqrt(max(1.0, a / b)) if how in (None, "original") else (
        0.2 * math.sqrt(max(a, b)) if how == "match_rms_adamw" else 1.0)
    return r * r * min(a, b)


def _adafactor_eps2(group: dict) -> float:
    eps = group.get("eps")
    return float(eps[1]) if isinstance(eps, (tuple, list)) and len(eps) == 2 and eps[1] is not None else 1e-3


def grad_stats(params: Sequence[torch.Tensor], layer_ids: torch.Tensor, layers: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(per_layer, sq, max_abs)``: per layer (mean, std, max |g|, min |g|) of the elements of the
    current ``.grad`` of ``params`` (float64 device tensor (layers, 4); NaN for a layer without
    gradients), each parameter's ``||g||^2`` (float64 device vector, 0 without a gradient) and
    the largest |g| over all of them (-inf without any; NaN when one is NaN). Reads the device
    (``trainer_agent/measure/layer_stats.py``: the agent's report copies the moments instead)."""
    moments = LayerGradStats(layer_ids, layers, device).measure(params)
    host = moments.values.cpu().numpy()
    f64 = dict(dtype=torch.float64, device=device)
    return (torch.tensor(moments.per_layer(host), **f64), torch.tensor(moments.grad_sq(host), **f64),
            torch.tensor(moments.max_abs(host), **f64))


def bound_sq(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
             grads: Sequence[torch.Tensor | None]) -> list[float] | None:
    """Per parameter, the square of the update size its rule predicts for one step (host floats,
    weight decay aside), None for an unknown rule: the pre-flight's per-layer form of
    :meth:`UpdateModel.expected`. Reads the device: for the pre-flight only."""
    rule = update_rule(optimizer)
    if rule is None:
        return None
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for p, grad in zip(params, grads):
        group = group_of[id(p)]
        lr = float(group["lr"] or 0.0) if group.get("lr") is not None else 0.0
        n = p.numel()
        if rule == "adaptive":
            out.append(lr * lr * n)
        elif rule == "orthogonal":
            out.append(lr * lr * orthogonal_sq(group, p.shape))
        elif rule == "sgd":
            g_sq = float(grad.double().square().sum()) if grad is not None else 0.0
            out.append(lr * lr * g_sq / (1.0 - float(group.get("momentum", 0.0) or 0.0)) ** 2)
        else:
            w_sq = float(p.detach().double().square().sum())
            if rule == "trust_ratio":
                out.append(lr * lr * w_sq)
            else:
                state_step = optimizer.state.get(p, {}).get("step")
                rho, d = _adafactor_rho(group, float(state_step) + 1.0 if state_step is not None else 1.0)
                eps2 = _adafactor_eps2(group)
                size_sq = max(eps2 * eps2 * n, w_sq) if group.get("scale_parameter", True) else float(n)
                out.append(rho * rho * d * d * size_sq)
    return out


class UpdateModel:
    """The update size the optimizer's rule predicts (see the module docstring); ``None`` from
    :meth:`expected` for an optimizer it does not know. On the host: the report derives it from
    the host copies of the per-tensor squared norms (``trainer_agent/report/host_derived.py``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], device: torch.device) -> None:
        self.rule = update_rule(optimizer)
        self.adaptive = self.rule == "adaptive"
        self.known = self.rule is not None
        group_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.groups = len(optimizer.param_groups)
        self.group_ids = np.asarray([group_of[id(p)] for p in params], dtype=np.int64)
        self.numel = np.asarray([float(p.numel()) for p in params], dtype=np.float64)
        #: Per parameter, its update's square per unit of LR under the Adam-like rules: its element
        #: count (each element moves by about lr), for Muon ``r^2 min(A, B)`` (:func:`orthogonal_sq`).
        self.unit_sq = self.numel if self.rule != "orthogonal" else np.asarray(
            [orthogonal_sq(optimizer.param_groups[k], p.shape) for k, p in zip(self.group_ids, params)])
        self.optimizer = optimizer
        self.device = device

    def _step_of(self, group: dict) -> float:
        """Adafactor's step count t of ``group`` (its state's ``step``; a CPU value, no device sync)."""
        for p in group["params"]:
            step = self.optimizer.state.get(p, {}).get("step")
            if step is not None:
                return float(step)  # torch keeps it on the CPU (not capturable); HF as an int
        return 1.0

    def _group_sum(self, per_tensor: np.ndarray) -> np.ndarray:
        return np.bincount(self.group_ids, weights=per_tensor, minlength=self.groups)

    def expected(self, lrs: Sequence[float], grad_sq: np.ndarray, param_sq: np.ndarray) -> float | None:
        """Predicted ``||delta W||`` (host float64) from the step's LRs (host floats), the applied
        gradients' per-parameter ``||g||^2`` and the weights' ``||W||^2`` before the step (host
        float64 vectors in the parameters' order)."""
        if not self.known:
            return None
        g = np.sqrt(self._group_sum(grad_sq))
        w = np.sqrt(self._group_sum(param_sq))
        n = self._group_sum(self.unit_sq)
        parts = []
        # The groups the measured parameters were in at attach (a group added since,
        # ``add_param_group``, holds none of them: ``ParamIndex.unmeasured``).
        for k, group in enumerate(self.optimizer.param_groups[:self.groups]):
            lr = lrs[k] if k < len(lrs) else group["lr"]
            lr = float(lr if lr is not None else 0.0)
            wd = float(group.get("weight_decay", 0.0) or 0.0)
            if self.rule in ("adaptive", "orthogonal"):
                parts.append(lr * (np.sqrt(n[k]) + wd * w[k]))
            elif self.rule == "sgd":
                momentum = float(group.get("momentum", 0.0) or 0.0)
                parts.append(lr * (g[k] + wd * w[k]) / (1.0 - momentum))
            elif self.rule == "trust_ratio":
                parts.append(lr * w[k])
            else:
                rho, d = _adafactor_rho(group, self._step_of(group), lr)  # the step's LR, not the next one's
                eps2 = _adafactor_eps2(group)
                scaled = group.get("scale_parameter", True)
                floor = np.maximum(param_sq, (eps2 * eps2) * self.numel) if scaled else self.numel
                size = np.sqrt(self._group_sum(floor)[k])
                decay_lr = lr if not group.get("relative_step") else rho
                parts.append(rho * d * size + decay_lr * wd * w[k])
        return float(np.linalg.norm(np.asarray(parts, dtype=np.float64)))

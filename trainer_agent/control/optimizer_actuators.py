"""The actuators of the commands that change the optimizer's rule: gradient clipping, an optimizer
state reset, the momentum and the weight-decay multipliers (the registry and the interface:
``trainer_agent/control/actuators.py``).

Each acts on every rank at the same agreed step and works on sharded training: the gradient norm
is the global one over every shard (FSDP2 / tensor-parallel DTensors), and the optimizer state a
reset drops is each rank's own shard of it. While a command is not in force its actuator costs
nothing in the step.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from trainer_agent.measure import stats
from trainer_agent.measure.optim import applied_grad_scale
from trainer_agent.measure.params import unwrapped_name
from trainer_agent.control.actuators import Actuator, ActuatorEnv, Sequenced, actuator, state_value
from trainer_agent.control.group_override import GroupOverride

__all__ = ["GradClip", "MomentumScale", "ResetOptimizer", "WeightDecayScale", "global_grad_norm",
           "MOMENTUM_MAX"]

log = logging.getLogger("trainer_agent.control.plane")

#: The largest momentum (beta1, SGD momentum) the momentum command sets: at 1 nothing is forgotten.
MOMENTUM_MAX = 0.999


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all of ``grads`` together, over every shard: a DTensor's (FSDP2, tensor
    parallel) norm is reduced across its mesh (``full_tensor``, a collective on every rank); under
    DDP the gradients are the same on every rank already. Sparse gradients (``nn.Embedding(sparse=True)``;
    never DTensors) count by their coalesced values. No host sync."""
    norm = stats.grads_norm(grads)
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm


@actuator("grad_clip")
class GradClip(Actuator):
    """In the optimizer's pre-hook (after the run's own clipping), the gradients are scaled by
    ``min(1, grad_clip_norm / (norm + 1e-6))`` with ``norm`` their global norm; a non-finite norm
    leaves them as they are (the non-finite step's own handling decides). Off at 0."""

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.max_norm = 0.0

    def apply(self, new: Any, old: Any, step: int) -> None:
        if new.grad_clip_norm != self.max_norm and self.env.leader:
            if new.grad_clip_norm > 0:
                log.warning("trainguard: from step %d every rank clips the global gradient norm to %.4g", step + 1,
                            new.grad_clip_norm)
            else:
                log.warning("trainguard: from step %d the controller's gradient clipping ends (the run's own "
                            "clipping only)", step + 1)
        self.max_norm = new.grad_clip_norm

    def before_step(self) -> None:
        if self.max_norm <= 0:
            return
        params = [p for g in self.env.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return
        with torch.no_grad():
            norm = global_grad_norm([p.grad for p in params])
            scale = applied_grad_scale(self.env.optimizer)
            if scale is not None:  # still scaled (a fused optimizer under a GradScaler): clip the unscaled norm
                norm = norm / scale.to(norm.device, norm.dtype)
            norm = torch.where(torch.isfinite(norm), norm, torch.zeros_like(norm))  # coefficient 1: unchanged
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, norm)

    def values(self) -> dict[str, float]:
        return {"trainguard_grad_clip_norm": self.max_norm}

    def state_dict(self) -> dict[str, Any]:
        return {"grad_clip_norm": self.max_norm}

    def load_state_dict(self, state: Mapping[str, Any], newer: bool) -> None:
        value = state_value(state, "grad_clip_norm", float, 0.0, ok=lambda v: v >= 0)
        if newer:
            self.max_norm = value


@actuator("reset_optimizer")
class ResetOptimizer(Sequenced):
    """Once per newer ``reset_optimizer_seq``: the optimizer state (``optimizer.state[p]``:
    Adam's moments and step count, SGD's momentum buffer; on each rank its shard under FSDP2) of
    the parameters whose names start with one of the comma-separated ``reset_optimizer_layers``
    (every parameter when empty) is dropped; the optimizer initialises it afresh at their next
    step. Names are the model's ``named_parameters`` as the layer metrics name them: without DDP's
    ``module.``, or ``torch.compile``'s ``_orig_mod`` and ``checkpoint_wrapper``'s
    ``_checkpoint_wrapped_module`` anywhere in the path; either spelling matches."""

    seq_field = "reset_optimizer_seq"

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.resets = 0
        self.last_reset = 0
        """Parameters whose state the last reset dropped."""

    def act(self, new: Any, step: int) -> None:
        prefixes = [p for p in new.reset_optimizer_layers.split(",") if p] or [""]
        names = {id(p): n for n, p in self.env.named_parameters()}
        state = self.env.optimizer.state
        reset = 0
        for group in self.env.optimizer.param_groups:
            for p in group["params"]:
                name = names.get(id(p))
                if prefixes != [""] and (name is None or not _matches(name, prefixes)):
                    continue
                if state.pop(p, None) is not None:
                    reset += 1
        self.resets += 1
        self.last_reset = reset
        if self.env.leader:
            what = ", ".join(prefixes) if prefixes != [""] else "every layer"
            log.warning("trainguard: optimizer state reset at step %d for %s: %d parameter(s)", step, what, reset)

    def values(self) -> dict[str, float]:
        return {"trainguard_optimizer_resets_total": float(self.resets),
                "trainguard_optimizer_reset_parameters": float(self.last_reset)}

    def state_dict(self) -> dict[str, Any]:
        return {"reset_optimizer_seq": self.served}

    def load_state_dict(self, state: Mapping[str, Any], newer: bool) -> None:
        self.persisted_served(state)


def _matches(name: str, prefixes: list[str]) -> bool:
    """Whether parameter ``name`` is under one of ``prefixes``, spelt with the wrappers' path
    components or, as layer metrics name it, without them (``params.unwrapped_name``)."""
    bare = unwrapped_name(name)
    return any(name.startswith(p) or bare.startswith(p) for p in prefixes)


class _GroupScale(Actuator):
    """A multiplier of a param-group value, set in the pre-hook and restored in the post-hook (the
    scheduler, the run's checkpoints keep the run's own values)."""

    field: ClassVar[str] = ""
    metric: ClassVar[str] = ""

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.scale = 1.0
        self._override = GroupOverride(env.optimizer)

    def apply(self, new: Any, old: Any, step: int) -> None:
        scale = getattr(new, self.field)
        if scale != self.scale and self.env.leader:
            log.warning("trainguard: from step %d the optimizer's %s is the run's own x %.4g", step + 1,
                        self.metric.removeprefix("trainguard_").removesuffix("_scale").replace("_", " "), scale)
        self.scale = scale

    def before_step(self) -> None:
        if self.scale != 1.0:
            self.scaled()

    def scaled(self) -> None:
        raise NotImplementedError

    def after_step(self) -> None:
        self._override.restore()

    def values(self) -> dict[str, float]:
        return {self.metric: self.scale}

    def state_dict(self) -> dict[str, Any]:
        return {self.field: self.scale}

    def load_state_dict(self, state: Mapping[str, Any], newer: bool) -> None:
        value = state_value(state, self.field, float, 1.0, ok=lambda v: v >= 0)
        if newer:
            self.scale = value


@actuator("momentum")
class MomentumScale(_GroupScale):
    """Each group's beta1 (``betas[0]``: Adam, AdamW and the like) or ``momentum`` (SGD, RMSprop)
    = the run's own x ``momentum_scale``, at most 0.999 (or the run's own when higher); groups
    with neither are left alone."""

    field, metric = "momentum_scale", "trainguard_momentum_scale"

    def scaled(self) -> None:
        scale = self.scale

        def key(g: dict) -> str | None:
            return "betas" if "betas" in g else "momentum" if "momentum" in g else None

        def value(own: Any) -> Any:
            if isinstance(own, tuple | list):
                return type(own)((_held(own[0], scale), *own[1:]))
            return _held(own, scale)

        self._override.override(key, value)


def _held(own: Any, scale: float) -> Any:
    """``own`` x ``scale`` in [0, max(0.999, own)] (a float stays a float, a tensor a tensor)."""
    if isinstance(own, torch.Tensor):  # on the device: no sync
        return torch.minimum((own * scale).clamp(min=0.0), own.clamp(min=MOMENTUM_MAX))
    return min(max(own * scale, 0.0), max(MOMENTUM_MAX, own))


@actuator("weight_decay_scale")
class WeightDecayScale(_GroupScale):
    """Each group's ``weight_decay`` = the run's own x ``weight_decay_scale``."""

    field, metric = "weight_decay_scale", "trainguard_weight_decay_scale"

    def scaled(self) -> None:
        scale = self.scale
        self._override.override(lambda g: "weight_decay", lambda own: own * scale)

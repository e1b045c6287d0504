"""The actions a rule takes when it fires: ``notify`` and ``adaptive_lr`` (the service's own)
and the commands of the registry with a rule action (``trainguard.protocol.commands``, re-exported)."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from trainguard.protocol.commands import (  # the commands' rule actions, re-exported here
    RULE_ACTIONS, CheckpointAction, GradClipAction, LrScaleAction, MemoryTraceAction, MomentumAction, PauseAction,
    ResetOptimizerAction, RollbackAction, StopAction, VerifyAction, WeightDecayScaleAction,
)
from trainguard.protocol.wire import LR_SCALE_MAX, LR_SCALE_MIN
from trainguard.service.rule_schema import MetricName, RulesModel

__all__ = [
    "Action", "ADAPTIVE_FALLBACK_FACTOR", "AdaptiveLrAction", "NotifyAction", "CheckpointAction", "GradClipAction",
    "LrScaleAction", "MemoryTraceAction", "MomentumAction", "PauseAction", "ResetOptimizerAction", "RollbackAction",
    "StopAction", "VerifyAction", "WeightDecayScaleAction",
]


class NotifyAction(RulesModel):
    """Send the alert to every webhook whose min_severity it reaches."""

    type: Literal["notify"] = "notify"


#: What ``adaptive_lr`` multiplies the scale by when it has no measurement to compute from (and
#: the factor Prometheus-side alerts, which cannot measure, ask Alertmanager for).
ADAPTIVE_FALLBACK_FACTOR = 0.5


class AdaptiveLrAction(RulesModel):
    """Set ``lr_scale`` from the measurement (``service/adaptive_lr.py``): current scale x the
    healthy baseline of ``metric`` (median of the last healthy reports before the onset) / its
    value now, clamped to [min, max]. Without a baseline yet it halves the scale. Once the run is
    stable the controller ramps the scale back towards 1.0 (the ``recovery`` section)."""

    type: Literal["adaptive_lr"] = "adaptive_lr"
    metric: MetricName = "trainguard_update_ratio"
    min: float = Field(default=LR_SCALE_MIN, ge=LR_SCALE_MIN, le=LR_SCALE_MAX, allow_inf_nan=False)
    max: float = Field(default=1.0, ge=LR_SCALE_MIN, le=LR_SCALE_MAX, allow_inf_nan=False)

    @model_validator(mode="after")
    def _bounds(self) -> "AdaptiveLrAction":
        if self.min > self.max:
            raise ValueError("adaptive_lr: min must be <= max")
        return self


#: A rules file's actions: ``notify`` and ``adaptive_lr`` (the service's own) and every command of
#: the registry with a rule action (``trainguard.protocol.commands.REGISTRY``).
Action = Annotated[Union[(NotifyAction, AdaptiveLrAction, *RULE_ACTIONS)], Field(discriminator="type")]  # type: ignore[valid-type]

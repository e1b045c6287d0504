"""The command registry's bodies: each operator command's request model (the REST body, the CLI's
options, the console's inputs) and each rule action's model (the rules file's ``{type: <name>,
...}``), with the bounds they hold values in. Declared here, named in
:data:`trainguard.protocol.commands.REGISTRY`, and imported from ``trainguard.protocol.commands``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from trainguard.protocol.base import MAX_INT, Int, Prose, WireModel

#: The range every LR multiplier is held in: an operator's value must lie in it, and a rule's or
#: Alertmanager's factor is clamped to it (repeated halvings stop at the floor).
LR_SCALE_MIN = 1e-4
LR_SCALE_MAX = 1e6
#: Largest number of gradient accumulation steps a command may set.
MAX_ACCUMULATION_STEPS = 65536
#: How the LR follows a change of the number of accumulation steps k (relative to the run's own k0,
#: the global batch size changing by k / k0): "linear" multiplies it by k / k0, "sqrt" by
#: sqrt(k / k0), "none" leaves it.
LrRule = Literal["none", "sqrt", "linear"]
LR_RULES: tuple[str, ...] = ("none", "sqrt", "linear")
#: The exit status of a run the controller stopped because one of its nodes is faulty (a hardware
#: incident's ``stop`` rung): ``EX_TEMPFAIL`` of ``sysexits.h``, "try again later". torchrun
#: (``--max-restarts``), SLURM (``--requeue``) and Kubernetes (a Job's ``podFailurePolicy``
#: ``onExitCodes: [75]``) restart the job on it; the incident's webhook names the host to leave out.
EXIT_HARDWARE_FAULT = 75
#: Largest global gradient norm a ``grad_clip`` command may clip to.
MAX_GRAD_CLIP = 1e6
#: Largest multipliers of the optimizer's momentum (beta1, SGD momentum) and weight decay.
MOMENTUM_SCALE_MAX = 10.0
WEIGHT_DECAY_SCALE_MAX = 100.0
#: Most layer-name prefixes one ``reset_optimizer`` command names.
MAX_RESET_LAYERS = 64



class CommandRequest(WireModel):
    """Body of an operator command without parameters (pause, resume, checkpoint, stop, ...)."""

    reason: Prose = Field(default="", max_length=2000)


class RuleAction(BaseModel):
    """Base of a rules file's actions (``{type: <command>, ...}``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class _ScaleRequest(CommandRequest):
    """Body of a multiplier command: an absolute ``scale`` or a ``factor`` of the current one."""

    @model_validator(mode="after")
    def _one_of(self) -> "_ScaleRequest":
        if (self.scale is None) == (self.factor is None):  # type: ignore[attr-defined]
            raise ValueError("give exactly one of 'scale' (absolute) or 'factor' (times the current one)")
        return self


class _ScaleAction(RuleAction):
    """A multiplier rule action: ``value`` (absolute) or ``factor`` (times the current one),
    clamped to [min, max]."""

    @model_validator(mode="after")
    def _one_of(self) -> "_ScaleAction":
        if (self.value is None) == (self.factor is None):  # type: ignore[attr-defined]
            raise ValueError(f"{self.type} needs exactly one of 'value' (absolute) or 'factor'")  # type: ignore[attr-defined]
        if self.min > self.max:  # type: ignore[attr-defined]
            raise ValueError(f"{self.type}: min must be <= max")  # type: ignore[attr-defined]
        return self

    def apply(self, current: float) -> float:
        new = self.value if self.value is not None else current * self.factor  # type: ignore[attr-defined]
        return min(max(new, self.min), self.max)  # type: ignore[attr-defined]


def _scale_models(name: str, lo: float, hi: float, *, lo_open: bool, what: str) -> tuple[type, type]:
    """The operator body and the rule action of a multiplier command on ``(lo, hi]`` or ``[lo, hi]``."""
    lower = {"gt": lo} if lo_open else {"ge": lo}
    num = dict(strict=True, allow_inf_nan=False, le=hi)
    request = create_model(
        f"{_camel(name)}Request", __base__=_ScaleRequest, __doc__=f"Body of ``POST /v1/runs/{{run}}/{name.replace('_', '-')}``: {what}.",
        scale=(float | None, Field(default=None, description="The new multiplier.", **lower, **num)),
        factor=(float | None, Field(default=None, gt=0, description="Multiplies the current multiplier.", **num)),
    )
    action = create_model(
        f"{_camel(name)}Action", __base__=_ScaleAction, __doc__=f"Rule action: {what}, clamped to [min, max].",
        type=(Literal[name], name),  # type: ignore[valid-type]
        value=(float | None, Field(default=None, **lower, **num)),
        factor=(float | None, Field(default=None, gt=0, **num)),
        min=(float, Field(default=lo if not lo_open else LR_SCALE_MIN, **lower, **num)),
        max=(float, Field(default=hi, **lower, **num)),
    )
    return request, action


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


class AccumulationRequest(CommandRequest):
    """Body of ``POST /v1/runs/{run}/accumulation``: the number of gradient accumulation steps
    every rank uses from the next agreed step boundary, and how the LR follows it."""

    steps: Int = Field(ge=1, le=MAX_ACCUMULATION_STEPS, description="Micro-batches per optimizer step on every rank.")
    lr_rule: LrRule = Field(default="sqrt", description="How the LR follows the change of the global batch: linear "
                            "(x k/k0), sqrt (x sqrt(k/k0)) or none.")


class AccumulationAction(RuleAction):
    """Multiply the gradient accumulation steps of a run that opted in by ``factor`` (rounded,
    at least one step in the factor's direction, within [min_steps, max_steps]), the LR following
    by ``lr_rule``: the adaptive batch size (grow the batch while the gradient variance is low,
    shrink it while it is high). A run that did not opt in is left as it is."""

    type: Literal["accumulation"] = "accumulation"
    factor: float = Field(gt=0, le=1000, allow_inf_nan=False, description="Multiplies the steps in force (the run's own "
                          "when no command set them): above 1 grows the global batch, below 1 shrinks it.")
    min_steps: Int = Field(default=1, ge=1, le=MAX_ACCUMULATION_STEPS)
    max_steps: Int = Field(default=64, ge=1, le=MAX_ACCUMULATION_STEPS)
    lr_rule: LrRule = "sqrt"

    @model_validator(mode="after")
    def _bounds(self) -> "AccumulationAction":
        if self.min_steps > self.max_steps:
            raise ValueError("accumulation: min_steps must be <= max_steps")
        if self.factor == 1.0:
            raise ValueError("accumulation: a factor of 1 changes nothing")
        return self

    def steps(self, current: int) -> int:
        """The steps after ``current``: ``current x factor`` rounded half up, moved at least one
        step in the factor's direction, clamped to [min_steps, max_steps]."""
        new = math.floor(current * self.factor + 0.5)
        if new == current:
            new += 1 if self.factor > 1 else -1
        return min(max(new, self.min_steps), self.max_steps)


class DataSkipRequest(CommandRequest):
    """The data-skip rung's parameters: the first and the last step whose optimizer step every rank
    skips (the steps whose batches are bad)."""

    first: Int = Field(default=0, ge=0, le=MAX_INT, description=(
        "The first step whose optimizer step is skipped; 0: every step up to 'until'."))
    until: Int = Field(ge=0, le=MAX_INT, description="The last step whose optimizer step is skipped.")

    @model_validator(mode="after")
    def _first_before_until(self) -> DataSkipRequest:
        if self.first > self.until:
            raise ValueError(f"first ({self.first}) is after until ({self.until})")
        return self


class GradClipRequest(CommandRequest):
    """Body of ``POST /v1/runs/{run}/grad-clip``: every rank clips the global gradient norm (over
    all shards) to ``max_norm`` before each optimizer step, on top of the run's own clipping; 0
    ends the controller's clipping."""

    max_norm: float = Field(strict=True, ge=0, le=MAX_GRAD_CLIP, allow_inf_nan=False,
                            description="The global gradient norm to clip to; 0 ends the controller's clipping.")


class ResetOptimizerRequest(CommandRequest):
    """Body of ``POST /v1/runs/{run}/reset-optimizer``: every rank drops the optimizer state
    (moments, step counts; sharded state included) of the parameters whose names start with one of
    ``layers`` (all parameters when empty), at the same step; the optimizer starts those moments
    afresh on the next step."""

    layers: list[str] = Field(default_factory=list, max_length=MAX_RESET_LAYERS,
                              description="Parameter-name prefixes (e.g. 'layers.11.'); none: every parameter.")

    @model_validator(mode="after")
    def _names(self) -> "ResetOptimizerRequest":
        _check_layers(self.layers)
        return self


def _check_layers(layers: Sequence[str]) -> None:
    for name in layers:
        if not name or len(name) > 256 or "," in name or any(ord(c) < 32 for c in name):
            raise ValueError(f"a layer name prefix is 1-256 characters without commas or control characters, got {name!r}")


class PauseAction(RuleAction):
    type: Literal["pause"] = "pause"


class CheckpointAction(RuleAction):
    type: Literal["checkpoint"] = "checkpoint"


class StopAction(RuleAction):
    type: Literal["stop"] = "stop"


class MemoryTraceAction(RuleAction):
    """Ask the agent to attribute memory kept alive across steps to layers or the loop (a few
    steps); its result is stored with the run and shown with the alert."""

    type: Literal["memory_trace"] = "memory_trace"


class VerifyAction(RuleAction):
    """Ask every rank to recompute the next step's gradient and compare (silent data corruption)."""

    type: Literal["verify"] = "verify"


class VerifyFloat32Action(RuleAction):
    """Ask every rank to recompute the next step's gradient with mixed precision off and compare
    it with the step's own (the troubleshooting guide's float32 check of an AMP run)."""

    type: Literal["verify_float32"] = "verify_float32"


class RollbackAction(RuleAction):
    """Roll every rank back to the newest good in-memory snapshot (one followed by healthy
    reports, so taken before the onset), multiplying ``lr_scale`` by ``lr_factor``. Without a good
    snapshot the rollback is refused, the reason recorded, and the run paused for a human."""

    type: Literal["rollback"] = "rollback"
    lr_factor: float = Field(default=1.0, ge=LR_SCALE_MIN, le=1.0, allow_inf_nan=False)
    unless_skipped: bool = Field(default=False, description=(
        "No rollback when steps of the report's interval were not taken (the agent skipped a "
        "non-finite or spiking step, or the mixed-precision loss scaler one with non-finite "
        "gradients: the weights as they were): the incident starts at the skip rung, "
        "and the ladder goes on to the rollback if the signals do not come back."))


class GradClipAction(RuleAction):
    """Clip the global gradient norm on every rank: to ``max_norm``, or (without it) to ``factor``
    x the run's healthy gradient norm (the median of its healthy reports before the incident)."""

    type: Literal["grad_clip"] = "grad_clip"
    max_norm: float | None = Field(default=None, gt=0, le=MAX_GRAD_CLIP, allow_inf_nan=False)
    factor: float = Field(default=1.0, gt=0, le=1000, allow_inf_nan=False)


class ResetOptimizerAction(RuleAction):
    """Drop the optimizer state of the named layers (all when empty) on every rank."""

    type: Literal["reset_optimizer"] = "reset_optimizer"
    layers: tuple[str, ...] = Field(default=(), max_length=MAX_RESET_LAYERS)

    @model_validator(mode="after")
    def _names(self) -> "ResetOptimizerAction":
        _check_layers(self.layers)
        return self


LrScaleRequest, LrScaleAction = _scale_models("lr_scale", LR_SCALE_MIN, LR_SCALE_MAX, lo_open=False,
                                              what="the LR multiplier (every group's LR = the scheduler's x this)")
MomentumRequest, MomentumAction = _scale_models(
    "momentum", 0.0, MOMENTUM_SCALE_MAX, lo_open=True,
    what="the momentum multiplier (Adam-style beta1 and SGD momentum = the run's own x this, at most 0.999)")
WeightDecayScaleRequest, WeightDecayScaleAction = _scale_models(
    "weight_decay_scale", 0.0, WEIGHT_DECAY_SCALE_MAX, lo_open=False,
    what="the weight-decay multiplier (every group's weight decay = the run's own x this)")

#: What a fold is given: an operator's body or a rule's action.
ActionParams = BaseModel

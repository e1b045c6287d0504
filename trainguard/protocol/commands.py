"""The command registry: every command the controller can give a run, declared once.

A command (:class:`CommandSpec`) says, in one place:

- its **name** — the word operators, rules, Alertmanager's ``trainguard_action`` label and the
  metrics' ``action`` label use; URLs and CLI verbs write it with dashes (``lr-scale``);
- the **desired-state fields** it owns (:class:`StateField`: type, bounds, default, description).
  :class:`DesiredState` is built from them, and so are the ranks' agreement encoding
  (:func:`encode_state` / :func:`decode_state`), the controller's stored state (one JSON value)
  and the actions metric (:func:`action_names`);
- its **operator body** (``request``: the REST body, the CLI's options and the console's inputs),
  its **rule action** (``rule_action``: the model of the rules file's ``{type: <name>, ...}``;
  None: not a rule action), and how either **folds** into the desired state (``fold``);
- who may issue it (``scope``), whether a run must have opted in (``requires_config``), whether an
  operator, Alertmanager, the console see it, and whether the agent must act on it (``agent``:
  ``trainer_agent``'s actuator registered under the same name; a missing or unknown one fails at
  import).

Adding a command: declare it in :data:`REGISTRY` below (fields, request, rule action, fold) and
register its actuator in ``trainer_agent/control/actuators.py`` (``@actuator("<name>")``). The REST route,
the CLI verb, the console's button, the rules' action, Alertmanager's label value, the stored
state, the ranks' agreement and the metrics follow.

Imports neither torch nor FastAPI (both the agent and the controller import it).
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from trainguard.protocol.base import MAX_INT, Int, WireModel

__all__ = [
    "ActionParams", "Change", "DataSkipRequest", "GradClipRequest", "ResetOptimizerRequest", "AccumulationRequest",
    "LrScaleRequest", "MomentumRequest", "WeightDecayScaleRequest", "RuleAction", "PauseAction", "CheckpointAction",
    "StopAction", "MemoryTraceAction", "VerifyAction", "VerifyFloat32Action", "RollbackAction", "LrScaleAction", "GradClipAction",
    "ResetOptimizerAction", "AccumulationAction", "MomentumAction", "WeightDecayScaleAction", "state_texts", "CommandContext", "CommandRefused", "CommandRequest", "CommandSpec", "DesiredState",
    "REGISTRY", "BY_NAME", "RULE_ACTIONS", "STATE_FIELDS", "STATE_LAYOUT_VERSION", "STATE_LEN", "StateField",
    "action_names", "apply_command", "decode_state", "encode_state", "text_key",
    "LR_SCALE_MIN", "LR_SCALE_MAX", "MAX_ACCUMULATION_STEPS", "LR_RULES", "LrRule", "EXIT_HARDWARE_FAULT",
    "MAX_GRAD_CLIP", "MOMENTUM_SCALE_MAX", "WEIGHT_DECAY_SCALE_MAX", "MAX_RESET_LAYERS",
]

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


# -- desired-state fields ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StateField:
    """One field of the desired state.

    ``kind``: ``int`` (in [``ge``, ``le``]), ``bool``, ``float`` (finite, in [``ge``, ``le``] or
    (``gt``, ``le``]), ``choice`` (one of ``choices``) or ``text`` (at most ``max_length``
    characters). In the ranks' agreement every field is one int64: a float as the bits of its
    float64, a choice as its index, a text as :func:`text_key` of it (the text itself travels
    beside the agreement: ``trainer_agent/control/plane.py``)."""

    name: str
    kind: Literal["int", "bool", "float", "choice", "text"]
    default: Any
    description: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    max_length: int = 0

    def pydantic(self) -> tuple[Any, Any]:
        """The (annotation, FieldInfo) of this field in :class:`DesiredState`."""
        if self.kind == "int":
            return Int, Field(default=self.default, ge=self.ge, le=self.le, description=self.description)
        if self.kind == "bool":
            return bool, Field(default=self.default, description=self.description)
        if self.kind == "float":
            return float, Field(default=self.default, strict=True, allow_inf_nan=False, ge=self.ge, gt=self.gt,
                                le=self.le, description=self.description)
        if self.kind == "choice":
            return Literal[self.choices], Field(default=self.default, description=self.description)  # type: ignore[valid-type]
        return str, Field(default=self.default, max_length=self.max_length, description=self.description)

    def encode(self, value: Any) -> int:
        if self.kind == "float":
            return struct.unpack("<q", struct.pack("<d", float(value)))[0]
        if self.kind == "choice":
            return self.choices.index(value)
        if self.kind == "text":
            return text_key(value)
        return int(value)

    def decode(self, v: int, texts: Mapping[int, str]) -> Any:
        """The value ``v`` encodes; ``ValueError`` for one no leader can have sent."""
        if self.kind == "float":
            return struct.unpack("<d", struct.pack("<q", int(v)))[0]
        if self.kind == "bool":
            return bool(v)
        if self.kind == "choice":
            if not 0 <= int(v) < len(self.choices):
                raise ValueError(f"{self.name}: no choice number {v}")
            return self.choices[int(v)]
        if self.kind == "text":
            if int(v) == 0:
                return ""
            if int(v) not in texts:
                raise ValueError(f"{self.name}: the text of key {v} did not arrive")
            return texts[int(v)]
        return int(v)


def text_key(text: str) -> int:
    """A text field's int64 in the agreement: 0 for the empty text, else 63 bits of its BLAKE2b
    digest (never 0)."""
    if not text:
        return 0
    return (int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1) or 1


# -- operator bodies and rule actions ---------------------------------------------------------
class CommandRequest(WireModel):
    """Body of an operator command without parameters (pause, resume, checkpoint, stop, ...)."""

    reason: str = Field(default="", max_length=2000)


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
    """The data-skip rung's parameter: the last step whose optimizer step every rank skips."""

    until: Int = Field(ge=0, le=MAX_INT, description="The last step whose optimizer step is skipped.")


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
        "No rollback when the agent skipped steps in the report's interval (a non-finite or spiking "
        "step it did not take left the weights as they were): the incident starts at the skip rung, "
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


# -- folding commands into the desired state --------------------------------------------------
@dataclass(frozen=True, slots=True)
class Change:
    """A fold's result: the desired-state fields to set, and a note for the reason (what was
    measured or refused)."""

    updates: dict[str, Any] = field(default_factory=dict)
    note: str = ""


class CommandRefused(ValueError):
    """An operator's command that cannot be carried out now (the API answers 409 with the reason)."""


class CommandContext(Protocol):
    """What the folds that measure need from the run (the controller's ``RunRecovery``)."""

    def rollback_target(self) -> tuple[int | None, str]:
        """The step of the newest good snapshot, or None and why there is none."""

    def skipped_now(self) -> int:
        """Steps the agent skipped since the previous report (non-finite or spiking)."""

    def healthy_median(self, metric: str) -> float | None:
        """The median of ``metric`` over the run's healthy reports before the incident (None: none)."""

    def own_accumulation(self) -> int | None:
        """The run's own accumulation steps (its registration's ``accumulation_steps``; None: the
        run did not opt in to the ``accumulation`` command)."""


Fold = Callable[[Any, Any, "CommandContext | None"], Change]


def _seq(field_name: str) -> Fold:
    return lambda d, p, ctx: Change({field_name: getattr(d, field_name) + 1})


def _scale(field_name: str, lo: float, hi: float) -> Fold:
    def fold(d: Any, p: Any, ctx: Any) -> Change:
        if isinstance(p, _ScaleAction):
            return Change({field_name: p.apply(getattr(d, field_name))})
        new = p.scale if p.scale is not None else getattr(d, field_name) * p.factor
        return Change({field_name: min(max(new, lo), hi)})
    return fold


def _rollback(d: Any, p: Any, ctx: CommandContext | None) -> Change:
    target, why = ctx.rollback_target() if ctx is not None else (None, "no snapshot is known")
    if not isinstance(p, RollbackAction):  # an operator's: refused with the reason
        if target is None:
            raise CommandRefused(f"rollback refused: {why}")
        return Change({"rollback_seq": d.rollback_seq + 1, "rollback_step": target})
    skipped = ctx.skipped_now() if ctx is not None and p.unless_skipped else 0
    if skipped:
        return Change(note=f"no rollback: the agent skipped {skipped} step(s) and left the weights as they were")
    if target is None:
        return Change({"paused": True}, f"rollback refused: {why}; paused for a human")
    scale = min(max(d.lr_scale * p.lr_factor, LR_SCALE_MIN), LR_SCALE_MAX)
    return Change({"rollback_seq": d.rollback_seq + 1, "rollback_step": target, "lr_scale": scale},
                  f"rollback to the snapshot of step {target}" + (f", lr_scale {scale:.4g}" if p.lr_factor != 1.0 else ""))


def _grad_clip(d: Any, p: Any, ctx: CommandContext | None) -> Change:
    if isinstance(p, GradClipRequest):
        return Change({"grad_clip_norm": p.max_norm})
    if p.max_norm is not None:
        return Change({"grad_clip_norm": p.max_norm})
    healthy = ctx.healthy_median("trainguard_grad_norm") if ctx is not None else None
    if healthy is None or not math.isfinite(healthy) or healthy <= 0:
        return Change(note="no clipping: no healthy gradient norm measured before the incident")
    norm = min(healthy * p.factor, MAX_GRAD_CLIP)
    return Change({"grad_clip_norm": norm}, f"gradient norm clipped to {norm:.4g} ({p.factor:g} x the healthy {healthy:.4g})")


def _accumulation(d: Any, p: Any, ctx: CommandContext | None) -> Change:
    if isinstance(p, AccumulationRequest):
        return Change({"accumulation_steps": p.steps, "accumulation_lr_rule": p.lr_rule})
    if d.paused or d.stop:  # a human's now (e.g. an escalated incident paused it)
        return Change(note="no accumulation change: the run is " + ("stopped" if d.stop else "paused"))
    own = ctx.own_accumulation() if ctx is not None else None
    if own is None:
        return Change(note="no accumulation change: the run did not opt in (attach the agent with accumulation_steps=N)")
    current = d.accumulation_steps or own
    steps = p.steps(current)
    if (steps - current) * (p.factor - 1.0) <= 0:  # at its bound (or beyond it) already
        return Change(note=f"accumulation steps stay {current}: at the bound "
                           f"{p.max_steps if p.factor > 1 else p.min_steps}")
    return Change({"accumulation_steps": steps, "accumulation_lr_rule": p.lr_rule},
                  f"accumulation steps {current} -> {steps} (x{p.factor:g}; the run's own {own}, LR rule {p.lr_rule})")


def _reset_optimizer(d: Any, p: Any, ctx: CommandContext | None) -> Change:
    layers = ",".join(p.layers)
    return Change({"reset_optimizer_seq": d.reset_optimizer_seq + 1, "reset_optimizer_layers": layers},
                  "optimizer state reset for " + (f"the layers {layers}" if layers else "every layer"))


# -- the registry -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CommandSpec:
    """One command (see the module docstring)."""

    name: str
    summary: str
    fold: Fold
    fields: tuple[StateField, ...] = ()
    request: type[CommandRequest] = CommandRequest
    rule_action: type[RuleAction] | None = None
    kind: Literal["control", "diagnostic"] = "control"
    operator: bool = True
    """A REST route, a CLI verb and a console button."""
    alertmanager: bool = True
    """A value of Alertmanager's ``trainguard_action`` label."""
    console: bool = True
    scope: str = "command"
    requires_config: tuple[str, str] | None = None
    """(registration config key, why): the run must have registered with an integer there."""
    agent: bool = True
    """The agent acts on its fields (an actuator is registered under its name)."""
    counted: Callable[[Any, Any], bool] | None = None
    """Whether a change from one desired state to the next counts as this command (default: any
    of its fields changed)."""
    remedy: bool = False
    """An optimizer remedy: a rung the optimizer fault's ladder may name (its rule action with the
    defaults), refused for the other causes' ladders and for the rules' actions on a data,
    hardware or schedule incident."""
    measures: tuple[str, ...] = ()
    """The metrics whose healthy median its fold reads (:meth:`CommandContext.healthy_median`):
    the controller keeps them from the healthy reports."""

    @property
    def url(self) -> str:
        """Its spelling in URLs and CLI verbs."""
        return self.name.replace("_", "-")

    def changed(self, before: Any, after: Any) -> bool:
        if self.counted is not None:
            return self.counted(before, after)
        return any(getattr(before, f.name) != getattr(after, f.name) for f in self.fields)


def _f(name: str, kind: Any, default: Any, description: str, **kw: Any) -> StateField:
    return StateField(name, kind, default, description, **kw)


_SEQ = dict(ge=0, le=MAX_INT)

#: Every command, in the order of the ranks' agreement encoding (pinned by
#: ``tests/protocol/test_commands.py``; :data:`STATE_LAYOUT_VERSION` changes with it).
REGISTRY: tuple[CommandSpec, ...] = (
    CommandSpec(
        "pause", "Pause the run in place (every rank, same step)", lambda d, p, ctx: Change({"paused": True}),
        fields=(_f("paused", "bool", False, "Every rank waits at the agreed step until this is false."),),
        rule_action=PauseAction, counted=lambda b, a: a.paused and not b.paused),
    CommandSpec(
        "resume", "Resume a paused (or stopped) run",
        lambda d, p, ctx: Change({"paused": False, "stop": False, "stop_exit_code": 0}),
        counted=lambda b, a: (b.paused and not a.paused) or (b.stop and not a.stop), agent=False),
    CommandSpec(
        "checkpoint", "Request a checkpoint (bumps checkpoint_seq)", _seq("checkpoint_seq"),
        fields=(_f("checkpoint_seq", "int", 0, "A checkpoint is due when this exceeds the last one taken.", **_SEQ),),
        rule_action=CheckpointAction),
    CommandSpec(
        "stop", "Stop the run", lambda d, p, ctx: Change({"stop": True}),
        fields=(_f("stop", "bool", False, "Every rank stops at the agreed step (after a checkpoint)."),
                _f("stop_exit_code", "int", 0, "With stop: the exit status the training processes should end with "
                   "(Agent.exit_code); EXIT_HARDWARE_FAULT when the controller stopped the run for a restart without "
                   "a faulty node; 0 otherwise.", ge=0, le=255)),
        rule_action=StopAction, counted=lambda b, a: a.stop and not b.stop),
    CommandSpec(
        "lr_scale", f"Set the LR multiplier (in [{LR_SCALE_MIN:g}, {LR_SCALE_MAX:g}]): an absolute scale or a factor",
        _scale("lr_scale", LR_SCALE_MIN, LR_SCALE_MAX),
        fields=(_f("lr_scale", "float", 1.0, "Multiplies the scheduler's LR.", gt=0.0, le=LR_SCALE_MAX),),
        request=LrScaleRequest, rule_action=LrScaleAction),
    CommandSpec(
        "rollback", "Roll every rank back to the newest good in-memory snapshot (409 with the reason when there is none)",
        _rollback,
        fields=(_f("rollback_seq", "int", 0, "A rollback is due when this exceeds the last one applied.", **_SEQ),
                _f("rollback_step", "int", 0, "The rollback restores the newest snapshot taken at or before this step.",
                   **_SEQ)),
        rule_action=RollbackAction, counted=lambda b, a: a.rollback_seq != b.rollback_seq),
    CommandSpec(
        "accumulation", "Set the gradient accumulation steps (runs that opted in), the LR following by a rule",
        _accumulation,
        fields=(_f("accumulation_steps", "int", 0, "Gradient accumulation steps per optimizer step for runs that "
                   "opted in; 0: the run's own.", ge=0, le=MAX_ACCUMULATION_STEPS),
                _f("accumulation_lr_rule", "choice", "none", "How the LR follows accumulation_steps relative to the "
                   "run's own.", choices=LR_RULES)),
        request=AccumulationRequest, rule_action=AccumulationAction, alertmanager=False,
        requires_config=("accumulation_steps", "attach the agent with accumulation_steps=N to opt in")),
    CommandSpec(
        "memory_trace", "Trace which layers or the training loop keep memory alive across steps (a few steps); the "
        "result appears in the run's memory_report", _seq("memory_trace_seq"),
        fields=(_f("memory_trace_seq", "int", 0, "A memory trace is due when this exceeds the last one started.", **_SEQ),),
        rule_action=MemoryTraceAction, kind="diagnostic"),
    CommandSpec(
        "verify", "Recompute the next step's gradient on every rank and compare (silent data corruption)",
        _seq("verify_seq"),
        fields=(_f("verify_seq", "int", 0, "A gradient recompute check of the next step is due when this exceeds the "
                   "last one armed.", **_SEQ),),
        rule_action=VerifyAction, kind="diagnostic"),
    CommandSpec(
        "data_skip", "Skip the optimizer steps of a data fault's batches on every rank (the incident's data_skip rung)",
        lambda d, p, ctx: Change({"data_skip_until": p.until}), request=DataSkipRequest,
        fields=(_f("data_skip_until", "int", 0, "Every rank skips the optimizer step of each step up to and including "
                   "this one (a data fault: the batches are not learned from; the LR is untouched); 0: none.", **_SEQ),),
        operator=False, alertmanager=False, console=False),
    CommandSpec(
        "grad_clip", "Clip the global gradient norm on every rank before each optimizer step (0: end the clipping)",
        _grad_clip,
        fields=(_f("grad_clip_norm", "float", 0.0, "Every rank clips the global gradient norm (over all shards) to "
                   "this before each optimizer step; 0: the run's own clipping only.", ge=0.0, le=MAX_GRAD_CLIP),),
        request=GradClipRequest, rule_action=GradClipAction, remedy=True, measures=("trainguard_grad_norm",)),
    CommandSpec(
        "reset_optimizer", "Drop the optimizer state (moments) of all or the named layers on every rank",
        _reset_optimizer,
        fields=(_f("reset_optimizer_seq", "int", 0, "A reset of the optimizer state is due when this exceeds the last "
                   "one applied.", **_SEQ),
                _f("reset_optimizer_layers", "text", "", "Comma-separated parameter-name prefixes whose optimizer "
                   "state the reset drops; empty: every parameter.", max_length=MAX_RESET_LAYERS * 257)),
        request=ResetOptimizerRequest, rule_action=ResetOptimizerAction, remedy=True,
        counted=lambda b, a: a.reset_optimizer_seq != b.reset_optimizer_seq),
    CommandSpec(
        "momentum", "Scale the optimizer's momentum (beta1, SGD momentum) on every rank: a scale or a factor",
        _scale("momentum_scale", 0.0, MOMENTUM_SCALE_MAX),
        fields=(_f("momentum_scale", "float", 1.0, "Multiplies each group's own momentum (Adam-style beta1, SGD "
                   "momentum); the result is held below 1 (at most 0.999).", gt=0.0, le=MOMENTUM_SCALE_MAX),),
        request=MomentumRequest, rule_action=MomentumAction),
    CommandSpec(
        "weight_decay_scale", "Scale the optimizer's weight decay on every rank: a scale or a factor",
        _scale("weight_decay_scale", 0.0, WEIGHT_DECAY_SCALE_MAX),
        fields=(_f("weight_decay_scale", "float", 1.0, "Multiplies each group's own weight decay.", ge=0.0,
                   le=WEIGHT_DECAY_SCALE_MAX),),
        request=WeightDecayScaleRequest, rule_action=WeightDecayScaleAction),
    CommandSpec(
        "verify_float32", "Recompute the next step's gradient on every rank with mixed precision off and compare it "
        "with the step's (are the numerics of autocast the cause?)", _seq("verify_float32_seq"),
        fields=(_f("verify_float32_seq", "int", 0, "A float32 recompute of the next step is due when this exceeds the "
                   "last one armed.", **_SEQ),),
        rule_action=VerifyFloat32Action, kind="diagnostic"),
)

BY_NAME: dict[str, CommandSpec] = {c.name: c for c in REGISTRY}
#: Every desired-state field a command owns, in the agreement's order.
STATE_FIELDS: tuple[StateField, ...] = tuple(f for c in REGISTRY for f in c.fields)
#: The rules' action models that are commands: ``type`` -> the command.
RULE_ACTIONS: dict[type, CommandSpec] = {c.rule_action: c for c in REGISTRY if c.rule_action is not None}


def _check_registry() -> None:
    names = [f.name for f in STATE_FIELDS]
    if len(names) != len(set(names)) or {"generation", "reason"} & set(names):
        raise TypeError(f"desired-state fields declared twice or reserved: {names}")
    for c in REGISTRY:
        if c.rule_action is not None and c.rule_action.model_fields["type"].default != c.name:
            raise TypeError(f"command {c.name}: its rule action's type is {c.rule_action.model_fields['type'].default!r}")
        if c.remedy:
            if c.rule_action is None:
                raise TypeError(f"command {c.name}: a remedy (a ladder's rung) needs a rule action")
            c.rule_action()  # a rung is the action with its defaults


_check_registry()

DesiredState = create_model(
    "DesiredState",
    __base__=WireModel,
    __doc__="What the controller wants a run to be doing. Level-based: every value is absolute, so applying the "
            "same generation twice changes nothing. Each field belongs to a command "
            "(``trainguard.protocol.commands.REGISTRY``).",
    __module__=__name__,
    generation=(Int, Field(default=0, ge=0, le=MAX_INT, description="Bumped on every change.")),
    **{f.name: f.pydantic() for f in STATE_FIELDS},
    reason=(str, Field(default="", max_length=2000)),
)

#: The agreement's layout: ``generation`` then :data:`STATE_FIELDS`, one int64 each.
STATE_LEN = 1 + len(STATE_FIELDS)
#: Changes whenever the layout does (a field added, removed or moved): ranks of one job run one
#: agent version, and the pinned test says when this must change.
STATE_LAYOUT_VERSION = 3


def encode_state(d: Any) -> list[int]:
    """The desired state as :data:`STATE_LEN` int64 (floats as their bits, texts as :func:`text_key`)."""
    return [int(d.generation), *(f.encode(getattr(d, f.name)) for f in STATE_FIELDS)]


def state_texts(d: Any) -> dict[int, str]:
    """The texts :func:`encode_state` encodes by key (what must travel beside the agreement)."""
    return {text_key(v): v for f in STATE_FIELDS if f.kind == "text" and (v := getattr(d, f.name))}


def decode_state(v: Sequence[int], texts: Mapping[int, str] | None = None) -> Any:
    """Inverse of :func:`encode_state`; ``ValueError`` for values no leader can have sent (a
    wrong length, a choice out of range, a text that did not arrive, a value out of bounds)."""
    if len(v) != STATE_LEN:
        raise ValueError(f"a desired state has {STATE_LEN} values, got {len(v)}")
    values = {f.name: f.decode(x, texts or {}) for f, x in zip(STATE_FIELDS, v[1:])}
    try:
        return DesiredState(generation=int(v[0]), **values)
    except ValueError as exc:
        raise ValueError(f"an encoded desired state out of bounds: {exc}") from None


def action_names(before: Any, after: Any) -> list[str]:
    """The commands that lead from ``before`` to ``after`` (labels of the actions metric)."""
    return [c.name for c in REGISTRY if c.changed(before, after)]


def apply_command(desired: Any, spec: CommandSpec, params: Any, ctx: CommandContext | None = None) -> tuple[dict[str, Any], str]:
    """The fields ``spec`` changes for ``params`` (an operator's body or a rule's action) and the
    fold's note; only fields whose value differs are returned. ``CommandRefused`` when an
    operator's command cannot be carried out."""
    change = spec.fold(desired, params, ctx)
    return {k: v for k, v in change.updates.items() if getattr(desired, k) != v}, change.note

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

Here: the desired-state fields, :class:`CommandSpec`, :data:`REGISTRY` and what is derived from it
(:class:`DesiredState`, the agreement encoding, :func:`apply_command`). The request and rule-action
models and their bounds are declared in ``command_models.py``, the folds in ``command_folds.py``;
every importer takes them from this module.

Imports neither torch nor FastAPI (both the agent and the controller import it).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, create_model

from trainguard.protocol.base import MAX_INT, Int, WireModel
from trainguard.protocol.command_folds import (
    Change,
    CommandContext,
    CommandRefused,
    Fold,
    _accumulation,
    _grad_clip,
    _reset_optimizer,
    _rollback,
    _scale,
    _seq,
)
from trainguard.protocol.command_models import (
    EXIT_HARDWARE_FAULT,
    LR_RULES,
    LR_SCALE_MAX,
    LR_SCALE_MIN,
    MAX_ACCUMULATION_STEPS,
    MAX_GRAD_CLIP,
    MAX_RESET_LAYERS,
    MOMENTUM_SCALE_MAX,
    WEIGHT_DECAY_SCALE_MAX,
    AccumulationAction,
    AccumulationRequest,
    ActionParams,
    CheckpointAction,
    CommandRequest,
    DataSkipRequest,
    GradClipAction,
    GradClipRequest,
    LrRule,
    LrScaleAction,
    LrScaleRequest,
    MemoryTraceAction,
    MomentumAction,
    MomentumRequest,
    PauseAction,
    ResetOptimizerAction,
    ResetOptimizerRequest,
    RollbackAction,
    RuleAction,
    StopAction,
    VerifyAction,
    VerifyFloat32Action,
    WeightDecayScaleAction,
    WeightDecayScaleRequest,
)

__all__ = [
    "ActionParams", "Change", "DataSkipRequest", "GradClipRequest", "ResetOptimizerRequest", "AccumulationRequest",
    "LrScaleRequest", "MomentumRequest", "WeightDecayScaleRequest", "RuleAction", "PauseAction", "CheckpointAction",
    "StopAction", "MemoryTraceAction", "VerifyAction", "VerifyFloat32Action", "RollbackAction", "LrScaleAction", "GradClipAction",
    "ResetOptimizerAction", "AccumulationAction", "MomentumAction", "WeightDecayScaleAction", "state_texts", "CommandContext", "CommandRefused", "CommandRequest", "CommandSpec", "DesiredState",
    "REGISTRY", "BY_NAME", "RULE_ACTIONS", "STATE_FIELDS", "STATE_INDEX", "STATE_LAYOUT_VERSION", "STATE_LEN",
    "StateField",
    "action_names", "apply_command", "decode_state", "encode_state", "text_key",
    "LR_SCALE_MIN", "LR_SCALE_MAX", "MAX_ACCUMULATION_STEPS", "LR_RULES", "LrRule", "EXIT_HARDWARE_FAULT",
    "MAX_GRAD_CLIP", "MOMENTUM_SCALE_MAX", "WEIGHT_DECAY_SCALE_MAX", "MAX_RESET_LAYERS",
]

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
        lambda d, p, ctx: Change({"data_skip_until": p.until, "data_skip_from": p.first}), request=DataSkipRequest,
        fields=(_f("data_skip_until", "int", 0, "Every rank skips the optimizer step of each step from data_skip_from "
                   "up to and including this one (a data fault: the batches are not learned from; the LR is untouched); "
                   "0: none.", **_SEQ),
                _f("data_skip_from", "int", 0, "The first step data_skip_until's skip covers (the first bad batch's): "
                   "a job that resumes from an earlier checkpoint trains on the steps before it; 0: every step up to "
                   "data_skip_until (a controller older than this field).", **_SEQ)),
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
#: Each field's place in that layout (``generation`` is at 0).
STATE_INDEX: dict[str, int] = {f.name: i + 1 for i, f in enumerate(STATE_FIELDS)}
#: Changes whenever the layout does (a field added, removed or moved): ranks of one job run one
#: agent version, and the pinned test says when this must change.
STATE_LAYOUT_VERSION = 4


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

"""The actuators: what the control plane changes in training. Everything else in the agent observes.

**One actuator per command.** Each command of ``trainguard.protocol.commands.REGISTRY`` that the
agent acts on (``agent=True``) has exactly one class here registered under its name
(``@actuator("<name>")``); importing ``trainer_agent.control.plane`` checks that every such command has
one and that no actuator names an unknown command (:func:`check_actuators`: ``TypeError`` naming
them). The control plane
(``trainer_agent/control/plane.py``) builds one of each with an :class:`ActuatorEnv` (the narrow objects
it acts on) and, when every rank has agreed on a newer desired state, calls each one's
:meth:`Actuator.apply` at the same step on every rank. The actuators live in
``trainer_agent/control/run_actuators.py`` (pause, stop, checkpoint, LR, rollback, accumulation,
diagnostics, data skip) and ``trainer_agent/control/optimizer_actuators.py`` (gradient clipping, optimizer
reset, momentum, weight decay); adding a command's actuator means adding a class to one of them.

Mechanisms the actuators share:

- ``GroupOverride`` and ``LrScale`` (``trainer_agent/control/group_override.py``): a param-group key
  set for the optimizer step (its pre-hook) and restored after it (post-hook), so LR schedulers and
  checkpoints keep the run's own values; the LR times the product of the actuators' ``lr_factor``.
- :class:`NonfiniteSkip`: the optimizer's ``step`` wrapped so that a step whose gradients hold a
  NaN/Inf on any rank — or, with a :class:`~trainer_agent.control.spike_guard.SpikeGuard`, whose gradient
  norm spikes on any rank — is not taken on any rank; nor a step the controller's data skip covers
  (``data_skip``: the same answer on every rank, from the agreed state, with no read or collective).

The pause's wait is the control plane's (``trainer_agent/control/plane.py``): it applies further states
while it waits, with the client and the c10d store.
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import wraps
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from trainguard.protocol import commands
from trainer_agent.measure import optim, stats
from trainer_agent.control.spike_guard import SpikeGuard

__all__ = ["ACTUATORS", "Actuator", "ActuatorEnv", "NonfiniteSkip", "SKIP_REASONS", "Sequenced",
           "actuator", "check_actuators", "malformed", "state_value"]

#: The actuators log under the control plane's name (``trainer_agent/control/plane.py``).
log = logging.getLogger("trainer_agent.control.plane")

#: Why a step was skipped (``trainguard_skipped_steps_total{reason}``), by the flag value the
#: ranks all-reduce (max: a non-finite gradient on any rank wins over a spike on another).
SKIP_REASONS: dict[int, str] = {1: "spike", 2: "nonfinite"}


@dataclass(frozen=True, slots=True)
class ActuatorEnv:
    """What an actuator may act on and call: the same on every rank except ``leader``."""

    optimizer: torch.optim.Optimizer
    leader: bool
    """Global rank 0: the one rank that logs what was done."""
    on_error: Callable[[str, BaseException], None]
    """Counts an agent error of a kind (once logged); training goes on."""
    named_parameters: Callable[[], Iterable[tuple[str, torch.Tensor]]] = lambda: ()
    """The model's parameters by name (``model.named_parameters``; sharded ones as DTensors)."""
    own_accumulation: int | None = None
    """The run's own accumulation steps when it lets the controller change them (else None)."""
    on_checkpoint: Callable[[int], Any] | None = None
    on_rollback: Callable[[int], int | None] | None = None
    on_diagnose: Callable[[str, int], Any] | None = None


class Actuator:
    """Base of the actuators: every method is optional (the base does nothing).

    ``phase``: actuators apply in phases, in the registry's order within one; phase 1 (checkpoint,
    stop) acts after every other change of the same state (a checkpoint keeps the state a rollback
    restored)."""

    command: ClassVar[str] = ""
    phase: ClassVar[int] = 0

    def __init__(self, env: ActuatorEnv) -> None:
        self.env = env

    def start(self, initial: Any, before: Mapping[str, int] | None) -> None:
        """The state agreed before the first step of this process (the registration's), and the
        sequence numbers of the state the run's processes last applied (``before``, by field;
        None: not known). :meth:`apply` follows with ``initial``."""

    def apply(self, new: Any, old: Any, step: int) -> None:
        """Act on a newer agreed ``new`` state (``old``: the one applied before), after the
        optimizer step of ``step``: called on every rank at the same step."""

    def before_step(self) -> None:
        """Optimizer pre-hook (after the run's own gradient clipping)."""

    def after_step(self) -> None:
        """Optimizer post-hook."""

    def lr_factor(self) -> float:
        """This actuator's multiplier of the LR for the step (the factors multiply)."""
        return 1.0

    def values(self) -> dict[str, float]:
        """Its metrics (host values; read from the /metrics thread)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What the training checkpoint keeps of it (keys of the control plane's flat state)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], newer: bool) -> None:
        """Restore :meth:`state_dict`'s keys from ``state``; ``newer``: the checkpoint's generation
        is not older than the applied one (levels then come from it). ``ValueError`` via
        :func:`malformed` for a bad value."""


class Sequenced(Actuator):
    """Acts once per newer ``seq_field`` (the largest one served is kept). At registration (:meth:`judge`:
    at start, or late, ``StateAgreement``) a request some process of the run applied counts as served;
    one none applied is ``due`` when ``carried`` (a checkpoint, a diagnostic): acted on at the first step
    every rank agrees at (:meth:`serve_due`), after the run restored its checkpoint, unless that served
    it. One that changes training (a rollback, an optimizer reset) was aimed at the state of the process
    that ended and is not taken (logged): the job resumes from its own checkpoint instead."""

    seq_field: ClassVar[str] = ""
    carried: ClassVar[bool] = False

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.served = 0
        self.due = 0  # a request agreed at start that no process applied (0: none)

    def start(self, initial: Any, before: Mapping[str, int] | None) -> None:
        self.judge(getattr(initial, self.seq_field), before)

    def judge(self, seq: int, before: Mapping[str, int] | None) -> None:
        unserved = before is not None and seq > max(self.served, before.get(self.seq_field, seq))
        self.served = max(self.served, seq)
        if unserved and self.carried:
            self.due = seq
        elif unserved and self.env.leader:
            log.warning("trainguard: a %s requested before this process registered is not taken: it was meant "
                        "for the process that ended; this one resumes from its own checkpoint", self.command)

    def apply(self, new: Any, old: Any, step: int) -> None:
        seq = getattr(new, self.seq_field)
        if seq > self.served:
            self.served, self.due = seq, 0
            self.act(new, step)

    def serve_due(self, applied: Any, step: int) -> None:
        """Act on the request due since start (if any) at ``step``, with the state applied now."""
        if self.due:
            self.due = 0
            self.act(applied, step)

    def act(self, new: Any, step: int) -> None:
        """The request itself (once per newer sequence number)."""
        raise NotImplementedError

    def persisted_served(self, state: Mapping[str, Any]) -> None:
        """The larger of the served number and the checkpoint's (absent: 0); a request due since
        start that the checkpoint served is no longer due."""
        persisted = state_value(state, self.seq_field, int, 0, ok=lambda v: v >= 0)
        self.served = max(self.served, persisted)
        if persisted >= self.due:
            self.due = 0


#: command name -> its actuator class.
ACTUATORS: dict[str, type[Actuator]] = {}


def actuator(name: str) -> Callable[[type[Actuator]], type[Actuator]]:
    """Class decorator: the actuator of command ``name`` (``TypeError`` for a second one)."""
    def register(cls: type[Actuator]) -> type[Actuator]:
        if name in ACTUATORS:
            raise TypeError(f"command {name!r} has two actuators: {ACTUATORS[name].__name__} and {cls.__name__}")
        cls.command = name
        ACTUATORS[name] = cls
        return cls
    return register


def check_actuators(registry: Iterable[Any] | None = None, actuators: Mapping[str, type] | None = None) -> None:
    """``TypeError`` naming every command the agent must act on that has no actuator, and every
    actuator of a command the registry does not know or that the agent does not act on."""
    registry = tuple(commands.REGISTRY if registry is None else registry)
    actuators = ACTUATORS if actuators is None else actuators
    needed = {c.name for c in registry if c.agent}
    missing, unknown = sorted(needed - actuators.keys()), sorted(actuators.keys() - needed)
    problems = ([f"no actuator for {', '.join(missing)}"] if missing else []) + (
        [f"actuators of commands the agent does not act on or that do not exist: {', '.join(unknown)}"]
        if unknown else [])
    if problems:
        raise TypeError("the agent's actuators do not match the command registry: " + "; ".join(problems))


def malformed(what: str) -> ValueError:
    return ValueError(f"malformed trainguard control state: {what}")


def state_value(state: Mapping[str, Any], key: str, kind: type, default: Any = None, *,
                ok: Callable[[Any], bool] = lambda v: True) -> Any:
    """``state[key]`` as ``kind`` (``default`` when absent and not None; else required),
    ``ValueError`` when it is not one or fails ``ok``."""
    if key not in state and default is not None:
        return default
    try:
        value = kind(state[key])
    except (KeyError, TypeError, ValueError) as exc:
        raise malformed(f"{key}: {exc!r}") from None
    if kind is float and not math.isfinite(value) or not ok(value):
        raise malformed(f"{key} = {state[key]!r}")
    return value


class NonfiniteSkip:
    """Wraps ``optimizer.step``: before the real step every rank reads whether its global gradient
    norm (``grad_norm()``, measured by the agent at the end of backward, after DDP's all-reduce, in
    float64: finite exactly when every gradient element is) is finite — SYNC: one device read per
    optimizer step — and the ranks all-reduce (max) that flag on ``group``. If any rank saw a
    non-finite gradient, no rank takes the step: parameters and optimizer state stay bit-identical.
    A non-finite *loss* with finite gradients is not skipped (the loss reaches the agent only after
    the step; it is counted in ``trainguard_nonfinite_steps_total``). A step called with a closure
    (``step(closure)``: Lightning, LBFGS) evaluates the closure first and decides on the gradients
    it produced; a skipped one returns the closure's result, the closure having run exactly once
    (``trainer_agent/measure/optim.py``).

    With a ``guard`` (``AgentConfig.skip_spikes``), the same device read gives the norm's value
    and the guard's verdict joins the flag (1: spike, 2: non-finite; the all-reduce takes the
    max): a spike is skipped exactly like a non-finite step, at the same step on every rank, with
    no further sync or collective.

    ``grad_norm`` is an attribute so that a test can inject a failing reader."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, world_size: int, group: Any,
                 grad_norm: Callable[[], torch.Tensor | None],
                 on_error: Callable[[str, BaseException], None],
                 guard: SpikeGuard | None = None, data_skip: Callable[[], bool] | None = None,
                 check_gradients: bool = True, on_data_skip: Callable[[], Any] | None = None) -> None:
        self.optimizer = optimizer
        self.world_size = world_size
        self.group = group
        self.grad_norm = grad_norm
        self.guard = guard
        self.data_skip = data_skip
        """True (on every rank alike) while the controller's data skip covers the step in progress."""
        self.check_gradients = check_gradients
        """False: only the data skip decides (no device read, no collective: the run did not ask for
        the non-finite or spike checks)."""
        self._on_data_skip = on_data_skip
        self._on_error = on_error
        self.skipped_by_reason = {reason: 0 for reason in (*SKIP_REASONS.values(), "data")}
        self._orig: tuple[Any, bool, Any] | None = None
        self._wrap()

    def _wrap(self) -> None:
        optimizer = self.optimizer
        had_own = "step" in vars(optimizer)
        inner = optimizer.step
        skip = self

        @wraps(getattr(inner, "__func__", inner))  # keeps an LR scheduler's '_wrapped_by_lr_sched' mark
        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            # With a closure, it runs first: the decision is on the gradients it produces.
            return optim.guarded_step(inner, args, kwargs, skip.skip_this_step)

        # A bound method, as LR schedulers expect (they wrap ``optimizer.step.__func__``).
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        self._orig = (optimizer, had_own, inner)

    def unwrap(self) -> None:
        if self._orig is None:
            return
        optimizer, had_own, inner = self._orig
        self._orig = None
        if had_own:
            optimizer.step = inner
        else:
            vars(optimizer).pop("step", None)

    @property
    def skipped(self) -> int:
        """Steps skipped, whatever the reason."""
        return sum(self.skipped_by_reason.values())

    def skip_this_step(self) -> bool:
        """True (on every rank) if any rank's gradients hold a NaN/Inf, or spike (with a guard), or
        the data skip covers the step."""
        if self._data_skip_covers():
            return True
        if not self.check_gradients:
            return False
        bad, value = self._local_vote()
        if self.world_size > 1:
            # Every rank reaches this all-reduce, whatever happened above on it.
            try:
                flag = torch.tensor([bad], dtype=torch.int64)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)  # gloo, CPU tensor
                bad = int(flag.item())
            except Exception as exc:  # noqa: BLE001 - fail open: take the step
                self._on_error("skip_nonfinite", exc)
                bad = 0
        if bad:
            self.skipped_by_reason[SKIP_REASONS[bad]] += 1
        if self.guard is not None:
            try:  # taken() may read the elements that train (a baseline starts): never into the step
                if bad:
                    self.guard.skipped()
                else:
                    self.guard.taken(value)
            except Exception as exc:  # noqa: BLE001 - the decision stands; the guard's window misses this step
                self._on_error("skip_nonfinite", exc)
        return bool(bad)

    def _data_skip_covers(self) -> bool:
        """The controller's data skip covers this step (the same answer on every rank: the agreed
        state); counted, and the guard and the user's data hook told."""
        try:
            data = self.data_skip is not None and self.data_skip()
        except Exception as exc:  # noqa: BLE001 - the agreed state is the same on every rank: cannot differ
            self._on_error("skip_data", exc)
            data = False
        if not data:
            return False
        self.skipped_by_reason["data"] += 1  # (the spike guard's window is left as it was)
        if self.guard is not None:
            self.guard.data_skipped()
        if self._on_data_skip is not None:
            try:
                self._on_data_skip()
            except Exception as exc:  # noqa: BLE001 - the user's data hook must not break the step
                self._on_error("skip_data", exc)
        return True

    def _local_vote(self) -> tuple[int, float]:
        """This rank's vote (0: take the step, 1: a spike, 2: non-finite) and its gradient norm."""
        bad, value = 0, math.nan
        try:
            norm = self.grad_norm()
            if norm is None:
                grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
                norm = stats.grads_norm(grads) if grads else None
            if norm is not None:
                value = float(norm)  # SYNC: one device read per optimizer step
                if not math.isfinite(value):
                    bad = 2
                elif self.guard is not None and self.guard.is_spike(value):
                    bad = 1
        except Exception as exc:  # noqa: BLE001 - fail open: this rank votes to take the step
            self._on_error("skip_nonfinite", exc)
        return bad, value

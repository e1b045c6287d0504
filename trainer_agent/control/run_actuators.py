"""The actuators of the commands that steer the run: pause, stop, checkpoint, the LR multiplier,
rollback, gradient accumulation, the diagnostic requests and the data skip (the registry and the
interface: ``trainer_agent/control/actuators.py``).

Sequence commands (checkpoint, rollback, memory trace, verify, verify_float32) act once per newer sequence number;
at start, a number some process of the run applied counts as served (one none applied:
``Sequenced``). Level commands (pause, lr_scale,
accumulation, data skip) hold the agreed value.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from trainguard.protocol.commands import LR_RULES
from trainer_agent.control.actuators import Actuator, ActuatorEnv, Sequenced, actuator, malformed, state_value

__all__ = ["Accumulation", "Checkpoint", "DataSkip", "LrScaleLevel", "MemoryTrace", "Pause", "Rollback", "Stop",
           "Verify", "VerifyFloat32", "batch_lr_factor"]

log = logging.getLogger("trainer_agent.control.plane")


def batch_lr_factor(steps: int, own: int, rule: str) -> float:
    """The LR multiplier for ``steps`` accumulation steps against the run's ``own``: the global
    batch changes by steps / own; ``linear`` scales the LR by that ratio, ``sqrt`` by its square
    root, ``none`` not at all."""
    ratio = steps / own
    return {"none": 1.0, "sqrt": math.sqrt(ratio), "linear": ratio}[rule]


@actuator("pause")
class Pause(Actuator):
    """Holds ``paused``; the control plane waits while it is set (``ControlPlane._pause``)."""

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.paused = False

    def apply(self, new: Any, old: Any, step: int) -> None:
        self.paused = new.paused

    def values(self) -> dict[str, float]:
        return {"trainguard_paused": 1.0 if self.paused else 0.0}


@actuator("checkpoint")
class Checkpoint(Sequenced):
    """``on_checkpoint(step)`` once per newer ``checkpoint_seq``, and once before a stop applied by
    this process (one call when both come in one state; a run stopped before this process started
    is not checkpointed: it has trained nothing). Phase 1: after the state's other changes. A
    checkpoint requested while the job was down is taken at the restarted job's first step
    (``Sequenced``)."""

    seq_field = "checkpoint_seq"
    phase = 1
    carried = True

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.stopped = False

    def start(self, initial: Any, before: Mapping[str, int] | None) -> None:
        super().start(initial, before)
        self.stopped = initial.stop

    def apply(self, new: Any, old: Any, step: int) -> None:
        stopping = new.stop and not self.stopped
        self.stopped = new.stop
        if new.checkpoint_seq > self.served or stopping:
            self.served, self.due = max(self.served, new.checkpoint_seq), 0
            self.act(new, step)

    def act(self, new: Any, step: int) -> None:
        if self.env.on_checkpoint is not None:
            try:
                self.env.on_checkpoint(step)
            except Exception as exc:  # noqa: BLE001 - the user's callback must not break agreement
                self.env.on_error("on_checkpoint", exc)

    def state_dict(self) -> dict[str, Any]:
        return {"checkpoint_seq": self.served}

    def load_state_dict(self, state: Mapping[str, Any], newer: bool) -> None:
        state_value(state, self.seq_field, int)  # required (every agent's checkpoint has one)
        self.persisted_served(state)


@actuator("stop")
class Stop(Actuator):
    """From the step a stop is applied at, ``stopped`` on every rank (it stays: the loop ends),
    with the exit status the controller asked for. Phase 1 (after the checkpoint it brings)."""

    phase = 1

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.stopped = False
        self.exit_code = 0

    def apply(self, new: Any, old: Any, step: int) -> None:
        if new.stop and not self.stopped:
            self.stopped, self.exit_code = True, new.stop_exit_code


@actuator("lr_scale")
class LrScaleLevel(Actuator):
    """The agreed LR multiplier (the optimizer's pre-hook multiplies each group's LR by it)."""

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.scale = 1.0

    def apply(self, new: Any, old: Any, step: int) -> None:
        self.scale = new.lr_scale

    def lr_factor(self) -> float:
        return self.scale

    def values(self) -> dict[str, float]:
        return {"trainguard_lr_scale": self.scale}

    def state_dict(self) -> dict[str, Any]:
        return {"lr_scale": self.scale}

    def load_state_dict(self, state: Mapping[str, Any], newer: bool) -> None:
        scale = state_value(state, "lr_scale", float, ok=lambda v: v > 0)
        if newer:
            self.scale = scale


@actuator("rollback")
class Rollback(Sequenced):
    """``on_rollback(rollback_step)`` once per newer ``rollback_seq``: the newest snapshot at or
    before that step is restored (``trainer_agent/control/snapshots.py``); ``restored`` is its step for
    the state just applied (None: no rollback in it, or no snapshot old enough)."""

    seq_field = "rollback_seq"

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.restored: int | None = None

    def apply(self, new: Any, old: Any, step: int) -> None:
        self.restored = None
        super().apply(new, old, step)

    def act(self, new: Any, step: int) -> None:
        target = new.rollback_step
        if self.env.on_rollback is None:
            log.error("trainguard: rollback to step %d asked at step %d, but this run keeps no "
                      "snapshots (AgentConfig.snapshot_every)", target, step)
            return
        try:
            self.restored = self.env.on_rollback(target)
        except Exception as exc:  # noqa: BLE001 - a failed restore must not break agreement
            self.env.on_error("rollback", exc)
            return
        if self.restored is None:
            log.error("trainguard: rollback asked at step %d, but no snapshot is as old as step %d", step, target)
        elif self.env.leader:
            log.warning("trainguard: rolled back at step %d to the snapshot of step %d", step, self.restored)

    def state_dict(self) -> dict[str, Any]:
        return {"rollback_seq": self.served}

    def load_state_dict(self, state: Mapping[str, Any], newer: bool) -> None:
        self.persisted_served(state)


@actuator("accumulation")
class Accumulation(Actuator):
    """Accumulation steps ``k`` (0: the run's own ``k0``) with the LR following by the rule
    (``batch_lr_factor``); a run that did not opt in (no ``k0``) keeps its own loop and LR."""

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.own = env.own_accumulation
        self.steps: int | None = self.own
        """Accumulation steps every rank uses now (None: the run did not opt in)."""
        self.desired: tuple[int, str] = (0, "none")
        self.factor = 1.0

    def apply(self, new: Any, old: Any, step: int) -> None:
        self._set(new.accumulation_steps, new.accumulation_lr_rule)

    def _set(self, steps: int, rule: str) -> None:
        self.desired = (steps, rule)
        if self.own is None:
            return
        self.steps = steps or self.own
        self.factor = batch_lr_factor(self.steps, self.own, rule) if steps else 1.0

    def lr_factor(self) -> float:
        return self.factor

    def values(self) -> dict[str, float]:
        return {"trainguard_accumulation_steps": float(self.steps)} if self.steps is not None else {}

    def state_dict(self) -> dict[str, Any]:
        return {"accumulation": list(self.desired)}

    def load_state_dict(self, state: Mapping[str, Any], newer: bool) -> None:
        accumulation = state.get("accumulation", (0, "none"))
        try:
            steps, rule = int(accumulation[0]), str(accumulation[1])
        except (TypeError, ValueError, IndexError, KeyError) as exc:
            raise malformed(f"accumulation {accumulation!r} ({exc})") from None
        if steps < 0 or rule not in LR_RULES:
            raise malformed(f"accumulation {accumulation!r}")
        if newer:
            self._set(steps, rule)


class _Diagnose(Sequenced):
    """``on_diagnose(command, step)`` once per newer request: the agent starts a memory trace or
    arms the next step's gradient recompute check (``trainer_agent/diagnostics/verify.py``); one
    requested while the job was down runs from the restarted job's first step."""

    carried = True

    def act(self, new: Any, step: int) -> None:
        if self.env.on_diagnose is None:
            return
        try:
            self.env.on_diagnose(self.command, step)
        except Exception as exc:  # noqa: BLE001 - never break the agreement
            self.env.on_error(f"diagnose_{self.command}", exc)


@actuator("memory_trace")
class MemoryTrace(_Diagnose):
    seq_field = "memory_trace_seq"


@actuator("verify")
class Verify(_Diagnose):
    seq_field = "verify_seq"


@actuator("verify_float32")
class VerifyFloat32(_Diagnose):
    seq_field = "verify_float32_seq"


@actuator("data_skip")
class DataSkip(Actuator):
    """Every rank skips the optimizer steps from ``data_skip_from`` up to ``data_skip_until`` (a
    data fault; read by the optimizer's step wrapper, ``NonfiniteSkip.data_skip``). A job that
    resumed from an earlier checkpoint trains on the steps before ``data_skip_from``; without one
    (0: a controller older than the field) every step up to ``data_skip_until`` is skipped."""

    def __init__(self, env: ActuatorEnv) -> None:
        super().__init__(env)
        self.first, self.until = 0, 0

    def apply(self, new: Any, old: Any, step: int) -> None:
        first, until = new.data_skip_from, new.data_skip_until
        if (first, until) != (self.first, self.until) and self.env.leader and until > step:
            log.warning("trainguard: skipping the optimizer steps %d-%d on every rank for their data (the LR is "
                        "untouched)", max(first, step + 1), until)
        self.first, self.until = first, until

    def covers(self, step: int) -> bool:
        """Whether the optimizer step of ``step`` is skipped for its data."""
        return self.until > 0 and self.first <= step <= self.until

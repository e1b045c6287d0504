"""Every command's actuator on one rank, built from the command registry, and what the control
plane (``trainer_agent/control/plane.py``) does with all of them at once: the optimizer's pre- and
post-hooks (the LR factors, then each actuator's own hook), applying a newer desired state, the
control metrics, and the actuators' part of a training checkpoint.

Actuators apply in phases, in the registry's order within one (``Actuator.phase``); one actuator
failing counts an agent error (``actuator_<command>``) and never keeps the others from acting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainguard.protocol.commands import REGISTRY
from trainguard.protocol.wire import DesiredState
from trainer_agent.control import optimizer_actuators, run_actuators  # noqa: F401 - both register their actuators on import
from trainer_agent.control.actuators import ACTUATORS, Actuator, ActuatorEnv, Sequenced, check_actuators
from trainer_agent.control.group_override import LrScale

__all__ = ["ActuatorSet"]

# Every command the agent acts on has exactly one actuator, and no actuator names an unknown command.
check_actuators()


class ActuatorSet:
    """The actuators of ``env`` (one per command the agent acts on), and the optimizer's LR
    override. ``on_error(kind, exc)`` is read at each call (a test may replace it)."""

    def __init__(self, env: ActuatorEnv, optimizer: torch.optim.Optimizer,
                 on_error: Callable[[], Callable[[str, BaseException], None]]) -> None:
        self.by_name: dict[str, Actuator] = {c.name: ACTUATORS[c.name](env) for c in REGISTRY if c.agent}
        """Each command's actuator, by name."""
        self.order = sorted(self.by_name.values(), key=lambda a: a.phase)  # stable: registry order in a phase
        self._pre = [a for a in self.order if type(a).before_step is not Actuator.before_step]
        self._post = [a for a in self.order if type(a).after_step is not Actuator.after_step]
        self._lr_factors = [a for a in self.order if type(a).lr_factor is not Actuator.lr_factor]
        self.pause = self._named("pause", run_actuators.Pause)
        self.stop = self._named("stop", run_actuators.Stop)
        self.accumulation = self._named("accumulation", run_actuators.Accumulation)
        self.data_skip = self._named("data_skip", run_actuators.DataSkip)
        self.lr_level = self._named("lr_scale", run_actuators.LrScaleLevel)
        self.rollback = self._named("rollback", run_actuators.Rollback)
        self.lr = LrScale(optimizer)
        self._on_error = on_error
        self._sequenced = [a for a in self.order if isinstance(a, Sequenced)]
        self.seq_fields = [a.seq_field for a in self._sequenced]
        """The sequence commands' fields, the same order on every rank."""

    def _named(self, name: str, kind: type) -> Any:
        act = self.by_name[name]
        assert isinstance(act, kind), (name, act)
        return act

    def _each(self, acts: list[Actuator], call: Callable[[Actuator], Any]) -> None:
        for act in acts:
            try:
                call(act)
            except Exception as exc:  # noqa: BLE001 - one actuator failing must not keep the others
                self._on_error()(f"actuator_{act.command}", exc)

    def before_optimizer_step(self) -> None:
        """Each group's LR becomes scheduler LR x the actuators' LR factors (lr_scale x the
        accumulation rule's) for this step, then the actuators' own pre-hooks."""
        factor = 1.0
        for act in self._lr_factors:
            factor *= act.lr_factor()
        self.lr.before_step(factor)
        self._each(self._pre, lambda act: act.before_step())

    def after_optimizer_step(self) -> None:
        """The scheduler's LR objects and the groups' own values restored, then the post-hooks."""
        self.lr.after_step()
        self._each(self._post, lambda act: act.after_step())

    def apply(self, state: DesiredState, old: DesiredState, step: int) -> None:
        """Each actuator acts on a newer ``state`` (replacing ``old``) at ``step``."""
        self._each(self.order, lambda act: act.apply(state, old, step))

    def start(self, agreed: DesiredState, before: Mapping[str, int] | None) -> None:
        """The state agreed at start, and the sequence numbers the run's processes last applied
        (None: not known; every request counts as served): see ``Sequenced``."""
        for act in self.order:
            act.start(agreed, before)

    def judge(self, requested: Mapping[str, int], before: Mapping[str, int] | None) -> None:
        """After a start without a registration, the sequence numbers the late registration found
        (``requested``, by field) judged as at start against ``before``: see ``Sequenced``."""
        for act in self._sequenced:
            act.judge(requested[act.seq_field], before)

    def serve_due(self, applied: DesiredState, step: int) -> None:
        """At the first step every rank agreed at after start: the requests made while the job was
        down that no process applied and the run's checkpoint did not serve (a checkpoint, a
        diagnostic), with the state applied now."""
        self._each([act for act in self._sequenced if act.due], lambda act: act.serve_due(applied, step))

    def values(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for act in self.order:
            out.update(act.values())
        return out

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for act in self.order:
            out.update(act.state_dict())
        return out

    def load_state_dict(self, state: Mapping[str, Any], newer: bool) -> dict[str, Any]:
        """Restore every actuator's part of ``state``, all or nothing (each part is read by a fresh
        actuator first: ``ValueError`` before anything changes); the desired-state fields they
        keep afterwards."""
        for act in self.order:
            type(act)(act.env).load_state_dict(state, newer)
        for act in self.order:
            act.load_state_dict(state, newer)
        kept = {k: v for k, v in self.state_dict().items() if k in DesiredState.model_fields}
        steps, rule = self.accumulation.desired
        kept.update(accumulation_steps=steps, accumulation_lr_rule=rule)
        return kept

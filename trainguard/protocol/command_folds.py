"""How each command folds into the desired state (:data:`Fold`: the desired state, an operator's
body or a rule's action, and the run's :class:`CommandContext` -> a :class:`Change`). Named in
:data:`trainguard.protocol.commands.REGISTRY`; the types are imported from
``trainguard.protocol.commands``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.protocol.command_models import (
    LR_SCALE_MAX,
    LR_SCALE_MIN,
    MAX_GRAD_CLIP,
    AccumulationRequest,
    GradClipRequest,
    RollbackAction,
    _ScaleAction,
)

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
        """Steps not taken since the previous report: skipped by the agent (non-finite or
        spiking) or by the mixed-precision loss scaler (non-finite scaled gradients)."""

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
        return Change(note=f"no rollback: {skipped} step(s) not taken (skipped by the agent or by the "
                                f"mixed-precision loss scaler), the weights as they were")
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

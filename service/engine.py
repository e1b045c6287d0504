"""From findings to alerts and desired state: the pure decision step of the controller.

:class:`AlertBook` holds, per run and rule, whether an alert is firing, when the rule last fired
(cooldown) and how often it fired recently (cap). :func:`decide` turns a list of findings into
alerts fired and resolved and the desired states their actions lead to. :func:`simulate` replays
reports through the whole pipeline without any I/O (``POST /v1/rules/test`` and the rule tests).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from trainguard.service.evaluate import Finding, evaluate
from trainguard.service.rules import (
    ADAPTIVE_FALLBACK_FACTOR, AbsenceRule, AdaptiveLrAction, CheckpointAction, LrScaleAction, MemoryTraceAction, NotifyAction,
    PauseAction, RollbackAction, StopAction, VerifyAction,
)
from trainguard.service.window import RunWindow
from trainguard.protocol.wire import COMMANDS, DIAGNOSTIC_COMMANDS, LR_SCALE_MAX, LR_SCALE_MIN, DesiredState, Report

__all__ = ["ActionContext", "RollbackRefused", "AlertBook", "Transition", "FiredAlert", "Outcome", "apply_actions", "command_state", "decide", "simulate", "SimStep"]

_REASON_MAX = 2000
#: The commands that are also rule actions (``lr_scale`` is built from its scale or factor).
_COMMAND_ACTIONS = {"pause": PauseAction(), "stop": StopAction(), "checkpoint": CheckpointAction(),
                    "memory_trace": MemoryTraceAction(), "verify": VerifyAction()}


@dataclass(slots=True)
class _Track:
    firing: bool = False
    last_fired: float = -math.inf
    fired: deque[float] = field(default_factory=deque)


@dataclass(slots=True)
class Transition:
    fire: list[Finding] = field(default_factory=list)
    resolve: list[str] = field(default_factory=list)
    suppressed: list[tuple[Finding, str]] = field(default_factory=list)
    prior: list[tuple[str, bool, float]] = field(default_factory=list)
    """(rule, firing, last_fired) before each change this transition made: :meth:`AlertBook.undo`."""


class AlertBook:
    """Firing state, cooldown and cap bookkeeping of one run's rules."""

    __slots__ = ("_tracks",)

    def __init__(self) -> None:
        self._tracks: dict[str, _Track] = {}

    def firing(self) -> list[str]:
        return [name for name, t in self._tracks.items() if t.firing]

    def restore(self, rule: str, *, firing: bool, fired_at: list[float]) -> None:
        """Rebuild a rule's state from the alerts table (after a restart)."""
        t = self._tracks.setdefault(rule, _Track())
        t.firing = t.firing or firing
        for at in sorted(fired_at):
            t.fired.append(at)
            t.last_fired = max(t.last_fired, at)

    def transition(self, findings: list[Finding], now: float, *, complete: bool) -> Transition:
        """Apply ``findings`` at ``now``. With ``complete`` (every current rule was evaluated), a
        firing rule that is no longer among them (removed or disabled) resolves too."""
        out = Transition()
        for f in findings:
            if f.active is None:
                continue
            name = f.rule.name
            t = self._tracks.get(name)
            if not f.active:
                if t is not None and t.firing:
                    out.prior.append((name, True, t.last_fired))
                    t.firing = False
                    out.resolve.append(name)
                continue
            if t is None:
                t = self._tracks[name] = _Track()
            if t.firing:
                continue
            while t.fired and t.fired[0] <= now - f.rule.cap_window_s:
                t.fired.popleft()
            if now - t.last_fired < f.rule.cooldown_s:
                out.suppressed.append((f, "cooldown"))
            elif f.rule.cap and len(t.fired) >= f.rule.cap:
                out.suppressed.append((f, "cap"))
            else:
                out.prior.append((name, False, t.last_fired))
                t.firing = True
                t.last_fired = now
                t.fired.append(now)
                out.fire.append(f)
        if complete and any(t.firing for t in self._tracks.values()):
            seen = {f.rule.name for f in findings}
            for name, t in self._tracks.items():
                if t.firing and name not in seen:
                    out.prior.append((name, True, t.last_fired))
                    t.firing = False
                    out.resolve.append(name)
        return out

    def undo(self, prior: list[tuple[str, bool, float]]) -> None:
        """Take back a transition whose alerts could not be recorded (the commit failed): the
        rules' firing state, last fire time and cap count become what they were before it."""
        for name, firing, last_fired in reversed(prior):
            t = self._tracks[name]
            if t.last_fired != last_fired and t.fired and t.fired[-1] == t.last_fired:
                t.fired.pop()  # the fire this transition counted
            t.firing, t.last_fired = firing, last_fired

    def resolve(self, name: str) -> bool:
        """Resolve ``name`` from outside the rules (e.g. the run was stopped); True if it fired."""
        t = self._tracks.get(name)
        if t is None or not t.firing:
            return False
        t.firing = False
        return True


def _reason(text: str) -> str:
    return text if len(text) <= _REASON_MAX else text[: _REASON_MAX - 1] + "…"


class ActionContext(Protocol):
    """What the measured actions need from the run (``service/incidents.py``'s ``RunRecovery``)."""

    def adaptive_scale(self, action: AdaptiveLrAction, current: float) -> tuple[float | None, str]:
        """The scale that brings the action's metric back to its baseline (None: no baseline or
        measurement), and a note saying how it was computed."""

    def rollback_target(self) -> tuple[int | None, str]:
        """The step of the newest good snapshot, or None and why there is none."""

    def skipped_now(self) -> int:
        """Steps the agent skipped since the previous report (non-finite or spiking)."""


def apply_actions(desired: DesiredState, actions: tuple[Any, ...], reason: str,
                  ctx: ActionContext | None = None) -> DesiredState | None:
    """The desired state after ``actions``, with the generation bumped; ``None`` when nothing
    changes (notify only, or already paused/stopped). ``adaptive_lr`` and ``rollback`` read the
    run's measurements and snapshots from ``ctx``: without it (or a baseline) ``adaptive_lr``
    halves the scale, and ``rollback`` is refused and pauses the run."""
    paused, stop, seq, scale = desired.paused, desired.stop, desired.checkpoint_seq, desired.lr_scale
    rb_seq, rb_step = desired.rollback_seq, desired.rollback_step
    notes: list[str] = []
    diagnose = {"memory_trace_seq": desired.memory_trace_seq, "verify_seq": desired.verify_seq}
    for a in actions:
        if isinstance(a, PauseAction):
            paused = True
        elif isinstance(a, StopAction):
            stop = True
        elif isinstance(a, CheckpointAction):
            seq += 1
        elif isinstance(a, LrScaleAction):
            scale = a.apply(scale)
        elif isinstance(a, AdaptiveLrAction):
            new, note = ctx.adaptive_scale(a, scale) if ctx is not None else (None, "no measurement")
            if new is None:
                new, note = min(max(scale * ADAPTIVE_FALLBACK_FACTOR, a.min), a.max), f"{note}: halved"
            scale = new
            notes.append(f"adaptive lr_scale {scale:.4g} ({note})")
        elif isinstance(a, RollbackAction):
            skipped = ctx.skipped_now() if ctx is not None and a.unless_skipped else 0
            target, why = ctx.rollback_target() if ctx is not None else (None, "no snapshot is known")
            if skipped:
                notes.append(f"no rollback: the agent skipped {skipped} step(s) and left the weights as they were")
            elif target is None:
                paused = True
                notes.append(f"rollback refused: {why}; paused for a human")
            else:
                rb_seq, rb_step = rb_seq + 1, target
                scale = min(max(scale * a.lr_factor, LR_SCALE_MIN), LR_SCALE_MAX)
                notes.append(f"rollback to the snapshot of step {target}" +
                             (f", lr_scale {scale:.4g}" if a.lr_factor != 1.0 else ""))
        elif isinstance(a, (MemoryTraceAction, VerifyAction)):
            diagnose[f"{a.type}_seq"] += 1
        else:
            assert isinstance(a, NotifyAction)
    if (paused, stop, seq, scale, rb_seq) == (desired.paused, desired.stop, desired.checkpoint_seq, desired.lr_scale,
                                              desired.rollback_seq) \
            and diagnose == {"memory_trace_seq": desired.memory_trace_seq, "verify_seq": desired.verify_seq}:
        return None
    if notes:
        reason = f"{reason} — {'; '.join(notes)}"
    return desired.model_copy(update=dict(  # other fields (accumulation) carry over
        generation=desired.generation + 1, paused=paused, lr_scale=scale, checkpoint_seq=seq, stop=stop,
        rollback_seq=rb_seq, rollback_step=rb_step, reason=_reason(reason), **diagnose,
    ))


def command_state(
    desired: DesiredState, command: str, reason: str, *, scale: float | None = None, factor: float | None = None,
    ctx: ActionContext | None = None, accumulation: tuple[int, str] | None = None,
) -> DesiredState | None:
    """The desired state after a command from an operator or Alertmanager; ``None`` when it
    changes nothing. Every command except ``resume`` is carried out by the rules' own actions
    (:func:`apply_actions`), so an LR factor is clamped exactly as a rule's is.

    ``lr_scale`` takes either an absolute ``scale`` or a ``factor`` of the current one;
    ``resume`` clears both ``paused`` and ``stop``; ``checkpoint`` always bumps ``checkpoint_seq``.
    ``accumulation`` (operators only) sets ``accumulation`` = (steps, LR rule).
    Raises ``ValueError`` for an unknown command or a bad scale.
    """
    if command == "accumulation":
        if accumulation is None:
            raise ValueError("accumulation needs the number of steps and an LR rule")
        steps, rule = accumulation
        if (steps, rule) == (desired.accumulation_steps, desired.accumulation_lr_rule):
            return None
        return desired.model_copy(update={"generation": desired.generation + 1, "accumulation_steps": steps,
                                          "accumulation_lr_rule": rule, "reason": _reason(reason)})
    if command == "resume":
        if not (desired.paused or desired.stop):
            return None
        return desired.model_copy(update={"generation": desired.generation + 1, "paused": False, "stop": False,
                                          "stop_exit_code": 0, "reason": _reason(reason)})
    if command == "lr_scale":
        if (scale is None) == (factor is None):
            raise ValueError("lr_scale needs exactly one of a scale or a factor")
        try:
            action: Any = LrScaleAction(value=scale, factor=factor)
        except ValidationError:
            raise ValueError(f"lr_scale needs a finite scale in [{LR_SCALE_MIN:g}, {LR_SCALE_MAX:g}] "
                             f"or a finite factor in (0, {LR_SCALE_MAX:g}]") from None
    elif command == "rollback":
        target, why = ctx.rollback_target() if ctx is not None else (None, "no snapshot is known")
        if target is None:
            raise RollbackRefused(f"rollback refused: {why}")
        action = RollbackAction()
    elif command in _COMMAND_ACTIONS:
        action = _COMMAND_ACTIONS[command]
    else:
        raise ValueError(f"unknown command {command!r}; commands are {', '.join(COMMANDS + DIAGNOSTIC_COMMANDS)}")
    return apply_actions(desired, (action,), reason, ctx)


class RollbackRefused(ValueError):
    """An operator's rollback with no good snapshot to go back to (409 with the reason)."""


@dataclass(slots=True)
class FiredAlert:
    """An alert to record, and the desired state its actions lead to (``None``: unchanged)."""

    finding: Finding
    desired: DesiredState | None

    @property
    def notify(self) -> bool:
        return any(isinstance(a, NotifyAction) for a in self.finding.rule.actions)


@dataclass(slots=True)
class Outcome:
    fired: list[FiredAlert]
    resolved: list[str]
    suppressed: list[tuple[Finding, str]]
    desired: DesiredState
    book_prior: list[tuple[str, bool, float]] = field(default_factory=list)
    """What :meth:`AlertBook.undo` needs to take this outcome back."""


def decide(findings: list[Finding], book: AlertBook, desired: DesiredState, now: float, *, complete: bool,
           ctx: ActionContext | None = None) -> Outcome:
    """Alerts fired/resolved by ``findings`` and the resulting desired state (one new generation
    per alert that changes it). Mutates only ``book``."""
    tr = book.transition(findings, now, complete=complete)
    fired = []
    refuse = getattr(ctx, "refusal", None)  # the incident's cause refuses actions that do not fit it
    for f in tr.fire:
        actions, refused = f.rule.actions, []
        if refuse is not None:
            refused = [why for a in actions if (why := refuse(a)) is not None]
            actions = tuple(a for a in actions if refuse(a) is None)
        reason = f"{f.rule.name}: {f.summary}" + (f" ({'; '.join(refused)})" if refused else "")
        new = apply_actions(desired, actions, reason, ctx)
        fired.append(FiredAlert(f, new))
        desired = new or desired
    return Outcome(fired, tr.resolve, tr.suppressed, desired, tr.prior)


@dataclass(slots=True)
class SimStep:
    """What one replayed report (and the silence before it) caused."""

    index: int
    step_last: int
    fired: list[FiredAlert]
    resolved: list[str]
    suppressed: list[tuple[Finding, str]]
    desired: DesiredState
    recovery: list[DesiredState] = field(default_factory=list)
    """Changes the recovery state made after the rules (escalation rungs, ramp steps)."""


def simulate(
    rules: tuple[Any, ...], reports: list[Report], *, world_size: int, desired: DesiredState | None = None,
    capacity: int = 128, rank_capacity: int = 8, policy: Any = None, snapshot_every: int | None = None,
    snapshot_keep: int = 3, skips_nonfinite: bool = False,
) -> list[SimStep]:
    """Replay ``reports`` (in order, ``report.time`` as the clock) through ``rules``.

    Before each report, absence rules are evaluated at that report's time, as the controller's
    ticker would have done during the silence; then the report is appended and every rule is
    evaluated, and the run's recovery state (``service/incidents.py``, with ``policy``: the rules
    file's ``recovery`` section) sees it: adaptive LR and rollback actions, escalation and the
    LR ramp act as in the controller. No I/O.
    """
    from trainguard.service.incidents import RunRecovery  # it builds on this module

    desired = desired or DesiredState()
    if not reports:
        return []
    window = RunWindow(capacity=capacity, rank_capacity=rank_capacity, world_size=world_size, created=reports[0].time)
    book = AlertBook()
    # The scale in force at the start is the operator's (the ramp climbs back to it, never above).
    recovery = RunRecovery(policy, snapshot_every=snapshot_every, snapshot_keep=snapshot_keep, ceiling=desired.lr_scale,
                           skips_nonfinite=skips_nonfinite)
    absence = tuple(r for r in rules if isinstance(r, AbsenceRule))
    steps = []
    for i, report in enumerate(reports):
        gap = decide(evaluate(absence, window, report.time), book, desired, report.time, complete=False, ctx=recovery)
        window.append(report, report.time)
        recovery.before_decide(report.values)
        findings = evaluate(rules, window, report.time)
        recovery.consider(findings, window)
        out = decide(findings, book, gap.desired, report.time, complete=True, ctx=recovery)
        fired = [(fa.finding.rule.name, fa.desired) for fa in gap.fired + out.fired if fa.desired is not None]
        changes = recovery.after_report(step=report.step_last, values=report.values, findings=findings, before=desired,
                                        desired=out.desired, fired=fired, now=report.time)
        final = changes[-1].desired if changes else out.desired
        steps.append(SimStep(i, report.step_last, gap.fired + out.fired, gap.resolved + out.resolved,
                             gap.suppressed + out.suppressed, final, [c.desired for c in changes]))
        desired = final
    return steps

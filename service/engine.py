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
from trainguard.service.rules import ADAPTIVE_FALLBACK_FACTOR, AbsenceRule, AdaptiveLrAction, NotifyAction
from trainguard.service.window import RunWindow
from trainguard.protocol.commands import BY_NAME, RULE_ACTIONS, STATE_FIELDS, CommandSpec, apply_command
from trainguard.protocol.wire import DesiredState, Report

__all__ = ["ActionContext", "AlertBook", "Transition", "FiredAlert", "Outcome", "apply_actions", "command_params",
           "command_state", "decide", "simulate", "SimStep"]

_REASON_MAX = 2000


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
    """What the measured actions need from the run (``service/incidents.py``'s ``RunRecovery``):
    the registry's :class:`~trainguard.protocol.commands.CommandContext` and the adaptive LR."""

    def adaptive_scale(self, action: AdaptiveLrAction, current: float) -> tuple[float | None, str]:
        """The scale that brings the action's metric back to its baseline (None: no baseline or
        measurement), and a note saying how it was computed."""

    def rollback_target(self) -> tuple[int | None, str]:
        """The step of the newest good snapshot, or None and why there is none."""

    def skipped_now(self) -> int:
        """Steps not taken since the previous report: skipped by the agent (non-finite or
        spiking) or by the mixed-precision loss scaler (non-finite scaled gradients)."""

    def healthy_median(self, metric: str) -> float | None:
        """The median of ``metric`` over the run's healthy reports before the incident (None: none)."""

    def own_accumulation(self) -> int | None:
        """The run's own accumulation steps (None: the run did not opt in)."""


def _adaptive(d: DesiredState, a: AdaptiveLrAction, ctx: ActionContext | None) -> tuple[dict[str, Any], str]:
    """The ``lr_scale`` the service-only ``adaptive_lr`` action sets (measured, or halved)."""
    new, note = ctx.adaptive_scale(a, d.lr_scale) if ctx is not None else (None, "no measurement")
    if new is None:
        new, note = min(max(d.lr_scale * ADAPTIVE_FALLBACK_FACTOR, a.min), a.max), f"{note}: halved"
    return ({"lr_scale": new} if new != d.lr_scale else {}), f"adaptive lr_scale {new:.4g} ({note})"


def _bumped(desired: DesiredState, current: DesiredState, reason: str, notes: list[str]) -> DesiredState | None:
    """``current`` as the next generation after ``desired`` with ``reason`` (and the folds'
    ``notes``); None when no field of the desired state changed."""
    if all(getattr(current, f.name) == getattr(desired, f.name) for f in STATE_FIELDS):
        return None
    if notes:
        reason = f"{reason} — {'; '.join(notes)}"
    return current.model_copy(update={"generation": desired.generation + 1, "reason": _reason(reason)})


def apply_actions(desired: DesiredState, actions: tuple[Any, ...], reason: str,
                  ctx: ActionContext | None = None, *, notes: list[str] | None = None) -> DesiredState | None:
    """The desired state after a rule's ``actions`` (in order), with the generation bumped once;
    ``None`` when nothing changes (notify only, or already paused/stopped). Each command's action
    folds as the registry says (``trainguard.protocol.commands``); ``adaptive_lr`` and ``notify``
    are the service's own. The measuring folds read the run from ``ctx``: without it (or a
    baseline) ``adaptive_lr`` halves the scale, ``rollback`` is refused and pauses the run, and
    ``grad_clip`` without ``max_norm`` clips nothing. ``notes``: a list the folds' notes are
    appended to (what was measured or refused, also when nothing changes)."""
    current = desired
    notes = [] if notes is None else notes
    for a in actions:
        if isinstance(a, NotifyAction):
            continue
        if isinstance(a, AdaptiveLrAction):
            updates, note = _adaptive(current, a, ctx)
        else:
            updates, note = apply_command(current, RULE_ACTIONS[type(a)], a, ctx)
        if updates:
            current = current.model_copy(update=updates)
        if note:
            notes.append(note)
    return _bumped(desired, current, reason, notes)


def command_params(spec: CommandSpec, params: Any = None) -> Any:
    """``params`` as the command's body (``spec.request``): None is the body's defaults, a dict is
    validated; ``ValueError`` (with every problem named) for one that does not validate."""
    if isinstance(params, spec.request):
        return params
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"{spec.name} takes a {spec.request.__name__}, got {type(params).__name__}")
    try:
        return spec.request.model_validate(params or {})
    except ValidationError as e:
        problems = "; ".join((".".join(map(str, err["loc"])) + ": " if err["loc"] else "") + err["msg"]
                             for err in e.errors(include_url=False))
        raise ValueError(f"{spec.name}: {problems}") from None


def command_state(desired: DesiredState, command: str, reason: str, *, params: Any = None,
                  ctx: ActionContext | None = None) -> DesiredState | None:
    """The desired state after a command from an operator or Alertmanager (``params``: its body,
    see :func:`command_params`); ``None`` when it changes nothing. The command folds as the
    registry says, so an LR factor is clamped exactly as a rule's is. ``ValueError`` for an
    unknown command or a body that does not validate; ``CommandRefused`` (a ``ValueError``) for
    one that cannot be carried out now (a rollback without a good snapshot)."""
    spec = BY_NAME.get(command)
    if spec is None or not spec.operator:
        known = ", ".join(c.name for c in BY_NAME.values() if c.operator)
        raise ValueError(f"unknown command {command!r}; commands are {known}")
    updates, note = apply_command(desired, spec, command_params(spec, params), ctx)
    return _bumped(desired, desired.model_copy(update=updates), reason, [note] if note else [])


@dataclass(slots=True)
class FiredAlert:
    """An alert to record, and the desired state its actions lead to (``None``: unchanged)."""

    finding: Finding
    desired: DesiredState | None
    note: str = ""
    """With no change (``desired`` None): why its actions changed nothing (refused, or a fold's note)."""

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
        notes: list[str] = []
        new = apply_actions(desired, actions, reason, ctx, notes=notes)
        fired.append(FiredAlert(f, new, "" if new is not None else "; ".join(refused + notes)))
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
    incidents: list[dict[str, Any]] = field(default_factory=list)
    """The incidents the report opened or changed, as they are after it (``Incident.as_dict``)."""


def simulate(
    rules: tuple[Any, ...], reports: list[Report], *, world_size: int, desired: DesiredState | None = None,
    capacity: int = 128, rank_capacity: int = 12, policy: Any = None, snapshot_every: int | None = None,
    snapshot_keep: int = 3, skips_nonfinite: bool = False,
) -> list[SimStep]:
    """Replay ``reports`` (in order, ``report.time`` as the clock) through ``rules``.

    Before each report, absence rules are evaluated at that report's time, as the controller's
    ticker would have done during the silence; then the report is appended and every rule is
    evaluated, and the run's recovery state (``service/incidents.py``, with ``policy``: the rules
    file's ``recovery`` section) sees it: adaptive LR and rollback actions, escalation and the
    LR ramp act as in the controller: each report goes through
    :func:`service.evaluation_step.evaluate_report`, the controller's own step. No I/O.
    """
    from trainguard.service.evaluation_step import evaluate_report  # they build on this module
    from trainguard.service.incidents import RunRecovery
    from trainguard.service.window import rank_vectors

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
        step = evaluate_report(report, rank_vectors(report.ranks), report.time, rules=rules, window=window, book=book,
                               recovery=recovery, desired=desired, gap=gap)
        out = step.outcome
        steps.append(SimStep(i, report.step_last, gap.fired + out.fired, gap.resolved + out.resolved,
                             gap.suppressed + out.suppressed, step.desired, [c.desired for c in step.changes],
                             [now for _, now in step.incidents]))
        desired = step.desired
    return steps

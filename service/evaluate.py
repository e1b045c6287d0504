"""Rule evaluation: each rule kind as a pure function of a :class:`~service.window.RuleWindow`
(and, for absence rules, the time) giving a verdict, which :func:`evaluate` turns into a
:class:`Finding` per rule. No I/O. The kinds over one metric are :mod:`service.evaluate_metrics`,
those across ranks :mod:`service.evaluate_ranks`, rate and oscillation
:mod:`service.rate_and_oscillation`; absence and the evaluation plan are here."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from trainguard.service import rate_and_oscillation
from trainguard.service.evaluate_metrics import nonfinite, spike, threshold, trend
from trainguard.service.evaluate_ranks import cross_rank, desync
from trainguard.service.finding import Finding, Verdict
from trainguard.service.rule_kinds import (
    AbsenceRule, CrossRankRule, DesyncRule, NonFiniteRule, OscillationRule, RateRule, SpikeRule, ThresholdRule,
    TrendRule,
)
from trainguard.service.window import RuleWindow

__all__ = ["Finding", "evaluate"]


def _finding(rule: Any, active: bool | None, summary: str = "", values: dict[str, Any] | None = None) -> Verdict:
    """A verdict as the rate and oscillation rule kinds build it: a Finding only when it fires."""
    if active is not True:
        return active
    return Finding(rule, True, summary, values if values is not None else {})


def _absence(rule: AbsenceRule, w: RuleWindow, now: float, live_since: float = -math.inf) -> Verdict:
    since = max(w.last_received, live_since)
    silent = now - since
    if not silent >= rule.seconds:
        return False
    return Finding(
        rule, True, f"no report for {silent:.0f} s (limit {rule.seconds:g} s)",
        {"silent_s": silent, "limit_s": rule.seconds, "last_report_at": w.last_received, "silent_since": since},
    )


_EVAL: dict[type, Callable[[Any, RuleWindow, float], Verdict]] = {
    ThresholdRule: threshold, SpikeRule: spike, NonFiniteRule: nonfinite,
    TrendRule: trend, CrossRankRule: cross_rank, DesyncRule: desync, AbsenceRule: _absence,
    RateRule: lambda r, w, now: rate_and_oscillation.rate(r, w, now, _finding),
    OscillationRule: lambda r, w, now: rate_and_oscillation.oscillation(r, w, now, _finding),
}


@dataclass(frozen=True, slots=True)
class _Plan:
    """A rule set made ready to evaluate: per rule, its function, its "no" and "no data" findings
    (built once and shared: a report's evaluation gives mostly these, and a frozen dataclass
    costs ~1 us to build; their empty values are never read, only a fired finding's are
    recorded) and, for a rule that reads only one per-rank vector, that vector (no data while
    the run has never sent it, without a call)."""

    rules: tuple[Any, ...]  # (held: the plans are keyed by the identity of this tuple)
    steps: tuple[tuple[Callable[[Any, RuleWindow, float], Verdict], Any, Finding, Finding, str | None], ...]

    @classmethod
    def of(cls, rules: tuple[Any, ...]) -> "_Plan":
        return cls(rules, tuple(
            (_EVAL[type(r)], r, Finding(r, False), Finding(r, None), getattr(r, "vector", None)) for r in rules
        ))


#: Plans by the identity of their rules tuple (a rules reload makes a new tuple; the controller
#: keeps one per job). Emptied when full.
_PLANS: dict[int, _Plan] = {}
_PLANS_MAX = 256


def _plan(rules: tuple[Any, ...]) -> _Plan:
    plan = _PLANS.get(id(rules))  # (a plan holds its tuple alive: no other object can have that id meanwhile)
    if plan is None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[id(rules)] = _Plan.of(rules)
    return plan


def evaluate(rules: tuple[Any, ...], window: RuleWindow, now: float, *, live_since: float | None = None) -> list[Finding]:
    """Every rule's finding on ``window`` at time ``now``, in the order of ``rules``. Pure: no I/O,
    no mutation.

    ``live_since``: when the run last became live (registered, re-registered, unpaused); absence
    rules count silence from the later of it and the last report. The controller's ticker passes
    it; a report's own evaluation need not (its arrival is the newest sign of life)."""
    seen = window.vectors_seen
    out: list[Finding] = []
    append = out.append
    for fn, rule, no, unknown, vector in _plan(rules).steps:
        if vector is not None and vector not in seen:
            append(unknown)
            continue
        v = fn(rule, window, now) if live_since is None or fn is not _absence else _absence(rule, window, now, live_since)
        append(no if v is False else unknown if v is None else v)
    return out

"""The agent's per-step reports of a real training run replayed through the built-in rules with the
controller's recovery logic (``engine.simulate``), for the tests of healthy runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainguard.protocol.wire import Report
from trainguard.service.engine import simulate
from trainguard.service.rules import default_rules_text, load_rules

RULES = load_rules(default_rules_text())


def replay(rows: list[dict[str, float]], job: str) -> list[Any]:
    """``rows``: ``Agent.latest()`` after every step (``report_every=1``); one simulated step each."""
    reports = [Report(job=job, step_first=int(v["trainguard_step"]), step_last=int(v["trainguard_step"]),
                      time=float(i), values={k: x for k, x in v.items() if "{" not in k})
               for i, v in enumerate(rows)]
    return simulate(RULES.base, reports, world_size=1, policy=RULES.file.recovery, snapshot_keep=4)


def acting(steps: list[Any]) -> list[str]:
    """Findings of rules that act or that make a report unhealthy, as ``step rule: summary``."""
    health = set(RULES.file.recovery.health_rules)
    return [f"{s.step_last} {f.finding.rule.name}: {f.finding.summary}" for s in steps for f in s.fired
            if f.finding.rule.name in health or any(a.type != "notify" for a in f.finding.rule.actions)]


def train(agent: Any, opt: Any, loss_of: Callable[[int], Any], steps: int, sched: Any = None) -> list[dict[str, float]]:
    """``steps`` optimizer steps on ``loss_of(k)`` with ``agent`` attached (``report_every`` 1),
    ``sched`` stepped after each; the agent's report after every step. Closes the agent."""
    rows = []
    for k in range(steps):
        loss = loss_of(k)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
        rows.append(agent.latest())
    agent.close(1.0)
    return rows

"""Whether a run's newest report is healthy, and whether it is alarming (``service/incidents.py``'s
module docstring): what taints a snapshot, ends an incident's window, or opens an incident."""

from __future__ import annotations

import math
from typing import Any

from trainguard.service.cause import HARDWARE_DIAGNOSES
from trainguard.service.rules import RecoveryPolicy

#: Rule actions that are not a response to trouble: ``notify``, and ``accumulation`` (the adaptive
#: batch size follows the gradient variance of a healthy run). A rule that takes only these does not
#: make a report unhealthy (no snapshot is tainted, no incident opens on it).
NOT_TROUBLE = frozenset({"notify", "accumulation"})


def acts_on_trouble(rule: Any) -> bool:
    """Whether ``rule`` takes an action that responds to trouble."""
    return any(a.type not in NOT_TROUBLE for a in rule.actions)


def report_healthy(values: dict[str, float], findings: list[Any], policy: RecoveryPolicy, *, data_incident: bool) -> bool:
    """Whether a report is healthy (``RunRecovery.healthy``). ``data_incident``: a data incident is
    open and a data-quality rule still fires."""
    signals = policy.health_rules
    for f in findings:  # the rules that act, and the health rules: a notify-only rule (e.g. data quality) informs
        if f.active and f.rule.kind != "absence" and (
                f.rule.name in signals or acts_on_trouble(f.rule)):
            return False
    loss = values.get("trainguard_loss")
    if loss is not None and not math.isfinite(loss):
        return False
    if values.get("trainguard_consecutive_skipped_steps", 0.0) >= policy.skip_limit:
        return False
    if data_incident:
        return False  # a data incident is over when its data is back in bounds
    return True


def alarming(findings: list[Any], policy: RecoveryPolicy, *, skipped: int) -> bool:
    """Whether the newest report would open an incident (or shows a hardware fault). ``skipped``:
    the steps the agent skipped since the last report."""
    if skipped:
        return True
    signals = policy.health_rules
    for f in findings:
        if f.active and f.rule.kind != "absence" and (
                f.rule.name in signals or acts_on_trouble(f.rule)
                or f.rule.diagnosis in HARDWARE_DIAGNOSES):
            return True
    return False

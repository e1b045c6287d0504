"""The default rule on exposed gradient communication (default_rules.yaml ``comm_exposed``): ranks
whose step is over 20% waiting for the all-reduce after backward, five reports in a row; it only
notifies, and NaN (not measured) is never judged."""

from __future__ import annotations

import math

from tests.service.conftest import make_report
from trainguard.service.engine import simulate
from trainguard.service.rules import NotifyAction, default_rules_text, load_rules

DEFAULTS = load_rules(default_rules_text())
RULE = "comm_exposed"


def _found(rows: list[list[float]]) -> list[list]:  # type: ignore[type-arg]
    reports = [make_report(i, float(i), {}, comm_exposed_ratio=row) for i, row in enumerate(rows)]
    steps = simulate(DEFAULTS.for_job("job-a"), reports, world_size=len(rows[0]))
    return [[f.finding for f in s.fired if f.finding.rule.name == RULE] for s in steps]


def test_sustained_exposed_communication_names_the_waiting_ranks() -> None:
    # Rank 2 is the straggler: the other three wait for its gradients.
    found = _found([[0.35, 0.3, 0.01, 0.25]] * 5)
    assert [len(f) for f in found] == [0, 0, 0, 0, 1]
    (finding,) = found[-1]
    assert finding.values["ranks"] == [0, 1, 3]
    assert finding.rule.diagnosis == "comm_exposed"
    assert finding.rule.actions == (NotifyAction(),)  # it only notifies


def test_four_reports_or_a_share_at_most_20_percent_do_not_fire() -> None:
    assert _found([[0.5, 0.5]] * 4 + [[0.1, 0.1]]) == [[]] * 5
    assert _found([[0.19, 0.2 - 1e-9]] * 8) == [[]] * 8


def test_not_measured_is_never_judged() -> None:
    assert _found([[math.nan, math.nan]] * 8) == [[]] * 8

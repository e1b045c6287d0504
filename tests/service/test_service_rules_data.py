"""The default rules on the data side (service/rules.py, default_rules.yaml): a rank that waits
for its input (spread with a floor), and ranks that see the same data (check: above)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.service.conftest import make_report
from trainguard.service.engine import simulate
from trainguard.service.rules import RulesError, default_rules_text, load_rules

DEFAULTS = load_rules(default_rules_text())


def _fired(reports, world_size=4):  # type: ignore[no-untyped-def]
    return [[f.finding for f in s.fired] for s in simulate(DEFAULTS.for_job("job-a"), reports, world_size=world_size)]


def test_input_wait_straggler_names_the_data_slow_rank() -> None:
    healthy = [0.001, 0.0012, 0.0009, 0.0011]
    slow = [0.001, 0.0012, 0.0009, 0.4]
    reps = [make_report(10 * i, float(i), {}, input_wait_s=(slow if i > 0 else healthy)) for i in range(5)]
    found = _fired(reps)
    assert [[f.rule.name for f in s] for s in found] == [[]] * 4 + [["input_wait_straggler"]]
    v = found[4][0].values
    assert v["rank"] == 3 and v["ratio"] == pytest.approx(0.4 / float(np.median(slow[:3])))  # the others' median
    assert found[4][0].rule.diagnosis == "input_bound"


def test_input_wait_spread_below_the_floor_or_with_a_zero_median() -> None:
    tiny = [0.0001, 0.0001, 0.0001, 0.03]  # 300x the median but 30 ms < the 50 ms floor
    assert _fired([make_report(10 * i, float(i), {}, input_wait_s=tiny) for i in range(6)])[-1] == []
    zeros = [0.0, 0.0, 0.0, 0.2]  # median 0: an infinite ratio, above the floor
    found = _fired([make_report(10 * i, float(i), {}, input_wait_s=zeros) for i in range(5)])[-1]  # 5th report
    assert [f.rule.name for f in found] == ["input_wait_straggler"] and math.isinf(found[0].values["ratio"])
    all_zero = [0.0] * 4
    assert _fired([make_report(10 * i, float(i), {}, input_wait_s=all_zero) for i in range(6)])[-1] == []


def test_ranks_reading_the_same_data_are_named() -> None:
    overlap = [0.97, 0.01, 0.97, math.nan]  # ranks 0 and 2 share their data; rank 3 saw none
    (found,) = _fired([make_report(0, 0.0, {}, data_overlap=overlap)])
    assert [f.rule.name for f in found] == ["data_shared_across_ranks"]
    assert found[0].values["ranks"] == [0, 2] and found[0].values["values"] == {0: 0.97, 2: 0.97}
    assert "[0, 2]" in found[0].summary
    (quiet,) = _fired([make_report(0, 0.0, {}, data_overlap=[0.02, 0.01, 0.03, 0.0])])
    assert quiet == []
    (none,) = _fired([make_report(0, 0.0, {}, data_overlap=[math.nan] * 4)])
    assert none == []


def test_above_needs_its_value() -> None:
    base = {"name": "x", "kind": "cross_rank", "vector": "data_overlap", "severity": "info", "actions": ["notify"]}
    with pytest.raises(RulesError, match="value"):
        load_rules(f"version: 1\nrules:\n  - {base | {'check': 'above'}}\n".replace("'", '"'))
    with pytest.raises(RulesError, match="value"):
        load_rules(f"version: 1\nrules:\n  - {base | {'check': 'spread', 'value': 1.0}}\n".replace("'", '"'))


def test_a_gradient_recompute_mismatch_names_the_rank() -> None:
    nan = math.nan
    reps = [make_report(0, 0.0, {}, verify_mismatch=[0.0, 0.0, 0.0, 0.0]),
            make_report(1, 1.0, {}, verify_mismatch=[nan, nan, nan, nan]),  # no check in this interval
            make_report(2, 2.0, {}, verify_mismatch=[0.0, 3e-7, 0.0, 0.0]),  # GPU kernel noise
            make_report(3, 3.0, {}, verify_mismatch=[0.0, 0.0, 2e-3, 0.0])]
    found = _fired(reps)
    assert [[f.rule.name for f in s] for s in found] == [[], [], [], ["gradient_recompute_mismatch"]]
    f = found[3][0]
    assert f.values["ranks"] == [2] and f.values["values"] == {2: 2e-3} and f.rule.severity == "critical"
    assert f.rule.diagnosis == "gradient_recompute_mismatch" and "rank(s) [2]" in f.summary


def test_an_xid_error_names_the_rank_and_its_code() -> None:
    nan = math.nan
    reps = [make_report(0, 0.0, {}, gpu_xid=[nan, nan]), make_report(1, 1.0, {}, gpu_xid=[79.0, nan]),
            make_report(2, 2.0, {}, gpu_xid=[0.0, nan])]  # 0: no XID since the last report
    steps = simulate(DEFAULTS.for_job("job-a"), reps, world_size=2)
    assert [[f.finding.rule.name for f in s.fired] for s in steps] == [[], ["gpu_xid"], []]
    assert steps[2].resolved == ["gpu_xid"]
    found = [[f.finding for f in s.fired] for s in steps]
    f = found[1][0]
    assert f.values["ranks"] == [0] and f.values["values"] == {0: 79.0} and f.rule.severity == "critical"
    from trainguard.service.diagnosis import DIAGNOSES

    assert any(c.startswith("79: the GPU fell off the bus") for c in DIAGNOSES[f.rule.diagnosis].likely_causes)

"""service/evaluate_ranks.py: the built-in straggler rule judges each rank over a span of steps
(more than half of the reports of the last 11 steps, 5 reports at least), so that a burst of a few
slow steps on one rank is no straggler while a rank that stays slow is named, at a report every
step as at a report every 10 steps. Expected verdicts are counted here from the rows."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from trainguard.service.evaluate import evaluate
from trainguard.service.rules import default_rules_text, load_rules
from trainguard.service.window import RunWindow

RULE = next(r for r in load_rules(default_rules_text()).for_job("job-a") if r.name == "forward_time_straggler")
F = 0.02  # a healthy rank's forward (s)


def _named(rows: np.ndarray, every: int) -> list[list[int]]:
    """The ranks the rule names after each report of ``rows`` (steps x ranks), one report every
    ``every`` steps carrying its last step's forward (as the agent's do)."""
    window = RunWindow(capacity=128, rank_capacity=12, world_size=rows.shape[1], created=0.0)
    out = []
    for step in range(every, len(rows), every):
        window.append_raw({}, {"forward_s": rows[step]}, step, float(step))
        (finding,) = evaluate((RULE,), window, float(step))
        out.append(finding.values["ranks"] if finding.active else [])
    return out


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("burst", [3, 4, 5, 6])
def test_a_burst_of_a_few_slow_steps_on_one_rank_names_nothing(world: int, burst: int) -> None:
    """One process that got less CPU for a few steps (3x slower), reported every step: three of
    them in a row used to name it."""
    rows = np.full((60, world), F)
    rows[30:30 + burst, world - 1] = 3 * F
    assert _named(rows, 1) == [[]] * 59


@pytest.mark.parametrize("every", [1, 10])
def test_a_rank_slow_in_two_of_every_three_steps_is_named(every: int) -> None:
    """Its noise breaks every run of three slow steps (the old rule never named it); slow in more
    than half of the steps, it is named once the reports span 11 steps at a report every step (12 reports) and
    after 5 reports at a report every 10 steps, and stays named."""
    rows = np.full((200, 2), F)
    rows[:, 1] = [2 * F if i % 3 else F for i in range(200)]
    named = _named(rows, every)
    first = next(i for i, ranks in enumerate(named) if ranks)
    assert first == (11 if every == 1 else 4)
    assert all(ranks == [1] for ranks in named[first:])


def test_report_every_1_and_every_10_alike_on_a_slow_rank_and_on_bursts() -> None:
    """One run's forwards seen through both intervals: the 2x rank from step 100 on is named within
    the span (11 steps, or 5 reports) and the bursts before it name nothing."""
    rng = np.random.default_rng(4)
    rows = F * rng.lognormal(0.0, 0.1, (300, 4))
    for start in (20, 45, 70):  # bursts of 4 steps on rank 2
        rows[start:start + 4, 2] *= 3
    rows[100:, 1] *= 2
    for every in (1, 10):
        named = _named(rows, every)
        steps = list(range(every, 300, every))
        assert all(ranks == [] for step, ranks in zip(steps, named) if step < 100)
        first = next(step for step, ranks in zip(steps, named) if ranks)
        assert 100 <= first <= (111 if every == 1 else 140)
        assert all(ranks == [1] for step, ranks in zip(steps, named) if step >= first)


def test_a_group_slow_together_is_named_though_each_has_fast_steps() -> None:
    """Ranks 4-7 of 8 on a slower node type, each fast in one report of five at a different report
    (the old rule needed each slow in every report): named as a group, each with its median
    ratio."""
    rows = np.full((5, 8), F)
    rows[:, 4:] = 2.2 * F
    for i, r in enumerate((4, 5, 6, 7)):
        rows[i, r] = F
    window = RunWindow(capacity=128, rank_capacity=12, world_size=8, created=0.0)
    for i, row in enumerate(rows):
        window.append_raw({}, {"forward_s": row}, 10 * (i + 1), float(i))
    (f,) = evaluate((RULE,), window, 5.0)
    assert f.active and f.values["ranks"] == [4, 5, 6, 7] and f.values["reports"] == 5 and f.values["steps"] == 40

    def ratio(row: np.ndarray, r: int) -> float:
        return float(row[r]) / statistics.median(np.delete(row, r).tolist())

    expect = max(statistics.median(ratio(row, r) for row in rows) for r in (4, 5, 6, 7))
    assert f.values["ratio"] == pytest.approx(expect)
    assert "4 of 8 ranks (4, 5, 6, 7) are slow together" in f.summary and "over 5 reports (40 steps)" in f.summary


def test_no_span_of_steps_yet_names_nothing_and_a_missing_report_is_no_slow_one() -> None:
    """Five reports of a 2x rank within 4 steps (a span of 11 not reached) name nothing; a rank
    without a value in most reports is not slow in them."""
    window = RunWindow(capacity=128, rank_capacity=12, world_size=2, created=0.0)
    for step in range(5):
        window.append_raw({}, {"forward_s": np.array([F, 2 * F])}, step, float(step))
    assert evaluate((RULE,), window, 5.0)[0].active is False
    window = RunWindow(capacity=128, rank_capacity=12, world_size=3, created=0.0)
    for i in range(5):
        row = np.array([F, F, 3 * F if i in (0, 4) else np.nan])
        window.append_raw({}, {"forward_s": row}, 10 * i, float(i))
    assert evaluate((RULE,), window, 5.0)[0].active is False


def test_verdicts_are_the_same_when_the_kept_rows_are_dropped(monkeypatch) -> None:
    """Each row's verdict is kept for the reports after it; dropped (the store full) or never kept
    (more slow ranks than it keeps), rows are judged again with the same outcome."""
    from trainguard.service import evaluate_ranks

    rows = np.full((120, 200), F)
    rows[:, 1] = [2 * F if i % 3 else F for i in range(120)]
    rows[60:, 101:] = 2.5 * F  # from step 60 on, 99 ranks slow together (more than are kept)
    kept = _named(rows, 1)
    monkeypatch.setattr(evaluate_ranks, "_ROWS", {})
    monkeypatch.setattr(evaluate_ranks, "_ROWS_MAX", 8)
    monkeypatch.setattr(evaluate_ranks, "_SLOW_KEPT", 0)
    assert _named(rows, 1) == kept
    assert kept[20] == [1] and kept[-1] == [1, *range(101, 116)]  # (a finding lists 16 ranks)

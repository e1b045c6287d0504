"""Rules as table-driven cases: reports in, alerts and desired state out (pure, no I/O).

Expected values are computed here independently (statistics.median, scipy, hand arithmetic)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import scipy.stats

from trainguard.service.engine import simulate
from trainguard.service.rules import RulesError, default_rules_text, load_rules
from trainguard.protocol.wire import DesyncLayer, DesiredState
from tests.service.conftest import make_report

DEFAULTS = load_rules(default_rules_text())
GN, LOSS = "trainguard_grad_norm_max", "trainguard_loss"


def run(rules, reports, world_size=4, job="job-a"):
    return simulate(rules.for_job(job), reports, world_size=world_size)


def fired(step) -> list[str]:
    return [f.finding.rule.name for f in step.fired]


def series(metric, values, t0=0.0, dt=1.0, **extra):
    return [make_report(i, t0 + i * dt, {metric: v, **extra}) for i, v in enumerate(values)]


# -- the default rules' thresholds ---------------------------------------------------------------
@pytest.mark.parametrize(
    "metric, at_the_line, value, rule",
    [
        ("trainguard_data_duplicate_ratio", 0.05, 0.0501, "data_duplicate_ratio"),
        ("trainguard_data_token_kl_divergence", 0.1, 0.1001, "data_token_kl"),
        ("trainguard_data_special_token_ratio", 1e-4, 1.01e-4, "data_special_token_ratio"),
        ("trainguard_data_length_shift_pvalue", 0.05, 0.0499, "data_length_shift"),
        (GN, 250.0, 1000.5, "grad_norm_high"),  # (a rise: 4x its level before, crossing_rise)
        ("trainguard_optimizer_state_nonfinite", 0.0, 3.0, "optimizer_state_nonfinite"),
    ],
)
def test_seed_thresholds_fire_just_past_the_line(metric, at_the_line, value, rule):
    steps = run(DEFAULTS, [make_report(0, 0.0, {metric: at_the_line}), make_report(1, 1.0, {metric: value})])
    assert fired(steps[0]) == [] and fired(steps[1]) == [rule]


def test_a_gradient_norm_above_1e3_from_the_first_report_is_the_run_s_scale_and_draws_nothing():
    # A loss summed over 4,096 tokens: norms in the thousands from step 1, falling as it trains.
    steps = run(DEFAULTS, series(GN, [7700.0, 5200.0, 3900.0, 3100.0, 2800.0]))
    assert all(fired(s) == [] and s.desired.lr_scale == 1.0 for s in steps)
    # The same run crossing 1e3 from below (its norm had been 900) is a rise: it acts.
    steps = run(DEFAULTS, series(GN, [900.0, 950.0, 7700.0]))
    assert fired(steps[2]) == ["grad_norm_high"] and steps[2].desired.lr_scale == 0.5
    # A crossing counts within the rule's window (64 reports) and from finite values only.
    steps = run(DEFAULTS, series(GN, [400.0] + [2000.0] * 64 + [2500.0]))
    assert fired(steps[1]) == ["grad_norm_high"] and fired(steps[65]) == []
    steps = run(DEFAULTS, series(GN, [math.nan, 2000.0]))
    assert fired(steps[1]) == []


def test_a_gradient_norm_crossing_1e3_with_its_own_noise_draws_nothing():
    # A run whose norm's level is near 1e3 (a loss summed over a thousand tokens) crosses it back
    # and forth; a crossing is a rise to 4x the level before it (the median of the window's
    # positive values up to the last one within 1e3), whether from far below 1e3 or from near it.
    assert all(fired(s) == [] for s in run(DEFAULTS, series(GN, [963.0, 1128.0, 951.0, 1255.0])))
    assert all(fired(s) == [] for s in run(DEFAULTS, series(GN, [600.0, 0.0, 900.0, 700.0, 2700.0])))
    steps = run(DEFAULTS, series(GN, [600.0, 0.0, 900.0, 700.0, 2800.0]))
    assert fired(steps[4]) == ["grad_norm_high"] and steps[4].desired.lr_scale == 0.5
    # the level counts the values above the limit before the last one within it: a run above 1e3
    # that dipped under it once has not risen; one that was far below it has, each time
    assert all(fired(s) == [] for s in run(DEFAULTS, series(GN, [2000.0, 3000.0, 2500.0, 900.0, 3500.0])))
    steps = run(DEFAULTS, series(GN, [300.0, 200.0, 250.0, 5000.0, 700.0, 2000.0], dt=1000.0))
    assert ["grad_norm_high" in fired(s) for s in steps] == [False, False, False, True, False, True]


@pytest.mark.parametrize(
    "metric, value",
    [
        ("trainguard_data_duplicate_ratio", 0.05),  # "more than 5%": 5% itself is fine
        ("trainguard_data_token_kl_divergence", 0.1),
        ("trainguard_data_special_token_ratio", 1e-4),
        ("trainguard_data_length_shift_pvalue", 0.05),
        (GN, 1000.0),
        ("trainguard_optimizer_state_nonfinite", 0.0),
    ],
)
def test_seed_thresholds_hold_at_the_line(metric, value):
    assert fired(run(DEFAULTS, [make_report(0, 0.0, {metric: value})])[0]) == []


def test_grad_norm_over_1e3_halves_lr_and_notifies():
    steps = run(DEFAULTS, series(GN, [10.0, 2000.0]))
    assert fired(steps[0]) == [] and fired(steps[1]) == ["grad_norm_high"]
    f = steps[1].fired[0]
    assert f.notify
    assert f.finding.values["value"] == 2000.0 and f.finding.values["threshold"] == 1000.0
    assert steps[1].desired == DesiredState(generation=1, lr_scale=0.5, reason=steps[1].desired.reason)
    assert "grad_norm_high" in steps[1].desired.reason


@pytest.mark.parametrize("where", ["value", "rank"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_loss_pauses(where, bad):
    if where == "value":
        rep = make_report(3, 0.0, {LOSS: bad})
    else:
        rep = make_report(3, 0.0, {LOSS: 2.0}, loss=[2.0, 2.1, bad, 2.0])
    (step,) = run(DEFAULTS, [rep])
    assert "loss_nonfinite" in fired(step)
    assert step.desired.paused and step.desired.generation == 1 and step.desired.lr_scale == 1.0
    values = step.fired[0].finding.values["nonfinite"]
    if where == "rank":
        assert list(values["ranks.loss"]) == [2]


def test_large_finite_rank_losses_are_not_nonfinite():
    (step,) = run(DEFAULTS, [make_report(3, 0.0, {LOSS: 2.0}, loss=[1e308, 1e308, 1e308, 2.0])])
    assert "loss_nonfinite" not in fired(step)


def test_spike_ratio_against_rolling_median():
    hist = [1.0, 1.2, 0.9, 1.1, 1.3, 0.8, 1.0, 1.05, 0.95, 1.15]
    med = statistics.median(hist)
    below, above = series(GN, hist + [4.99 * med]), series(GN, hist + [5.01 * med])
    assert "grad_norm_spike" not in fired(run(DEFAULTS, below)[-1])
    last = run(DEFAULTS, above)[-1]
    assert fired(last) == ["grad_norm_spike"]
    v = last.fired[0].finding.values
    assert v["baseline"] == pytest.approx(med) and v["ratio"] == pytest.approx(5.01)
    assert last.desired.lr_scale == 0.5


def test_spike_needs_min_history():
    # Seven values of history (< min_history 8): no verdict even for a 100x jump.
    steps = run(DEFAULTS, series(GN, [1.0] * 7 + [100.0]))
    assert all("grad_norm_spike" not in fired(s) for s in steps)


def test_spike_zscore_uses_mad_scaled_to_sigma():
    rules = load_rules("""
rules:
  - {name: z, kind: spike, metric: m, mode: zscore, baseline: median, window: 16, min_history: 16, z: 4, actions: [notify]}
""")
    rng = np.random.default_rng(0)
    hist = (10 + rng.normal(size=16)).tolist()
    base = float(np.median(hist))
    sigma = float(scipy.stats.median_abs_deviation(hist, scale="normal"))
    for k, expect in ((3.99, False), (4.01, True)):
        steps = run(rules, series("m", hist + [base + k * sigma]))
        assert (fired(steps[-1]) == ["z"]) is expect, k
    z = run(rules, series("m", hist + [base + 4.01 * sigma]))[-1].fired[0].finding.values["zscore"]
    assert z == pytest.approx(4.01)


def test_spike_ema_baseline():
    rules = load_rules("""
rules:
  - {name: e, kind: spike, metric: m, mode: ratio, baseline: ema, window: 9, min_history: 9, ratio: 3, actions: [notify]}
""")
    hist = [1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0]
    alpha = 2 / (9 + 1)
    ema = hist[0]
    for v in hist[1:]:
        ema = alpha * v + (1 - alpha) * ema
    below = run(rules, series("m", hist + [2.99 * ema]))[-1]
    above = run(rules, series("m", hist + [3.01 * ema]))[-1]
    assert fired(below) == [] and fired(above) == ["e"]
    assert above.fired[0].finding.values["baseline"] == pytest.approx(ema)


def test_loss_not_decreasing_uses_least_squares_slope():
    rules = load_rules("""
rules:
  - {name: flat, kind: trend, metric: trainguard_loss, direction: not_decreasing, window: 20, min_rel_change: 0.05, actions: [notify], diagnosis: loss_plateau}
""")
    rng = np.random.default_rng(1)
    t = np.arange(20)
    falling = 3.0 - 0.02 * t + rng.normal(scale=0.01, size=20)  # drop 0.38 over the window
    flat = 3.0 - 0.002 * t + rng.normal(scale=0.01, size=20)
    for vals in (falling, flat):
        slope = scipy.stats.linregress(t, vals).slope
        expect = bool(-slope * 19 <= 0.05 * abs(vals.mean()))
        steps = run(rules, series(LOSS, vals.tolist()))
        assert (fired(steps[-1]) == ["flat"]) is expect
        if expect:
            assert steps[-1].fired[0].finding.values["slope_per_report"] == pytest.approx(slope)
            assert steps[-1].fired[0].finding.rule.diagnosis == "loss_plateau"
    assert fired(run(rules, series(LOSS, flat.tolist()))[-1]) == ["flat"]
    assert fired(run(rules, series(LOSS, falling.tolist()))[-1]) == []


def test_memory_growth_monotonic():
    mem = "trainguard_memory_allocated_bytes"
    growing = [1e9 * (1 + 0.005 * i) for i in range(32)]  # +15.5 %, never decreasing
    wobbling = list(growing)
    wobbling[10] = wobbling[9] - 1
    assert fired(run(DEFAULTS, series(mem, growing))[-1]) == ["memory_growth"]
    assert fired(run(DEFAULTS, series(mem, wobbling))[-1]) == []
    slow = [1e9 * (1 + 0.001 * i) for i in range(32)]  # +3.1 % < 10 %
    assert fired(run(DEFAULTS, series(mem, slow))[-1]) == []


def test_straggler_needs_five_reports_and_names_the_rank():
    """A report every 10 steps: five reports (40 steps) at least, the rank slow in most of them."""
    fast = [1.0, 1.02, 0.98, 1.01]
    slow = [1.0, 1.02, 0.98, 2.5]
    reps = [make_report(10 * i, float(i), {}, step_time_s=(slow if i > 0 else fast)) for i in range(5)]
    steps = run(DEFAULTS, reps)
    assert [fired(s) for s in steps] == [[], [], [], [], ["step_time_straggler"]]
    v = steps[4].fired[0].finding.values
    assert (v["reports"], v["steps"]) == (5, 40)
    assert v["rank"] == 3 and v["ratio"] == pytest.approx(2.5 / float(np.median(slow[:3])))  # the others' median


def test_forward_time_straggler_fires_on_forward_time_while_step_times_are_equal():
    """Under DDP the all-reduce equalises step times: only the forward time shows the slow rank."""
    equal = [1.0, 1.0, 1.0, 1.0]
    fwd = [0.20, 0.21, 0.19, 0.61]  # rank 3: 0.61 / the others' median 0.20 = 3.05 >= 1.5
    reps = [make_report(10 * i, float(i), {}, step_time_s=equal, forward_s=fwd) for i in range(6)]
    steps = run(DEFAULTS, reps)
    assert [fired(s) for s in steps] == [[]] * 4 + [["forward_time_straggler"], []]  # 5 reports, then cooldown
    v = steps[4].fired[0].finding.values
    assert v["rank"] == 3 and v["ratio"] == pytest.approx(0.61 / float(np.median(fwd[:3])))
    even = [0.20, 0.21, 0.19, 0.22]
    calm = [make_report(10 * i, float(i), {}, step_time_s=equal, forward_s=even) for i in range(6)]
    assert all(fired(s) == [] for s in run(DEFAULTS, calm))


_F, _S = 0.020, 0.110  # a fast rank's forward (s) and one made slow by a 90 ms sleep


@pytest.mark.parametrize("vector, rule, rows, expect", [
    # 4 ranks, one slow: against the median of the 3 others (a report every 10 steps: 5 reports)
    ("forward_s", "forward_time_straggler", [[_F, _F * 1.1, _S, _F * 0.9]] * 5, 2),
    ("forward_s", "forward_time_straggler", [[_F, _F, _F, _S], [math.nan, _F, _F, _S], [_F, _F, _F, _S]] + [[_F, _F, _F, _S]] * 2, 3),
    # sub-10 ms forwards: 2x the median is scheduling noise, not judged
    ("forward_s", "forward_time_straggler", [[0.0003, 0.0003, 0.0006, 0.0003]] * 5, None),
    # above the floor and 2x the median each time, but a different rank on top each time
    ("forward_s", "forward_time_straggler",
     [[2 * _F, _F, _F, _F], [_F, 2 * _F, _F, _F], [_F, _F, 2 * _F, _F], [_F, _F, _F, 2 * _F], [2 * _F, _F, _F, _F]], None),
    # slow in two of five reports each: no rank in most of them
    ("forward_s", "forward_time_straggler", [[_F, _F, _S, _F], [_F, _F, _S, _F], [_F, _F, _F, _S], [_F, _F, _F, _S], [_S, _F, _F, _F]], None),
    # 2 ranks: each against the other (the median of both, their mean, made a rank at 2.5x read 1.43x)
    ("forward_s", "forward_time_straggler", [[_F, 3.5 * _F]] * 5, 1),
    ("forward_s", "forward_time_straggler", [[_F, 2.5 * _F]] * 5, 1),
    ("forward_s", "forward_time_straggler", [[2 * _F, _F]] * 5, 0),
    ("forward_s", "forward_time_straggler", [[1.4 * _F, _F]] * 5, None),
    # 3 ranks: 1.8x / the others' median 1.15x = 1.57 (against the median of all three, 1.3x: 1.38)
    ("forward_s", "forward_time_straggler", [[_F, 1.3 * _F, 1.8 * _F]] * 5, 2),
    # a data-slow rank of 4, and a wait that moves from rank to rank
    ("input_wait_s", "input_wait_straggler", [[0.001, 0.002, 0.001, 0.1]] * 5, 3),
    ("input_wait_s", "input_wait_straggler",
     [[0.001, 0.1, 0.001, 0.001], [0.001, 0.001, 0.1, 0.001], [0.1, 0.001, 0.001, 0.001]] * 2, None),
])
def test_cross_rank_spread_names_one_rank_that_stays_slow(vector, rule, rows, expect) -> None:
    world = len(rows[0])
    steps = run(DEFAULTS, [make_report(10 * i, float(i), {}, **{vector: row}) for i, row in enumerate(rows)], world_size=world)
    found = [f.finding for f in steps[-1].fired if f.finding.rule.name == rule]
    if expect is None:
        assert found == []
        return
    (f,) = found
    others = [v for r, v in enumerate(rows[-1]) if not math.isnan(v) and r != expect]
    assert f.values["rank"] == expect and f.values["ratio"] == pytest.approx(rows[-1][expect] / statistics.median(others))
    assert f.values["ranks"] == [expect] and "median of the other ranks" in f.summary


STRAGGLER_RULES = {"step_time_straggler", "forward_time_straggler", "input_wait_straggler"}


def _straggler_findings(rows: dict[str, list[list[float]]], every: int = 10) -> list[list]:
    """The straggler rules' fired findings after each report of per-rank ``rows`` (vector -> rows),
    one report every ``every`` steps."""
    count, world = len(next(iter(rows.values()))), len(next(iter(rows.values()))[0])
    reports = [make_report(every * i, 10.0 * i, {}, **{v: r[i] for v, r in rows.items()}) for i in range(count)]
    return [[f.finding for f in s.fired if f.finding.rule.name in STRAGGLER_RULES] for s in run(DEFAULTS, reports, world)]


def test_a_rank_twice_as_slow_as_the_other_of_two_is_named_and_ordinary_jitter_is_not() -> None:
    slow = _straggler_findings({"forward_s": [[0.020, 0.040]] * 5})
    assert [[f.rule.name for f in s] for s in slow] == [[]] * 4 + [["forward_time_straggler"]]
    assert slow[4][0].values["rank"] == 1 and slow[4][0].values["ratio"] == pytest.approx(2.0)
    # 1.3x apart on one report (then even), and 1.3x apart five reports in a row: below 1.5x
    for rows in ([[0.020, 0.026]] + [[0.020, 0.020]] * 4, [[0.020, 0.026]] * 5, [[0.026, 0.020]] * 5):
        assert _straggler_findings({"forward_s": rows, "step_time_s": [[r[0] * 20, r[1] * 20] for r in rows]}) == [[]] * 5


def test_eight_ranks_with_lognormal_jitter_raise_nothing() -> None:
    rng = np.random.default_rng(8)
    base = {"step_time_s": 0.5, "forward_s": 0.05, "input_wait_s": 0.06}
    rows = {v: (b * rng.lognormal(0.0, 0.1, (600, 8))).tolist() for v, b in base.items()}
    assert all(s == [] for s in _straggler_findings(rows))


def test_half_the_ranks_slow_together_are_named_as_a_group() -> None:
    """Two node types (ranks 4-7 on the slower one): against the median of all eight (the mean of a
    fast and a slow rank) a slow rank read 1.33x and nothing fired; each slow rank's others are mostly
    fast, so all four are named, and the text says that they are slow together."""
    rng = np.random.default_rng(3)
    rows = [(np.r_[np.full(4, 0.02), np.full(4, 0.04)] * rng.uniform(0.97, 1.03, 8)).tolist() for _ in range(5)]
    steps = _straggler_findings({"forward_s": rows})
    assert [[f.rule.name for f in s] for s in steps] == [[]] * 4 + [["forward_time_straggler"]]
    (f,) = steps[4]
    assert f.values["ranks"] == [4, 5, 6, 7] and f.values["count"] == 4 and f.values["judged"] == 8

    def median_ratio(r: int) -> float:  # over the 5 reports, each against the median of its others
        return statistics.median(row[r] / statistics.median(row[:r] + row[r + 1:]) for row in rows)

    assert f.values["rank"] == max(range(4, 8), key=median_ratio)
    assert f.values["ratio"] == pytest.approx(median_ratio(f.values["rank"]))
    assert "4 of 8 ranks (4, 5, 6, 7) are slow together" in f.summary and "not to one rank" in f.summary
    # five of eight slow: theirs is the job's speed, no rank is named
    most = [[0.02, 0.02, 0.02, 0.04, 0.04, 0.04, 0.04, 0.04]] * 5
    assert _straggler_findings({"forward_s": most}) == [[]] * 5


@pytest.mark.parametrize("vector, rel, expect", [
    ("grad_desync", 1e-4, True), ("grad_desync", 1e-7, False),
    ("param_desync", 2e-5, True), ("param_desync", 0.0, False),
])
def test_desync_rules_name_the_ranks_and_layers(vector, rel, expect):
    kind = vector.removesuffix("_desync")
    diff = [0.0] * 8
    diff[5] = rel
    layers = [DesyncLayer(kind=kind, layer="blocks.3", rel_diff=rel, ranks=[5])] if expect else []
    report = make_report(0, 0.0, {}, **{vector: diff}).model_copy(update={"desync": layers})
    (step,) = run(DEFAULTS, [report], world_size=8)
    assert fired(step) == ([vector] if expect else [])
    if expect:
        finding = step.fired[0].finding
        assert finding.values["ranks"] == [5]
        assert finding.values["layers"] == [{"layer": "blocks.3", "rel_diff": rel, "ranks": [5]}]
        assert "blocks.3" in finding.summary and finding.rule.severity == "critical"


def test_desync_rule_ignores_nan_and_flags_inf():
    nan = make_report(0, 0.0, {}, grad_desync=[math.nan] * 4)
    inf = make_report(1, 1.0, {}, grad_desync=[0.0, 0.0, math.inf, 0.0])
    steps = run(DEFAULTS, [nan, inf])
    assert fired(steps[0]) == [] and fired(steps[1]) == ["grad_desync"]
    assert steps[1].fired[0].finding.values["ranks"] == [2]


def test_absence_fires_during_silence_and_resolves_on_next_report():
    steps = run(DEFAULTS, [make_report(0, 1000.0), make_report(1, 1100.0), make_report(2, 1100.0 + 301.0)])
    assert fired(steps[1]) == []
    assert fired(steps[2]) == ["run_silent"] and steps[2].resolved == ["run_silent"]
    assert steps[2].fired[0].finding.values["silent_s"] == pytest.approx(301.0)


def test_cooldown_then_refire_halves_again():
    # fires at t=1, resolves at t=10, condition again at t=100 (cooldown 300 s: suppressed), t=302 fires.
    times_values = [(0, 5.0), (1, 2000.0), (10, 5.0), (100, 2000.0), (302, 2000.0)]
    reps = [make_report(i, t, {GN: v}) for i, (t, v) in enumerate(times_values)]
    steps = run(DEFAULTS, reps)
    assert [fired(s) for s in steps] == [[], ["grad_norm_high"], [], [], ["grad_norm_high"]]
    assert steps[2].resolved == ["grad_norm_high"]
    assert [(f.rule.name, why) for f, why in steps[3].suppressed] == [("grad_norm_high", "cooldown")]
    assert [s.desired.lr_scale for s in steps] == [1.0, 0.5, 0.5, 0.5, 0.25]
    assert [s.desired.generation for s in steps] == [0, 1, 1, 1, 2]


def test_cap_limits_alerts_per_window():
    rules = load_rules("""
rules:
  - {name: c, kind: threshold, metric: m, op: ">", value: 1, cooldown_s: 0, cap: 2, cap_window_s: 100, actions: [checkpoint]}
""")
    vals = [(0, 2), (1, 0), (2, 2), (3, 0), (4, 2), (5, 0), (101, 2)]
    steps = run(rules, [make_report(i, float(t), {"m": float(v)}) for i, (t, v) in enumerate(vals)])
    assert [fired(s) for s in steps] == [["c"], [], ["c"], [], [], [], ["c"]]
    assert [why for f, why in steps[4].suppressed] == ["cap"]
    assert steps[-1].desired.checkpoint_seq == 3


def test_threshold_for_consecutive_reports():
    steps = run(DEFAULTS, series("trainguard_update_ratio", [0.02, 0.02, 0.005, 0.02, 0.02, 0.02]))
    assert [fired(s) for s in steps] == [[], [], [], [], [], ["update_ratio_high"]]


def test_low_mfu_notifies_after_thirty_reports_and_changes_nothing():
    steps = run(DEFAULTS, series("trainguard_mfu", [0.10] * 29 + [0.20] + [0.10] * 30))
    hits = [i for i, s in enumerate(steps) if "mfu_low" in fired(s)]
    assert hits == [59]  # 30 reports in a row below 0.15: the one at 0.20 restarts the count
    assert [a.type for a in steps[59].fired[0].finding.rule.actions] == ["notify"]
    assert steps[59].fired[0].desired is None and steps[59].desired == steps[58].desired  # the run is not changed
    assert all("mfu_low" not in fired(s) for s in run(DEFAULTS, series("trainguard_loss", [1.0] * 40)))  # absent: no data


def test_absolute_lr_scale_and_clamp():
    rules = load_rules("""
rules:
  - {name: a, kind: threshold, metric: m, op: ">", value: 1, cooldown_s: 0, actions: [{type: lr_scale, value: 0.1}]}
  - {name: b, kind: threshold, metric: n, op: ">", value: 1, cooldown_s: 0, actions: [{type: lr_scale, factor: 0.01, min: 0.05}]}
""")
    steps = run(rules, [make_report(0, 0.0, {"m": 2.0}), make_report(1, 1.0, {"n": 2.0})])
    assert steps[0].desired.lr_scale == 0.1
    assert steps[1].desired.lr_scale == 0.05  # 0.1 * 0.01 = 0.001, clamped to min 0.05
    assert steps[1].desired.generation == 2


def test_per_job_override_and_disable():
    text = default_rules_text() + """
jobs:
  big-job:
    - {name: grad_norm_high, value: 5000}
    - {name: data_duplicate_ratio, enabled: false}
"""
    rules = load_rules(text)
    for job, expect in (("big-job", []), ("other", ["grad_norm_high"])):
        reports = [make_report(0, 0.0, {GN: 10.0}, job=job), make_report(1, 1.0, {GN: 2000.0}, job=job)]
        steps = simulate(rules.for_job(job), reports, world_size=1)
        assert fired(steps[1]) == expect
    dup = [make_report(0, 0.0, {"trainguard_data_duplicate_ratio": 0.5}, job="big-job")]
    assert fired(simulate(rules.for_job("big-job"), dup, world_size=1)[0]) == []


def test_alert_carries_seed_diagnosis():
    (step,) = run(DEFAULTS, [make_report(0, 0.0, {LOSS: math.nan})])
    rule = step.fired[0].finding.rule
    assert rule.diagnosis == "loss_nan"
    from trainguard.service.diagnosis import DIAGNOSES

    assert "Gradient explosion" in DIAGNOSES["loss_nan"].likely_causes[0]
    assert "Lower the learning rate" in DIAGNOSES["loss_nan"].suggested_actions


@pytest.mark.parametrize(
    "text, reason",
    [
        ("rules: [{name: a, kind: nope}]", "kind"),
        ("rules: [{name: a, kind: threshold, metric: m, op: '>', value: 1, diagnosis: xyz}]", "unknown diagnosis"),
        ("rules: [{name: a, kind: threshold, metric: m, op: '>', value: 1, actions: [{type: lr_scale, value: 1, factor: 2}]}]", "exactly one"),
        ("rules: [{name: a, kind: absence}, {name: a, kind: absence}]", "duplicate"),
        ("rules: [{name: a, kind: spike, metric: m, window: 4, min_history: 8}]", "min_history"),
        ("rules: [{name: a, kind: threshold, metric: m, op: '>', value: .nan}]", "finite"),
        ("jobs: {j: [{name: ghost, value: 3}]}", "ghost"),
        ("[1, 2]", "mapping"),
        ("rules: [", "YAML"),
    ],
)
def test_bad_rules_are_refused_with_reasons(text, reason):
    with pytest.raises(RulesError) as info:
        load_rules(text)
    assert any(reason.lower() in r.lower() for r in info.value.reasons), info.value.reasons


def test_window_capacity_is_checked():
    with pytest.raises(RulesError, match="TRAINGUARD_WINDOW_REPORTS"):
        load_rules("rules: [{name: a, kind: trend, metric: m, direction: increasing, window: 500}]", max_reports=128)


def _naive_spike_ratio(hist: list[float], latest: float, ratio: float, min_history: int) -> bool | None:
    """The ratio spike rule by its definition: the latest value over the median of the finite
    values of its window (None: too little history, or a baseline or value <= 0)."""
    finite = [v for v in hist if math.isfinite(v)]
    if not math.isfinite(latest):
        return False
    if len(finite) < min_history:
        return None
    base = statistics.median(finite)
    if base <= 0 or latest <= 0:
        return None
    return latest / base >= ratio


def test_spike_ratio_verdicts_equal_the_definition_on_random_windows() -> None:
    """Every verdict of the ratio spike rule (including its quick "no" for a value below ratio x
    the window's minimum) against the definition, on windows with spikes, zeros, NaN and +-inf."""
    from trainguard.service.evaluate import evaluate
    from trainguard.service.window import RunWindow

    rule = next(r for r in DEFAULTS.for_job("job-a") if r.name == "grad_norm_spike")
    assert rule.mode == "ratio" and rule.baseline == "median" and rule.direction == "up"
    rule = rule.model_copy(update={"recurring": 0, "trend_with": None})  # (their own tests below)
    rng = np.random.default_rng(7)
    specials = [math.nan, math.inf, -math.inf, 0.0, -1.0]
    verdicts = {True: 0, False: 0, None: 0}
    for trial in range(600):
        n = int(rng.integers(1, rule.window + 3))
        values = [float(v) for v in np.exp(rng.normal(0.0, float(rng.choice([0.05, 0.5, 1.2])), size=n))]
        for _ in range(int(rng.integers(0, 3))):
            if rng.random() < 0.3:
                values[int(rng.integers(0, n))] = float(rng.choice(specials))
        if rng.random() < 0.3:
            values[-1] *= float(rng.choice([4.0, 6.0, 50.0]))
        window = RunWindow(capacity=128, rank_capacity=4, world_size=1, created=0.0)
        for i, v in enumerate(values):
            window.append_raw({GN: float(v)}, {}, i, float(i))
        (finding,) = evaluate((rule,), window, float(n))
        expect = _naive_spike_ratio(values[-rule.window - 1:-1], values[-1], rule.ratio, rule.min_history)
        assert finding.active is expect, (trial, values)
        verdicts[expect] += 1
    assert min(verdicts.values()) >= 30  # every verdict was exercised


def _naive_trend_verdict(hist: list[float], latest: float, losses: list[float], ratio: float) -> bool:
    """``trend_with`` by its definition, with scipy's Theil-Sen estimator: a value >= ratio x the
    median is judged against the robust line through the window's logarithms instead (where it
    rises above the median) when the window and the value climbed (none > 2x the largest of the 3
    before it) and the loss is at or below its median over the window."""
    base = statistics.median(hist)
    if latest / base < ratio:
        return False
    xs = hist + [latest]
    climbs = all(xs[i] <= 2.0 * max(xs[max(0, i - 3):i]) for i in range(1, len(xs)))
    fit = scipy.stats.theilslopes(np.log(hist), np.arange(len(hist)), method="joint")
    if fit.slope > 0 and climbs and losses[-1] <= statistics.median(losses[:-1]):
        level = math.exp(fit.intercept + fit.slope * len(hist))
        if level > base:
            return latest / level >= ratio
    return True


def test_spike_verdicts_on_a_rising_trend_equal_the_definition_on_random_windows() -> None:
    """``grad_norm_spike``'s ``trend_with: trainguard_loss`` against its definition (above), on
    random windows: climbs of 0-50 % per report with noise, some with a jump inside, the newest
    value climbing on or jumping off, the loss falling or rising. Every outcome is exercised: a
    spike, no spike, and a value >= 5x its median that the trend clears."""
    from trainguard.service.evaluate import evaluate
    from trainguard.service.window import RunWindow

    rule = next(r for r in DEFAULTS.for_job("job-a") if r.name == "grad_norm_spike")
    assert rule.trend_with == LOSS
    rule = rule.model_copy(update={"recurring": 0, "schedule_discount": False})
    rng = np.random.default_rng(5)
    outcomes = {"spike": 0, "quiet": 0, "cleared": 0}
    for trial in range(500):
        n = int(rng.integers(rule.min_history, rule.window + 1))
        rate = float(rng.uniform(1.0, 1.5))
        hist = [float(rate ** i * np.exp(rng.normal(0, 0.05))) for i in range(n)]
        if rng.random() < 0.25:  # a level that jumped inside the window
            at = int(rng.integers(1, n))
            hist[at:] = [v * 12.0 for v in hist[at:]]
        latest = hist[-1] * (rate if rng.random() < 0.6 else float(rng.choice([3.0, 8.0, 30.0])))
        slope = float(rng.choice([-0.02, 0.01]))
        losses = [3.0 * math.exp(slope * i) for i in range(n + 1)]
        window = RunWindow(capacity=128, rank_capacity=4, world_size=1, created=0.0)
        for i, v in enumerate(hist + [latest]):
            window.append_raw({GN: v, LOSS: losses[i]}, {}, i, float(i))
        (finding,) = evaluate((rule,), window, float(n))
        expect = _naive_trend_verdict(hist, latest, losses, rule.ratio)
        assert finding.active is expect, (trial, hist, latest, losses[-1])
        median_says = latest / statistics.median(hist) >= rule.ratio
        outcomes["spike" if expect else "cleared" if median_says else "quiet"] += 1
    assert min(outcomes.values()) >= 30, outcomes


def test_a_trend_is_not_judged_with_a_blown_up_loss_an_overflowing_line_or_in_another_mode() -> None:
    """``trend_with`` clears a climb only while the newest report's loss is finite and at or below
    its median: a NaN or infinite loss, or none in the newest report, is judged against the median.
    A line whose level would overflow a float gives no trend (no error). A job that overrides the
    rule's mode keeps a valid rule: the trend is ignored outside ratio mode."""
    from trainguard.service.evaluate import evaluate
    from trainguard.service.window import RunWindow

    rule = next(r for r in DEFAULTS.for_job("job-a") if r.name == "grad_norm_spike")
    rule = rule.model_copy(update={"recurring": 0, "schedule_discount": False})
    climb = [0.1 * 1.15 ** i for i in range(33)]  # the newest 5.7x the window's median, 1.15x its predecessor

    def verdict(values: list[float], last_loss: float | None) -> bool:
        window = RunWindow(capacity=128, rank_capacity=4, world_size=1, created=0.0)
        for i, v in enumerate(values):
            row = {GN: v}
            if i < len(values) - 1:
                row[LOSS] = 3.0 - 0.01 * i
            elif last_loss is not None:
                row[LOSS] = last_loss
            window.append_raw(row, {}, i, float(i))
        (finding,) = evaluate((rule,), window, float(len(values)))
        return finding.active

    assert climb[-1] / statistics.median(climb[:-1]) >= rule.ratio
    assert verdict(climb, 2.5) is False  # the loss falling: the trend clears it
    for blown_up in (math.nan, math.inf, None):
        assert verdict(climb, blown_up) is True
    huge = [1e300 * 1.2 ** i for i in range(32)] + [1e300 * 1.2 ** 31 * 1.9]
    assert verdict(huge, 2.5) in (True, False)  # evaluated, no OverflowError
    overrides = load_rules(default_rules_text() + "\njobs:\n  job-z:\n    - {name: grad_norm_spike, mode: zscore, z: 6}\n")
    zrule = next(r for r in overrides.for_job("job-z") if r.name == "grad_norm_spike")
    assert zrule.mode == "zscore" and zrule.trend_with == LOSS


def test_straggler_spread_verdicts_equal_the_definition_on_random_rows() -> None:
    """The step-time straggler rule (with its quick "no") against its definition: some rank's value
    / the median of the other ranks' finite values >= ratio (and >= min_value) in more than half of
    the last 5 reports (a report every 10 steps: 40 steps), the same rank each time, and the newest
    report judges (two finite values, a positive median); the ranks named are those."""
    from trainguard.service.evaluate import evaluate
    from trainguard.service.window import RunWindow

    rule = next(r for r in DEFAULTS.for_job("job-a") if r.name == "step_time_straggler")
    rng = np.random.default_rng(11)
    fired_count = quiet = 0
    for trial in range(600):
        world = int(rng.integers(1, 9))
        slow = int(rng.integers(0, world))
        rows = []
        for _ in range(rule.for_reports):
            row = list(rng.uniform(0.9, 1.1, size=world) * float(rng.choice([0.001, 1.0])))
            if rng.random() < 0.85:
                row[slow] *= float(rng.choice([1.2, 2.0, 3.0]))
            if rng.random() < 0.15:
                row[int(rng.integers(0, world))] = float(rng.choice([math.nan, math.inf, 0.0]))
            rows.append(row)
        window = RunWindow(capacity=16, rank_capacity=8, world_size=world, created=0.0)
        for i, row in enumerate(rows):
            window.append_raw({}, {"step_time_s": np.array(row)}, 10 * i, float(i))
        (finding,) = evaluate((rule,), window, 3.0)

        def slow(row: list[float]) -> set[int]:
            out = set()
            for r, v in enumerate(row):
                others = [x for k, x in enumerate(row) if k != r and math.isfinite(x)]
                if not math.isfinite(v) or not others:
                    continue
                med = statistics.median(others)
                if (v / med >= rule.ratio if med > 0 else rule.min_value > 0) and v >= rule.min_value:
                    out.add(r)
            return out

        newest = [x for x in rows[-1] if math.isfinite(x)]
        judges = len(newest) >= 2 and (statistics.median(newest) > 0 or rule.min_value > 0)
        named = {r for r in range(world) if 2 * sum(r in slow(row) for row in rows) > len(rows)} if judges else set()
        expect = bool(named)
        assert bool(finding.active) is expect, (trial, rows)
        if expect:
            assert finding.values["ranks"] == sorted(named), (trial, rows)
        fired_count += expect
        quiet += not expect
    assert fired_count >= 20 and quiet >= 20



def test_findings_without_an_alert_are_shared_per_rule_set_and_their_memory_is_bounded(monkeypatch):
    """A report's evaluation gives mostly "no" and "no data" findings; they are built once per rule
    set (the plan of a rules tuple) and kept for at most a bounded number of rule sets (every rules
    reload makes new ones), while a firing finding is always new and carries its values."""
    from trainguard.service import evaluate as ev
    from trainguard.service.rules import ThresholdRule
    from trainguard.service.window import RunWindow

    monkeypatch.setattr(ev, "_PLANS", {})  # (other tests' rule sets fill the module's cache)
    monkeypatch.setattr(ev, "_PLANS_MAX", 16)
    window = RunWindow(capacity=8, rank_capacity=2, world_size=1, created=0.0)
    window.append(make_report(1, 1.0, {"m": 1.0}), 1.0)

    def rule_set() -> tuple[ThresholdRule, ...]:
        return tuple(ThresholdRule(name=name, kind="threshold", metric=metric, op=">", value=value, severity="warning",
                                   actions=[{"type": "notify"}])
                     for name, metric, value in (("low", "m", 2.0), ("high", "m", 0.5), ("gone", "absent", 0.5)))

    rules = rule_set()
    no, fired, unknown = ev.evaluate(rules, window, 1.0)
    again = ev.evaluate(rules, window, 1.0)
    assert (no.rule, no.active, unknown.rule, unknown.active) == (rules[0], False, rules[2], None)
    assert again[0] is no and again[2] is unknown  # shared within a rule set
    assert fired.active is True and fired.values["value"] == 1.0 and again[1] is not fired and again[1].active is True
    sizes = []
    for _ in range(100):  # one rule set per reload, each with new rule objects
        reloaded = rule_set()
        verdicts = [(f.rule, f.active) for f in ev.evaluate(reloaded, window, 1.0)]
        assert verdicts == [(reloaded[0], False), (reloaded[1], True), (reloaded[2], None)]
        sizes.append(len(ev._PLANS))
    assert max(sizes) <= 16 and min(sizes[-50:]) < 16  # emptied when full, never grown past the bound


def test_the_update_ratio_limit_is_the_first_steps_one_after_the_run_starts_and_after_a_new_optimizer():
    ur = "trainguard_update_ratio"
    # (step, update ratio, optimizer class): 0.02 is above 0.01 but below the first 50 steps' 0.04.
    def reports(rows):
        return [make_report(s, float(i), {ur: v, "trainguard_step": float(s), "trainguard_optimizer_class": c})
                for i, (s, v, c) in enumerate(rows)]
    start = [(s, 0.02, 1.0) for s in range(1, 51)]
    assert all(fired(x) == [] for x in run(DEFAULTS, reports(start)))
    later = reports(start + [(s, 0.02, 1.0) for s in range(51, 54)])
    assert [fired(x) for x in run(DEFAULTS, later)[50:]] == [[], [], ["update_ratio_high"]]  # reports 51-53 judged
    new_optimizer = [(s, 0.002, 1.0) for s in range(1, 101)] + [(s, 0.02, 2.0) for s in range(101, 160)]
    steps = run(DEFAULTS, reports(new_optimizer))
    assert [x.step_last for x in steps if fired(x)] == [153]  # 50 steps after the last report of the old one
    assert steps[152].fired[0].finding.values["threshold"] == 0.0101
    first = run(DEFAULTS, reports([(1, 0.05, 1.0), (2, 0.05, 1.0), (3, 0.05, 1.0)]))[-1]
    assert fired(first) == ["update_ratio_high"] and first.fired[0].finding.values["threshold"] == 0.04


def test_the_update_ratio_limit_follows_the_optimizer_states_age_when_the_report_carries_it():
    ur, age = "trainguard_update_ratio", "trainguard_optimizer_state_steps"
    # (step, update ratio, the state's age): 0.02 is above 0.01 but below the first 50 steps' 0.04.
    def reports(rows):
        return [make_report(s, float(i), {ur: v, "trainguard_step": float(s), age: a})
                for i, (s, v, a) in enumerate(rows)]
    run_on = [(s, 0.002, float(s)) for s in range(1, 101)]
    fresh = run(DEFAULTS, reports(run_on + [(100 + a, 0.02, float(a)) for a in range(1, 60)]))  # a new state at 101
    assert [x.step_last for x in fresh if fired(x)] == [153]  # its age 51 in the oldest of the three
    assert fresh[152].fired[0].finding.values["threshold"] == 0.0101
    restored = run(DEFAULTS, reports([(s, 0.02, 1000.0 + s) for s in range(1, 4)]))  # the step restarts, the state not
    assert fired(restored[-1]) == ["update_ratio_high"] and restored[-1].fired[0].finding.values["threshold"] == 0.0101
    older = run(DEFAULTS, [make_report(s, float(s), {ur: 0.02, "trainguard_step": float(s)}) for s in range(1, 4)])
    assert fired(older[-1]) == []  # an older agent's reports: the run's first steps


def test_a_flat_loss_draws_the_plateau_alert_only_while_the_window_covers_half_the_run():
    flat = [2.0 + 0.001 * (i % 3) for i in range(100)]  # least-squares line rising: not decreasing
    at = lambda first: [make_report(first + i, float(i), {LOSS: v, "trainguard_step": float(first + i)})  # noqa: E731
                        for i, v in enumerate(flat)]
    assert fired(run(DEFAULTS, at(1))[-1]) == ["loss_not_decreasing"]  # steps 1-100: the whole run
    assert fired(run(DEFAULTS, at(99))[-1]) == ["loss_not_decreasing"]  # 99-198: its latter half
    assert fired(run(DEFAULTS, at(100))[-1]) == []  # 100-199: less than half
    assert fired(run(DEFAULTS, series(LOSS, flat))[-1]) == ["loss_not_decreasing"]  # no steps: judged

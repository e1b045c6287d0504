"""Adaptive LR, the LR ramp, rollback targets and the escalation ladder on report sequences
replayed through the default rules (``engine.simulate``: no I/O).

The run is a closed loop: each report's update ratio is the healthy value x the user's own LR
multiplier at that step x the lr_scale the controller had asked for after the previous report
(what the agent applies), so the tests see what the actions do to it."""

from __future__ import annotations

import copy
import math
import random

import pytest

from trainguard.protocol.wire import LR_SCALE_MIN, DesiredState, Report
from trainguard.service.adaptive_lr import LrRamp, ScheduleBaseline, baseline, corrected_scale
from trainguard.service.engine import simulate
from trainguard.service.incidents import RunRecovery
from trainguard.service.rules import AdaptiveLrAction, RecoveryPolicy, default_rules_text, load_rules

BASE = 1e-3
EVERY = 10
RULES = load_rules(default_rules_text())
LR0 = 2e-3


def agent_lr_values(update_ratio: float, mults: list[float], scale: float) -> dict[str, float]:
    """What the agent reports besides the update ratio (``trainer_agent/measure/schedule.py``): the user's
    schedule set LR0 x ``mults[-1]`` for the report's steps (``mults``: every report's multiplier
    so far), the step applied it x ``scale``."""
    mult = mults[-1]
    out = {"trainguard_update_ratio": update_ratio, "trainguard_update_ratio_per_lr": update_ratio / (LR0 * mult * scale),
           "trainguard_scheduler_lr": LR0 * mult, "trainguard_scheduler_lr_max": LR0 * mult}
    if len(mults) > 1:
        out["trainguard_scheduler_lr_peak"] = LR0 * max(mults[:-1])
        out["trainguard_scheduler_lr_ratio"] = mult / max(mults[:-1])
    return out


def _loop(lr_mult, n: int, *, policy: RecoveryPolicy | None = None, loss=lambda i: 2.0, snapshot_every: int | None = None,
          seed: int = 0):
    rng = random.Random(seed)
    policy = policy or RULES.file.recovery
    reports: list[Report] = []
    steps = []
    mults: list[float] = []
    for i in range(n):
        scale = steps[-1].desired.lr_scale if steps else 1.0
        step = (i + 1) * EVERY
        mults.append(lr_mult(step))
        values = {**agent_lr_values(BASE * lr_mult(step) * scale * (1 + 0.05 * rng.random()), mults, scale),
                  "trainguard_lr_scale": scale, "trainguard_loss": loss(i),
                  "trainguard_grad_norm_max": 1.0 + 0.05 * rng.random(), "trainguard_grad_norm": 1.0}
        if snapshot_every is not None:
            values["trainguard_snapshot_step"] = float(step - step % snapshot_every)
        reports.append(Report(job="j", step_first=step - EVERY + 1, step_last=step, time=float(i), values=values))
        steps = simulate(RULES.base, reports, world_size=1, policy=policy, snapshot_keep=4)
    return steps


def test_corrected_scale_is_baseline_over_measured_clamped() -> None:
    assert corrected_scale(1.0, 40e-3, 1e-3) == pytest.approx(1 / 40)
    assert corrected_scale(0.5, 4e-3, 1e-3) == pytest.approx(0.125)  # measured at scale 0.5
    assert corrected_scale(1.0, 1e9, 1e-3) == LR_SCALE_MIN  # clamped to the protocol's floor
    assert corrected_scale(0.3, 0.5e-3, 1e-3) == 0.3  # at or below the baseline: never raised
    assert corrected_scale(1.0, math.nan, 1e-3) is None and corrected_scale(1.0, 1.0, None) is None
    assert baseline([1.0, math.nan, 3.0, 2.0, -1.0]) == 2.0


def test_ramp_climbs_geometrically_to_one_and_steps_back_where_it_degrades() -> None:
    ramp = LrRamp(ramp_steps=100, stable_reports=2, degrade_ratio=1.5, min_increase=0.1)
    assert ramp.observe(10, healthy=True, measured=1.0, base=1.0, scale=0.1) is None  # 1 healthy report
    assert ramp.observe(20, healthy=True, measured=1.0, base=1.0, scale=0.1) is None  # the ramp starts at step 20
    up = ramp.observe(30, healthy=True, measured=1.0, base=1.0, scale=0.1)
    assert up is not None and up.scale == pytest.approx(0.1 * 10 ** 0.1)  # (1/0.1)^(10/100): +26 %
    back = ramp.observe(40, healthy=True, measured=1.6, base=1.0, scale=up.scale)
    assert back is not None and back.scale == 0.1 and ramp.held
    assert ramp.observe(50, healthy=True, measured=1.0, base=1.0, scale=0.1) is None  # held there
    done = LrRamp(ramp_steps=100, stable_reports=1)
    done.observe(0, healthy=True, measured=1.0, base=1.0, scale=0.5)
    assert done.observe(5, healthy=True, measured=1.0, base=1.0, scale=0.5) is None  # +3.5 %: not worth a change
    assert done.observe(100, healthy=True, measured=1.0, base=1.0, scale=0.5).scale == 1.0  # reaches 1.0 exactly


@pytest.mark.parametrize("mult", [40, 200, 1000])
def test_persistent_lr_blowup_ends_at_a_scale_that_trains(mult: int) -> None:
    steps = _loop(lambda s: mult if s > 300 else 1.0, 70)
    first = next(s for s in steps if s.desired.lr_scale < 1.0)
    assert first.step_last == 310  # acted on at the first report after the onset
    # one report later the update ratio is back at its healthy level: scale = baseline / measured
    assert first.desired.lr_scale == pytest.approx(1.0 / mult, rel=0.1)
    assert "adaptive lr_scale" in first.desired.reason
    final = steps[-1].desired
    assert 1.0 / mult * 0.9 <= final.lr_scale <= 1.5 / mult  # the ramp stopped where it degraded
    assert not final.paused and final.rollback_seq == 0


@pytest.mark.parametrize("mult", [10.0, 200.0, 1000.0])
def test_transient_burst_ends_back_at_one(mult: float) -> None:
    # The user's schedule x mult for 30 steps: cut to 1/mult at once (one factor on the schedule);
    # once the schedule is back inside its envelope and the incident recovered, straight back to
    # 1.0 - not a climb over ramp_steps (with the 400 built-in steps a x1000 cut took ~400 steps).
    policy = RULES.file.recovery.model_copy(update={"ramp_steps": 200})
    steps = _loop(lambda s: mult if 300 < s <= 330 else 1.0, 80, policy=policy)
    assert min(s.desired.lr_scale for s in steps) == pytest.approx(1 / mult, rel=0.1)
    assert steps[-1].desired.lr_scale == 1.0
    back = next(s for s in steps if s.step_last > 330 and s.desired.lr_scale == 1.0)
    # the incident needs recover_reports healthy reports after the burst, then one change
    assert back.step_last - 330 <= (policy.recover_reports + 1) * EVERY
    assert [d.lr_scale for s in steps for d in s.recovery if "back to the schedule" in d.reason] == [1.0]


def test_nan_loss_rolls_back_to_the_newest_good_snapshot() -> None:
    steps = _loop(lambda s: 1.0, 30, loss=lambda i: math.nan if i == 24 else 2.0, snapshot_every=50)
    fired = steps[24]
    assert [f.finding.rule.name for f in fired.fired if f.desired is not None] == ["loss_nonfinite"]
    d = fired.desired
    # snapshots at 200 (reported from step 200) and 250 (reported at 250, confirmed by 2 healthy reports)
    assert d.rollback_seq == 1 and d.rollback_step == 200 and not d.paused
    assert "rollback to the snapshot of step 200" in d.reason


def test_rollback_without_a_good_snapshot_is_refused_and_pauses() -> None:
    steps = _loop(lambda s: 1.0, 10, loss=lambda i: math.nan if i == 8 else 2.0)
    d = steps[8].desired
    assert d.paused and d.rollback_seq == 0
    assert "rollback refused: the run reports no snapshot" in d.reason


def test_ladder_escalates_from_adaptive_lr_to_rollback_to_pause() -> None:
    # The update ratio stays high whatever the scale (the cause is not the LR): adaptive LR cannot
    # bring it back, so the ladder takes the rollback, then pauses for a human.
    reports: list[Report] = []
    steps = []
    for i in range(40):
        step = (i + 1) * EVERY
        ratio = BASE * (30.0 if step > 200 else 1.0)  # not scaled: the LR does not explain it
        scale = steps[-1].desired.lr_scale if steps else 1.0
        values = {**agent_lr_values(ratio, [1.0] * (i + 1), scale), "trainguard_lr_scale": scale,
                  "trainguard_loss": 2.0, "trainguard_grad_norm_max": 1.0, "trainguard_snapshot_step": float(step - step % 50)}
        reports.append(Report(job="j", step_first=step - 9, step_last=step, time=float(i), values=values))
        steps = simulate(RULES.base, reports, world_size=1, policy=RULES.file.recovery, snapshot_keep=4)
    changes = [(s.step_last, d) for s in steps for d in ([f.desired for f in s.fired if f.desired] + s.recovery)]
    kinds = []
    prev = DesiredState()
    for _, d in changes:
        if d.rollback_seq > prev.rollback_seq:
            kinds.append("rollback")
        elif d.paused and not prev.paused:
            kinds.append("pause")
        elif d.lr_scale < prev.lr_scale:
            kinds.append("adaptive_lr")
        prev = d
    assert kinds == ["adaptive_lr", "rollback", "pause"]
    at = {k: s for (s, _), k in zip(changes, kinds)}
    assert at["rollback"] - at["adaptive_lr"] == 3 * EVERY and at["pause"] - at["rollback"] == 3 * EVERY
    final = steps[-1].desired
    # The snapshot of step 200 was followed by no healthy report (the onset is at 201-210): not good.
    # That of 150 was followed by two (160, 170): the newest good one.
    assert final.paused and final.rollback_step == 150


def test_without_an_update_ratio_the_schedules_lr_jump_sets_the_scale() -> None:
    # The report after the onset has no update ratio (its step was skipped by the spike guard):
    # the LR the user's schedule set (x200) against its healthy level gives the scale.
    reports = []
    for i in range(30):
        step = (i + 1) * EVERY
        jumped = step > 200
        values = {"trainguard_loss": 2.0, "trainguard_grad_norm_max": 80.0 if jumped else 1.0,
                  "trainguard_scheduler_lr": 2e-3 * (200 if jumped else 1), "trainguard_lr_scale": 1.0}
        if not jumped:
            values["trainguard_update_ratio"] = BASE
        reports.append(Report(job="j", step_first=step - 9, step_last=step, time=float(i), values=values))
    steps = simulate(RULES.base, reports, world_size=1, policy=RULES.file.recovery)
    d = steps[20].desired
    assert d.lr_scale == pytest.approx(1 / 200) and "the schedule's LR" in d.reason


def test_the_ramp_climbs_back_to_the_operators_scale_never_above() -> None:
    # An operator runs at 0.5; a burst of 10x updates is cut by adaptive LR, and the ramp brings the
    # scale back to 0.5, not to 1.0. Without a burst the operator's 0.5 is left alone.
    policy = RULES.file.recovery.model_copy(update={"ramp_steps": 200})
    op = DesiredState(lr_scale=0.5)

    def run(mult):
        reports, steps, mults = [], [], []
        for i in range(80):
            scale = steps[-1].desired.lr_scale if steps else 0.5
            step = (i + 1) * EVERY
            mults.append(mult(step))
            values = {**agent_lr_values(BASE * mult(step) * scale, mults, scale), "trainguard_lr_scale": scale,
                      "trainguard_loss": 2.0, "trainguard_grad_norm_max": 1.0, "trainguard_grad_norm": 1.0}
            reports.append(Report(job="j", step_first=step - EVERY + 1, step_last=step, time=float(i), values=values))
            steps = simulate(RULES.base, reports, world_size=1, policy=policy, desired=op)
        return steps

    burst = run(lambda s: 10.0 if 300 < s <= 330 else 1.0)
    scales = [s.desired.lr_scale for s in burst]
    assert min(scales) == pytest.approx(0.05, rel=0.1)  # 0.5 / 10
    assert max(scales) == 0.5 and scales[-1] == 0.5
    assert all(s.desired.lr_scale == 0.5 for s in run(lambda s: 1.0))


def test_a_rung_gets_window_steps_when_the_run_reports_every_step() -> None:
    # Reporting every step, 3 unhealthy reports are 3 steps: too little for an LR change to show.
    # The next rung waits for window_steps (30) steps.
    policy = RULES.file.recovery
    reports, steps = [], []
    for step in range(1, 140):
        values = {**agent_lr_values(BASE * (30.0 if step > 60 else 1.0), [1.0] * step, 1.0), "trainguard_loss": 2.0,
                  "trainguard_lr_scale": 1.0, "trainguard_grad_norm_max": 1.0}
        reports.append(Report(job="j", step_first=step, step_last=step, time=float(step), values=values))
    steps = simulate(RULES.base, reports, world_size=1, policy=policy)
    rungs = [(s.step_last, d) for s in steps for d in s.recovery]
    assert rungs, "the ladder never escalated"
    adaptive = next(s.step_last for s in steps if s.desired.lr_scale < 1.0)
    assert rungs[0][0] - adaptive >= policy.window_steps


def test_a_long_incident_still_has_a_snapshot_from_before_its_onset() -> None:
    # Snapshots every 10 steps, 4 kept: the newest four would all postdate an incident that reaches
    # its rollback rung 40 steps after its onset. Spaced out, the oldest is 70-140 steps old: one
    # from before the onset, followed by healthy reports, is there for the rollback rung.
    reports: list[Report] = []
    steps = []
    for i in range(40):
        step = (i + 1) * EVERY
        scale = steps[-1].desired.lr_scale if steps else 1.0
        values = {**agent_lr_values(BASE * (30.0 if step > 200 else 1.0), [1.0] * (i + 1), scale), "trainguard_loss": 2.0,
                  "trainguard_lr_scale": scale, "trainguard_grad_norm_max": 1.0, "trainguard_snapshot_step": float(step)}
        reports.append(Report(job="j", step_first=step - 9, step_last=step, time=float(i), values=values))
        steps = simulate(RULES.base, reports, world_size=1, policy=RULES.file.recovery, snapshot_every=10, snapshot_keep=4)
    rollback = next(s.desired for s in steps if s.desired.rollback_seq > 0)
    assert not rollback.paused and rollback.rollback_step < 200  # before the onset (201-210)
    lasting = simulate(RULES.base, reports, world_size=1, policy=RULES.file.recovery, snapshot_keep=4)
    refused = next(s.desired for s in lasting if s.desired.paused)  # the newest four only: refused
    assert refused.rollback_seq == 0 and "rollback refused" in refused.reason


def test_the_controller_takes_an_operators_scale_as_the_ramps_ceiling(app_factory) -> None:
    # Through the real controller: an operator sets 0.5; a 10x update ratio is cut by adaptive LR;
    # the ramp (400 steps with the built-in rules) brings the scale back up to 0.5 and stops there.
    from tests.service.conftest import register

    now = [1_000.0]

    mults: list[float] = []

    def report(c, step: int, mult: float) -> float:
        scale = c.get("/v1/runs/run-1/desired").json()["lr_scale"]
        mults.append(mult)
        values = {**agent_lr_values(BASE * mult * scale, mults, scale), "trainguard_lr_scale": scale,
                  "trainguard_loss": 2.0, "trainguard_grad_norm_max": 1.0, "trainguard_grad_norm": 1.0}
        body = Report(job="job-a", step_first=step - EVERY + 1, step_last=step, time=now[0], values=values)
        assert c.post("/v1/runs/run-1/reports", content=body.model_dump_json()).status_code == 200
        now[0] += 1.0
        return scale

    with app_factory(clock=lambda: now[0]) as c:
        register(c, world_size=1)
        assert c.post("/v1/runs/run-1/lr-scale", json={"scale": 0.5, "reason": "operator"}).status_code == 200
        seen = [report(c, (i + 1) * EVERY, 10.0 if 300 < (i + 1) * EVERY <= 330 else 1.0)
                for i in range(90)]
        assert min(seen) == pytest.approx(0.05, rel=0.1)
        assert max(seen) == 0.5 and seen[-1] == 0.5


def test_an_undone_report_leaves_the_recovery_state_as_it_was() -> None:
    # A failed commit undoes the report (Transaction.on_rollback -> RunRecovery.restore): the
    # incidents (the open one too), the snapshots' health and the ramp are as before it.
    from trainguard.service.engine import decide, evaluate
    from trainguard.service.engine import AlertBook
    from trainguard.service.incidents import RunRecovery
    from trainguard.service.window import RunWindow

    rec = RunRecovery(RULES.file.recovery, snapshot_every=10, snapshot_keep=4)
    window = RunWindow(capacity=128, rank_capacity=8, world_size=1, created=0.0)
    book, desired = AlertBook(), DesiredState()
    mults = [1.0] * 20 + [30.0] * 20

    def feed(i: int, mult: float) -> None:
        nonlocal desired
        step = (i + 1) * EVERY
        values = {**agent_lr_values(BASE * mult * desired.lr_scale, mults[:i + 1], desired.lr_scale),
                  "trainguard_lr_scale": desired.lr_scale,
                  "trainguard_loss": 2.0, "trainguard_grad_norm_max": 1.0, "trainguard_snapshot_step": float(step)}
        report = Report(job="j", step_first=step - 9, step_last=step, time=float(i), values=values)
        window.append(report, report.time)
        rec.before_decide(values)
        findings = evaluate(RULES.base, window, report.time)
        out = decide(findings, book, desired, report.time, complete=True, ctx=rec)
        changes = rec.after_report(step=step, values=values, findings=findings, before=desired, desired=out.desired,
                                   fired=[(f.finding.rule.name, f.desired) for f in out.fired if f.desired], now=report.time)
        desired = changes[-1].desired if changes else out.desired

    def state() -> tuple:
        return ([i.as_dict() for i in rec.incidents], [(s.step, s.healthy_after, s.tainted) for s in rec.snapshots],
                rec.open.id if rec.open else None, list(rec.baselines.metric), vars(rec.ramp).copy())

    for i in range(21):
        feed(i, 30.0 if i >= 20 else 1.0)  # the last report opens an incident (adaptive LR)
    assert rec.open is not None
    undone_incident_changes = 0
    for j in range(21, 40):  # each report is undone once, then fed for good
        before, saved, book_before = state(), rec.save(), copy.deepcopy(book)
        window_saved, desired_before = window.save_next(ranks=False), desired
        feed(j, 30.0)
        assert state() != before  # (it did change something)
        undone_incident_changes += bool(rec.changed_incidents(saved))
        rec.restore(saved)
        window.rollback(window_saved)
        book, desired = book_before, desired_before
        assert state() == before
        feed(j, 30.0)
    assert undone_incident_changes >= 1  # a change of the open incident was among the undone ones


def test_a_new_policy_resizes_both_healthy_baselines() -> None:
    # 16 healthy reports (the default baseline_reports): 12 at LR 1e-3 and update ratio 1e-3, then
    # 4 at 4e-3. Shrunk to 4 reports, both baselines are the median of the newest 4: 4e-3.
    rec = RunRecovery(RULES.file.recovery)
    assert rec.policy.baseline_reports == 16
    state = DesiredState()
    for i, v in enumerate([1e-3] * 12 + [4e-3] * 4):
        values = {"trainguard_loss": 2.0, "trainguard_update_ratio": v, "trainguard_scheduler_lr": v, "trainguard_lr_scale": 1.0}
        rec.before_decide(values)
        assert rec.after_report(step=(i + 1) * EVERY, values=values, findings=[], before=state, desired=state,
                                fired=[], now=float(i)) == []
    rec.set_policy(RULES.file.recovery.model_copy(update={"baseline_reports": 4}))
    assert rec.baseline() == 4e-3
    assert baseline(rec.baselines.lr) == 4e-3 and rec.schedule.per_lr.maxlen == 4
    # a report with no update ratio: the schedule's LR against the highest it set while healthy
    rec.before_decide({"trainguard_loss": 2.0, "trainguard_scheduler_lr": 8e-3, "trainguard_lr_scale": 1.0})
    scale, note = rec.adaptive_scale(AdaptiveLrAction(), 1.0)
    assert scale == pytest.approx(4e-3 / 8e-3)
    assert note == "the schedule's LR 0.008 is 2x the highest it set while healthy (0.004)"


def test_a_high_update_per_lr_asks_for_a_cut_only_when_the_update_itself_is_large() -> None:
    """Healthy: update ratio 1e-3 at LR 1e-3 (per LR 1.0). A report whose update per LR is 3x
    that needs the scale cut to a third when its update is 3x too; when the update is 1/100 of the
    healthy one (a cut LR: Adam's normalised step grows as the steps shrink), no cut."""
    sb = ScheduleBaseline(reports=16, tolerance=1.5)
    for _ in range(16):
        sb.add_healthy({"trainguard_update_ratio": 1e-3, "trainguard_update_ratio_per_lr": 1.0,
                        "trainguard_scheduler_lr": 1e-3})
    large = {"trainguard_update_ratio": 3e-3, "trainguard_update_ratio_per_lr": 3.0, "trainguard_scheduler_lr": 1e-3}
    factor, note = sb.needed(large)
    assert factor == pytest.approx(1 / 3) and "update per unit of LR 3" in note and not sb.small_update(large)
    small = {"trainguard_update_ratio": 1e-5, "trainguard_update_ratio_per_lr": 3.0, "trainguard_scheduler_lr": 1e-3}
    assert sb.small_update(small) and sb.needed(small)[0] == 1.0
    assert sb.copy().small_update(small)  # the copy keeps the update baseline


def test_the_healthy_baselines_start_afresh_where_the_run_switched_optimizer() -> None:
    """Adam's update per unit of LR is ~30x SGD's: after a switch, judged by Adam's healthy levels,
    every SGD report would read as a run training at a fraction of its LR (``degraded``), and a
    later incident would climb the ladder to a pause. The levels start afresh at the switch
    (``trainguard_optimizer_class`` changed) and at a change the user marked; reports of one
    optimizer, or without the markers (an older agent), stay one run's."""
    from trainguard.service.recovery.baselines import HealthyBaselines

    def fill(b: HealthyBaselines, code: float | None, per_lr: float, lr: float, loss: float, n: int) -> None:
        values = {"trainguard_update_ratio_per_lr": per_lr, "trainguard_scheduler_lr": lr, "trainguard_loss": loss}
        if code is not None:
            values |= {"trainguard_optimizer_class": code, "trainguard_run_changes_total": 0.0}
        for _ in range(n):
            b.add(values, measured=per_lr * lr, lr=lr)

    switched = HealthyBaselines(reports=16, tolerance=1.5)
    fill(switched, 1.0, per_lr=3.0, lr=1e-3, loss=3.0, n=10)
    fill(switched, 2.0, per_lr=0.1, lr=0.1, loss=2.5, n=3)
    assert baseline(switched.schedule.per_lr) == 0.1 and baseline(switched.lr) == 0.1
    assert switched.baseline() == pytest.approx(0.01) and switched.median("trainguard_loss") == 2.5
    assert switched.lr_peak == 0.1

    for code in (1.0, None):  # one optimizer throughout, or no markers: every report counts
        kept = HealthyBaselines(reports=16, tolerance=1.5)
        fill(kept, code, per_lr=3.0, lr=1e-3, loss=3.0, n=10)
        fill(kept, code, per_lr=0.1, lr=0.1, loss=2.5, n=3)
        assert baseline(kept.schedule.per_lr) == 3.0 and kept.lr_peak == 0.1

    marked = HealthyBaselines(reports=16, tolerance=1.5)
    fill(marked, 1.0, per_lr=3.0, lr=1e-3, loss=3.0, n=10)
    marked.add({"trainguard_optimizer_class": 1.0, "trainguard_run_changes_total": 1.0, "trainguard_loss": 12.0},
               measured=3e-3, lr=1e-3)
    assert marked.median("trainguard_loss") == 12.0  # the loss of the new weight alone
    saved = marked.save()
    marked.add({"trainguard_optimizer_class": 2.0, "trainguard_loss": 1.0}, measured=1e-4, lr=0.1)
    marked.restore(saved)  # an undone report: the regime it had comes back with the levels
    assert marked.regime == (None, 1.0, 1.0) and marked.median("trainguard_loss") == 12.0

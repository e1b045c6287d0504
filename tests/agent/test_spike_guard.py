"""The spike guard: its threshold against a naive float64 reference, its bounded run of skips,
a new baseline when the model moved during a data skip or a skipped spike's gradient comes back
the same, and, on real training, no skip on healthy runs, a skipped step that changes nothing,
full-batch spikes skipped once each, and good data trained after a data skip."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from torch import nn

import trainer_agent as ta
from trainer_agent.control.spike_guard import SpikeGuard, SpikeGuardConfig


def _naive_threshold(norms: list[float], sigmas: float, ratio: float) -> float:
    xs = sorted(norms)
    n = len(xs)
    med = (xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2)
    dev = sorted(abs(x - med) for x in xs)
    mad = (dev[n // 2] if n % 2 else (dev[n // 2 - 1] + dev[n // 2]) / 2)
    return max(med + sigmas * 1.4826 * mad, ratio * med)


def test_threshold_matches_a_naive_median_and_mad_over_the_window() -> None:
    rng = random.Random(3)
    guard = SpikeGuard(SpikeGuardConfig(window=16, min_history=8))
    norms: list[float] = []
    for i in range(40):
        x = 1.0 + rng.random()
        if i < 7:
            assert guard.threshold() == math.inf  # not enough history yet
        guard.taken(x)
        norms.append(x)
        if len(norms) >= 8:
            assert guard.threshold() == pytest.approx(_naive_threshold(norms[-16:], 6.0, 5.0), rel=1e-12)


def test_skipped_norms_stay_out_of_the_baseline_and_skips_in_a_row_are_bounded() -> None:
    guard = SpikeGuard(SpikeGuardConfig(window=8, min_history=4, max_consecutive=3))
    for x in (1.0, 1.1, 0.9, 1.0, 1.05):
        guard.taken(x)
    before = guard.threshold()
    decisions = []
    for norm in (50.0, 51.0, 52.0, 53.0, 54.0):  # a spike of another gradient each step
        spike = guard.is_spike(norm)
        decisions.append(spike)
        if spike:
            guard.skipped()
        else:
            guard.taken(norm)
    assert decisions == [True, True, True, False, False]  # the 4th is taken: 3 in a row is the bound
    # ... and it starts a new baseline (a level shift): nothing is skipped until min_history steps
    assert guard.restarts == 1 and guard.state_dict()["norms"] == [53.0, 54.0]
    assert guard.threshold() != before
    guard.taken(float("nan"))  # a non-finite norm never joins it
    assert all(math.isfinite(x) for x in guard.state_dict()["norms"])


def test_a_skipped_spike_whose_gradient_comes_back_the_same_is_taken_and_starts_a_new_baseline() -> None:
    guard = SpikeGuard(SpikeGuardConfig(window=8, min_history=4, max_consecutive=5))
    for x in (1.0, 1.1, 0.9, 1.0, 1.05):
        guard.taken(x)
    assert guard.is_spike(50.0)
    guard.skipped()
    assert guard.is_spike(60.0)  # another gradient: still a spike, skipped
    guard.skipped()
    assert not guard.is_spike(60.0 * (1 + 1e-7))  # the same again, to rounding: skipping cannot help
    guard.taken(60.0 * (1 + 1e-7))
    assert guard.restarts == 1 and guard.state_dict()["norms"] == [60.0 * (1 + 1e-7)]
    # Only right after a skip: a spike equal to an earlier one after a step was taken is a spike.
    for x in (1.0, 1.1, 0.9, 1.0):
        guard.taken(x)
    assert guard.is_spike(300.0)
    guard.taken(1.0)  # (taken for another reason)
    assert guard.is_spike(300.0)


def test_a_spike_after_part_of_the_model_was_unfrozen_is_taken_and_starts_a_new_baseline() -> None:
    """The elements that train are read when a baseline starts and on a spike: a spike under
    other elements than the baseline's is the run's own change (a linear probe, then the whole
    model), taken, and a new baseline starts; a spike under the same elements is skipped."""
    trained = [100]
    reads = [0]

    def trainable() -> int:
        reads[0] += 1
        return trained[0]

    guard = SpikeGuard(SpikeGuardConfig(window=8, min_history=4), regime=trainable)
    for x in (0.5, 0.55, 0.45, 0.5, 0.52):
        guard.taken(x)
    assert reads[0] == 1  # once, when the baseline started: not per step
    assert guard.is_spike(40.0)  # the same elements: a spike
    guard.skipped()
    trained[0] = 10_000  # the body unfrozen
    assert not guard.is_spike(38.0)
    guard.taken(38.0)
    assert guard.restarts == 1 and guard.state_dict()["norms"] == [38.0]
    assert reads[0] == 4  # the two spikes judged, and the new baseline's start
    for x in (41.0, 29.0, 34.0, 36.0):
        guard.taken(x)
    assert guard.is_spike(900.0)  # under the new elements, a spike again
    trained[0] = 100  # frozen again: the next spike is taken and starts afresh
    assert not guard.is_spike(0.9 * 900.0)


def _guard_with_history() -> SpikeGuard:
    guard = SpikeGuard(SpikeGuardConfig(window=8, min_history=4))
    for x in (1.0, 1.1, 0.9, 1.0, 1.05):
        guard.taken(x)
    return guard


def test_the_first_spike_after_a_data_skip_is_taken_and_starts_a_new_baseline() -> None:
    guard = _guard_with_history()
    assert guard.is_spike(12.0)  # without a data skip before it: a spike
    for _ in range(3):
        guard.data_skipped()
    assert guard.consecutive == 0 and len(guard.state_dict()["norms"]) == 5  # the data skip is not the guard's
    assert not guard.is_spike(12.0)  # the model moved while the bad batches were trained: a new regime
    guard.taken(12.0)
    assert guard.restarts == 1 and guard.state_dict()["norms"] == [12.0]
    assert not guard.is_spike(13.0)  # nothing is skipped before min_history steps of the new regime


def test_an_ordinary_step_after_a_data_skip_keeps_the_baseline_and_the_guard() -> None:
    guard = _guard_with_history()
    guard.data_skipped()
    assert not guard.is_spike(1.02)
    guard.taken(1.02)
    assert guard.restarts == 0 and len(guard.state_dict()["norms"]) == 6
    assert guard.is_spike(12.0)  # only the first step after the data skip may start a new baseline


def test_the_state_after_a_data_skip_survives_a_round_trip_and_bad_states_are_refused() -> None:
    guard = _guard_with_history()
    guard.data_skipped()
    again = SpikeGuard(SpikeGuardConfig(window=8, min_history=4))
    again.load_state_dict(guard.state_dict())
    assert not again.is_spike(12.0)  # (restored: the first step after the data skip)
    older = {"norms": [1.0, 1.1, 0.9, 1.0], "consecutive": 0}  # a snapshot from before the field
    again.load_state_dict(older)
    assert again.is_spike(12.0)
    for bad in ({"norms": [1.0], "consecutive": 0, "after_data_skip": "yes"}, [1.0], {"norms": None, "consecutive": 0}):
        with pytest.raises(ValueError):
            again.load_state_dict(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [{"window": 2}, {"min_history": 200}, {"sigmas": 0.5}, {"min_ratio": math.inf},
                                 {"max_consecutive": 0}, {"min_jump": 0.5}, {"min_jump": math.nan}, {"recurring": -1},
                                 {"recurring": 1.5}, {"recurring": True}])
def test_bad_thresholds_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        SpikeGuardConfig(**bad)


def test_skip_spikes_defaults_to_on_exactly_with_a_controller() -> None:
    assert ta.AgentConfig(controller=None).spike_guard_on is False
    assert ta.AgentConfig(controller="http://127.0.0.1:1").spike_guard_on is True
    assert ta.AgentConfig(controller="http://127.0.0.1:1", skip_spikes=False).spike_guard_on is False
    assert ta.AgentConfig(controller=None, skip_spikes=True).skips_steps is True
    with pytest.raises(ValueError):
        ta.AgentConfig(skip_spikes="yes")


def _train(seed: int, steps: int, *, spike_at: int | None = None, registry=None, **config):
    """A small regression MLP trained with AdamW; at ``spike_at`` the batch is scaled x1000 (a
    poisoned batch). Returns the agent and a record of the state around the spike step."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    agent = ta.attach(model, opt, job="spike", run=f"spike-{seed}", registry=registry,
                      config=ta.AgentConfig(metrics_port=None, report_every=10, skip_spikes=True, controller=None,
                                            **config))
    g = torch.Generator().manual_seed(seed + 100)
    w_true = torch.randn(16, 1, generator=g)
    seen = {}
    for step in range(1, steps + 1):
        x = torch.randn(64, 16, generator=g)
        y = x @ w_true + 0.1 * torch.randn(64, 1, generator=g)
        if step == spike_at:
            x = x * 1000.0
            seen["params"] = [p.detach().clone() for p in model.parameters()]
            seen["state"] = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        if step == spike_at:
            seen["params_after"] = [p.detach().clone() for p in model.parameters()]
            seen["state_after"] = {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()}
    return agent, seen


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_never_skips_on_healthy_runs(seed: int) -> None:
    agent, _ = _train(seed, 300)
    try:
        assert agent.control.skip.skipped_by_reason == {"spike": 0, "nonfinite": 0, "data": 0}
    finally:
        agent.close()


def test_a_poisoned_batch_is_skipped_and_changes_nothing() -> None:
    agent, seen = _train(0, 120, spike_at=100)
    try:
        assert agent.control.skip.skipped_by_reason == {"spike": 1, "nonfinite": 0, "data": 0}
        for a, b in zip(seen["params"], seen["params_after"]):
            assert torch.equal(a, b)
        for k, v in seen["state"].items():
            for n, t in v.items():
                assert torch.equal(t, seen["state_after"][k][n]), (k, n)
        latest = agent.latest()
        assert latest['trainguard_skipped_steps_total{reason="spike"}'] == 1.0
        assert latest['trainguard_skipped_steps_total{reason="nonfinite"}'] == 0.0
        assert latest["trainguard_consecutive_skipped_steps"] == 0.0  # steps were taken since
    finally:
        agent.close()


@pytest.mark.parametrize("climbs", [True, False], ids=["climbs-taken", "climbs-judged"])
def test_full_batch_spikes_are_skipped_once_each(climbs: bool) -> None:
    """Full-batch training (the same 2,048 samples every step) with Adam at a plateau: Adam's
    oscillation raises the gradient norm 5-8x over a near-zero baseline from about step 590,
    1.3x per step (0.0019 to 0.0086 in 8 steps). That is a climb: the guard takes it
    (``climbs-taken``, the defaults). Judged against the median alone (``min_jump`` 1), it is a
    spike; a skipped step leaves the weights as they were, so the next step computes the same
    gradient: the guard takes it, instead of skipping the same gradient 16 times in a row. Each
    skip is followed by a step whose loss is the skipped step's, exactly (nothing changed in
    between)."""
    torch.manual_seed(0)
    x = torch.randn(2048, 16)
    y = torch.tanh(x @ torch.randn(16, 1)) + 0.05 * torch.randn(2048, 1)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    agent = ta.attach(model, opt, job="spike", run="full-batch",
                      config=ta.AgentConfig(metrics_port=None, report_every=10, skip_spikes=True, controller=None))
    if not climbs:
        agent.control.skip.guard.config = dataclasses.replace(agent.control.skip.guard.config, min_jump=1.0)
    try:
        losses, skipped = [], []
        for step in range(1, 701):
            before = agent.control.skip.skipped_by_reason["spike"]
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(loss)
            losses.append(float(loss))
            if agent.control.skip.skipped_by_reason["spike"] > before:
                skipped.append(step)
        if climbs:
            assert skipped == [] and agent.control.skip.guard.restarts == 0
            return
        assert skipped, "no spike: the test needs one"
        assert all(b - a > 1 for a, b in zip(skipped, skipped[1:])), skipped  # never two in a row
        for step in skipped:
            assert losses[step] == losses[step - 1]  # the step after the skip: the same weights and batch
        assert agent.control.skip.guard.restarts == len(skipped)
    finally:
        agent.close()


def test_no_snapshot_is_taken_for_an_interval_with_a_skipped_step() -> None:
    # Snapshots every 10 steps, 4 kept; the poisoned step 100 is skipped, so the snapshot due at
    # 100 is not taken (that interval's state is suspect) and the older ones stay.
    agent, _ = _train(0, 130, spike_at=100, snapshot_every=10, snapshot_keep=4)
    try:
        assert agent.control.skip.skipped_by_reason["spike"] == 1
        held = [s.step for s in agent.snapshots.snapshots]
        assert held == [80, 110, 120, 130] and agent.snapshots.withheld == 1  # 100 was never taken
        # spaced out as the protocol's rule says, given the steps taken
        from trainguard.protocol.retention import retained
        kept: list[int] = []
        for step in [s for s in range(10, 131, 10) if s != 100]:
            kept = retained(kept + [step], every=10, keep=4)
        assert held == kept
    finally:
        agent.close()


def test_good_data_after_a_data_skip_is_trained_when_the_bad_batches_had_moved_the_model() -> None:
    """The controller's data skip covers steps 203-214. At step 203 the weights are pushed away,
    as a few bad batches trained before the skip reached the ranks would. Good data then gives
    gradients ~10x the window's median: the guard takes them as a new regime instead of skipping
    good data, and the loss comes back down."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    agent = ta.attach(model, opt, job="spike", run="spike-data", config=ta.AgentConfig(
        metrics_port=None, report_every=10, skip_spikes=True, controller=None))
    step_now = {"step": 0}
    agent.control.skip.data_skip = lambda: 203 <= step_now["step"] < 215  # as the agreed state says
    g = torch.Generator().manual_seed(100)
    w_true = torch.randn(16, 1, generator=g)
    losses, norms = {}, {}
    try:
        for step in range(1, 301):
            step_now["step"] = step
            x = torch.randn(64, 16, generator=g)
            y = x @ w_true + 0.1 * torch.randn(64, 1, generator=g)
            if step == 203:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.5 * torch.randn(p.shape, generator=g))
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            norms[step] = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
            opt.step()
            opt.zero_grad()
            agent.end_step(loss)
            losses[step] = float(loss.detach())
        before = sorted(norms[s] for s in range(80, 203))[61]  # the healthy median, computed here
        assert norms[215] > 5 * before  # the first step after the skip would be a spike by the old window
        skip, guard = agent.control.skip, agent.control.skip.guard
        assert skip.skipped_by_reason == {"spike": 0, "nonfinite": 0, "data": 12}
        assert guard is not None and guard.restarts == 1
        late = sum(losses[s] for s in range(281, 301)) / 20
        assert late < 0.25 * sum(losses[s] for s in range(215, 225)) / 10  # trained back down
    finally:
        agent.close()


def test_a_failing_read_of_the_trained_elements_never_reaches_the_training_step(monkeypatch) -> None:
    """The guard reads the elements that train when a baseline starts, inside the optimizer step:
    an error there is counted and the step is taken, as the report step's own read is."""
    from trainer_agent.measure.params import ParamIndex

    def broken(self) -> int:
        raise RuntimeError("boom")

    monkeypatch.setattr(ParamIndex, "trainable_elements", broken)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="guard", run="guard-err",
                      config=ta.AgentConfig(metrics_port=None, report_every=5, skip_spikes=True))
    before = model.weight.detach().clone()
    for _ in range(10):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(0.0)
    latest = agent.latest()
    agent.close()
    assert agent.step == 10 and not torch.equal(model.weight, before)  # every step trained
    assert latest["trainguard_agent_errors_total"] > 0


def _judge(guard: SpikeGuard, norm: float) -> bool:
    """One step through the guard as the agent runs it: judged, then taken or skipped."""
    spike = guard.is_spike(norm)
    if spike:
        guard.skipped()
    else:
        guard.taken(norm)
    return spike


def test_a_norm_that_climbs_step_by_step_is_taken_however_far_it_goes() -> None:
    """A diffusion model's first steps: the norm rises 1.4x per step, 40x in all, against a
    baseline that stays behind; never 2x the last 3 steps taken, so never a spike. A batch that
    jumps 2.5x above the climb is."""
    guard = SpikeGuard(SpikeGuardConfig(window=32, min_history=8))
    for _ in range(10):
        assert not _judge(guard, 0.1)
    norm = 0.1
    for _ in range(11):
        norm *= 1.4
        assert norm > guard.threshold() or norm < 0.5  # above the median's threshold once past 0.5
        assert not _judge(guard, norm)
    assert norm > 30 * 0.1 and guard.restarts == 0
    assert _judge(guard, 2.5 * norm)  # a jump: a spike


def test_a_level_the_run_keeps_visiting_is_taken_and_a_poisoned_one_is_skipped() -> None:
    """A second task every 5th step at 6x the first task's norm, trained from the start: taken
    (its steps were taken before the guard armed: the level is in the window). With ``recurring``
    0: skipped every time. Levels the guard skipped never count: a gradient poisoned 50x every 8th
    step after the guard armed, a corrupted batch every 5th or every 30th, are skipped every time.
    A second task that starts after the guard armed is such a level too, until the run marks the
    change (``regime``: ``Agent.run_changed``): its first step is then taken and starts a new
    baseline, and the task is trained from then on."""
    rng = random.Random(0)

    def task_a() -> float:
        return 1.0 + 0.1 * rng.random()

    for recurring in (3, 0):
        guard = SpikeGuard(SpikeGuardConfig(window=32, min_history=16, recurring=recurring))
        skipped = [step for step in range(200) if _judge(guard, 6.0 if step % 5 == 4 else task_a())]
        assert skipped == ([] if recurring else list(range(19, 200, 5))), skipped
    for period, norm in ((8, 50.0), (5, 20.0), (30, 20.0)):
        faulty = SpikeGuard(SpikeGuardConfig(window=32, min_history=16))
        skipped = [step for step in range(300) if _judge(faulty, norm if step >= 40 and step % period == 0 else task_a())]
        assert skipped == [s for s in range(40, 300) if s % period == 0], (period, skipped)
    marks = [0]
    late = SpikeGuard(SpikeGuardConfig(window=32, min_history=16), regime=lambda: marks[0])
    skipped = []
    for step in range(300):
        if step == 150:
            marks[0] += 1  # agent.run_changed(): the second task starts
        if _judge(late, 6.0 if step >= 100 and step % 5 == 4 else task_a()):
            skipped.append(step)
    assert skipped == list(range(104, 150, 5)), skipped  # unmarked: skipped; marked at 150: trained
    assert late.restarts == 1


def test_the_recurring_level_survives_a_round_trip() -> None:
    guard = SpikeGuard(SpikeGuardConfig(window=32, min_history=16))
    for step in range(60):
        _judge(guard, 6.0 if step % 5 == 4 else 1.0 + 0.01 * (step % 3))
    again = SpikeGuard(SpikeGuardConfig(window=32, min_history=16))
    again.load_state_dict(guard.state_dict())
    assert again.state_dict() == guard.state_dict() and guard.state_dict()["norms"].count(6.0) >= 3
    assert not again.is_spike(6.0)  # 3 visits in the restored window
    assert again.is_spike(30.0)  # another level: a spike


def test_a_climb_while_the_schedule_jumped_is_judged_against_the_median() -> None:
    """The same climb as above, while the LR the schedule asks for is above every LR the run
    trained at (``lr_jumped``): a spike once above the threshold, skipped until the controller
    cuts the LR. Read on a climbing norm above the threshold only."""
    reads = [0]

    def jumped() -> bool:
        reads[0] += 1
        return True

    guard = SpikeGuard(SpikeGuardConfig(window=32, min_history=8), lr_jumped=jumped)
    for _ in range(10):
        assert not _judge(guard, 0.1)
    assert reads[0] == 0
    decisions = [_judge(guard, 0.1 * 1.4 ** k) for k in range(1, 8)]
    assert decisions == [0.1 * 1.4 ** k > guard.threshold() for k in range(1, 8)] and decisions[-1]
    assert 1 <= reads[0] <= sum(decisions)  # (a norm 2x above the last steps taken is a jump: no read)

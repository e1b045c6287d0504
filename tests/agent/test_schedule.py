"""ReportSchedule: the one place that decides report and agreement steps; ScheduledLr: what the
user's LR schedule asked for at each step."""

from __future__ import annotations

import math

import pytest
import torch

from trainer_agent.measure.schedule import ReportSchedule, ScheduledLr


def test_report_steps_are_the_first_step_and_the_multiples_of_report_every() -> None:
    s = ReportSchedule(report_every=4, sync_every=3)
    assert [k for k in range(1, 13) if s.is_report(k)] == [1, 4, 8, 12]
    assert [k for k in range(1, 101) if ReportSchedule(report_every=50).is_report(k)] == [1, 50, 100]


def test_agreement_steps_are_report_steps_and_multiples_of_sync_every() -> None:
    s = ReportSchedule(report_every=4, sync_every=3)
    assert [k for k in range(1, 13) if s.agrees(k)] == [1, 3, 4, 6, 8, 9, 12]
    assert all(ReportSchedule(report_every=1).is_report(k) for k in range(1, 5))


def _opt(lrs: list[float]) -> torch.optim.Optimizer:
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in lrs]
    return torch.optim.SGD([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)])


def test_scheduled_lr_reports_last_interval_max_and_the_envelope_before_the_interval() -> None:
    s = ScheduledLr(min_steps=2)
    opt = _opt([1e-3, 2e-3])
    for lr in (1e-3, 2e-3):  # two steps: the largest group's LR each time
        opt.param_groups[1]["lr"] = lr
        s.observe(opt)
    assert s.take() == {"trainguard_scheduler_lr": 2e-3, "trainguard_scheduler_lr_max": 2e-3}  # no envelope yet
    for lr in (5e-2, 1e-3):  # a jump inside the interval, then back: the max keeps it
        opt.param_groups[1]["lr"] = lr
        s.observe(opt)
    assert s.take() == {"trainguard_scheduler_lr": 1e-3, "trainguard_scheduler_lr_max": 5e-2,
                        "trainguard_scheduler_lr_peak": 2e-3, "trainguard_scheduler_lr_ratio": pytest.approx(25.0)}
    assert s.take() == {"trainguard_scheduler_lr": 1e-3}  # no step taken since: no max, no ratio
    restored = ScheduledLr(min_steps=2)
    restored.load_state_dict(s.state_dict())
    restored.observe(_opt([5e-2]))  # a restart back to the peak after a resume
    assert restored.take()["trainguard_scheduler_lr_ratio"] == 1.0
    with pytest.raises(ValueError, match="malformed scheduled-LR state"):
        restored.load_state_dict({"peak": -1.0, "steps": 3})
    with pytest.raises(ValueError, match="malformed scheduled-LR state"):
        restored.load_state_dict({"steps": 3})


def test_the_envelope_holds_the_lr_the_schedule_was_built_on() -> None:
    # torchvision's recipe: a linear warm-up from 1 % of the LR, stepped once per epoch. At the first
    # epoch boundary the LR rises 20.8x, to 21 % of the LR the schedule rises to (initial_lr).
    opt = _opt([0.1])
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=5)
    s = ScheduledLr(min_steps=2)
    for _ in range(3):  # epoch 0: three steps at 0.001
        s.observe(opt)
    assert s.take(opt)["trainguard_scheduler_lr"] == pytest.approx(1e-3)
    sched.step()
    s.observe(opt)
    values = s.take(opt)
    assert values["trainguard_scheduler_lr_max"] == pytest.approx(0.1 * (0.01 + 0.99 / 5))
    assert values["trainguard_scheduler_lr_peak"] == 0.1  # initial_lr, above every LR set so far
    assert values["trainguard_scheduler_lr_ratio"] == pytest.approx(0.01 + 0.99 / 5)
    # a jump beyond the LR it was built on is a jump: 100x the base gives a ratio of 100
    opt.param_groups[0]["lr"] = 10.0
    s.observe(opt)
    assert s.take(opt)["trainguard_scheduler_lr_ratio"] == pytest.approx(100.0)
    # without a scheduler (no initial_lr), or an initial_lr on the device, the envelope is what was set
    plain = ScheduledLr(min_steps=1)
    opt = _opt([1e-3])
    opt.param_groups[0]["initial_lr"] = torch.tensor(0.5, device="meta")
    plain.observe(opt)
    plain.take(opt)
    opt.param_groups[0]["lr"] = 2e-2
    plain.observe(opt)
    assert plain.take(opt)["trainguard_scheduler_lr_ratio"] == pytest.approx(20.0)


def test_a_step_above_the_envelope_is_a_jump_until_a_report_takes_it_in() -> None:
    """``above_envelope``, what the spike guard reads on a climbing gradient norm: a warm-up below
    the LR the schedule was built on is not a jump, nor 3.9x it; 10x is, on every step of its interval,
    until the report after it makes it part of the envelope; nothing before ``min_steps`` steps."""
    opt = _opt([0.1])
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=5)
    s = ScheduledLr(min_steps=2)
    s.observe(opt)
    assert not s.above_envelope(opt)  # no envelope yet
    for _ in range(4):
        sched.step()
        s.observe(opt)
        assert not s.above_envelope(opt)  # the warm-up climbs 20x, towards initial_lr
        s.take(opt)
    opt.param_groups[0]["lr"] = 0.1 * 3.9
    s.observe(opt)
    assert not s.above_envelope(opt)  # no more than the built-in rule's 4x: a climb the plan may make
    opt.param_groups[0]["lr"] = 1.0
    for _ in range(3):
        s.observe(opt)
        assert s.above_envelope(opt)
    s.take(opt)
    s.observe(opt)
    assert not s.above_envelope(opt)  # the report took it in: the run has trained at it since
    # An LR of 0 for the first steps, without a scheduler: no envelope (take() reports no ratio either)
    zero = ScheduledLr(min_steps=2)
    opt = _opt([0.0])
    for _ in range(3):
        zero.observe(opt)
    zero.take(opt)
    opt.param_groups[0]["lr"] = 1e-3
    zero.observe(opt)
    assert not zero.above_envelope(opt) and "trainguard_scheduler_lr_ratio" not in zero.take(opt)


def test_the_agent_reports_the_lr_the_schedule_set_before_lr_scale() -> None:
    # The agent's report of each step: the scheduled LR of that step (not the next one, which the
    # scheduler has set by end_step), unchanged by lr_scale, and the update per unit of applied LR.
    import trainer_agent as ta
    from trainguard.protocol.commands import DesiredState

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 + k)
    agent = ta.attach(model, opt, job="j", run="r", lr_scheduler=sched,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_nonfinite=True))
    agent.control._set(DesiredState(generation=1, lr_scale=0.5), 0)  # as a desired state from the controller would set it
    seen = []
    for k in range(10):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        agent.end_step(1.0)
        seen.append(agent.latest())
    agent.close(1.0)
    assert [v["trainguard_scheduler_lr"] for v in seen] == pytest.approx([1e-3 * (1 + k) for k in range(10)])
    v = seen[-1]
    assert v["trainguard_update_ratio_per_lr"] == pytest.approx(v["trainguard_update_ratio"] / (0.5 * 1e-2))
    assert v["trainguard_scheduler_lr_peak"] == pytest.approx(9e-3)
    assert v["trainguard_scheduler_lr_ratio"] == pytest.approx(10 / 9)
    assert agent.state_dict()["scheduled_lr"] == {"peak": pytest.approx(1e-2), "steps": 10,
                                                  "optimizer": "torch.optim.adamw.AdamW"}


def test_a_step_the_agent_skips_still_reports_what_the_schedule_asked_for() -> None:
    import trainer_agent as ta

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 + k)
    agent = ta.attach(model, opt, job="j", run="r", lr_scheduler=sched,
                      config=ta.AgentConfig(metrics_port=None, report_every=1, skip_nonfinite=True))
    seen = []
    for k in range(4):
        loss = model(torch.randn(2, 4)).sum() * (math.nan if k == 3 else 1.0)
        loss.backward()
        opt.step()  # the NaN gradients of step 4: not taken
        opt.zero_grad()
        sched.step()
        agent.end_step(1.0)
        seen.append(agent.latest())
    agent.close(1.0)
    assert agent.control.skip.skipped == 1
    assert [v["trainguard_scheduler_lr"] for v in seen] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3])
    assert agent.state_dict()["scheduled_lr"]["steps"] == 4  # each step counted once


@pytest.mark.parametrize("switch", [False, True], ids=["same-optimizer", "adamw-to-sgd"])
def test_the_envelope_carries_over_a_resume_only_to_an_optimizer_of_the_same_class(switch: bool, caplog) -> None:
    """The agent's state loaded into an agent attached to a new optimizer: the step count carries
    over either way; the LR envelope only where the optimizer is of the same class. SGD trains at
    a hundred times AdamW's LR: measured against AdamW's envelope, its first step would read as an
    LR jump of 100x (the ``scheduler_lr_jump`` rule's limit is 4x)."""
    import trainer_agent as ta

    def run(opt, steps, state=None):
        agent = ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=None, report_every=1))
        if state is not None:
            agent.load_state_dict(state)
        seen = []
        for _ in range(steps):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(1.0)
            seen.append(agent.latest())
        agent.close(1.0)
        return seen, agent.state_dict()

    model = torch.nn.Linear(4, 4)
    first, state = run(torch.optim.AdamW(model.parameters(), lr=1e-3), 10)
    second_opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if switch
                  else torch.optim.AdamW(model.parameters(), lr=1e-3))
    with caplog.at_level("INFO", logger="trainer_agent.agent"):
        second, _ = run(second_opt, 10, state)
    assert [v["trainguard_step"] for v in second] == list(range(11, 21))
    broken = ta.attach(model, second_opt, job="j", run="r2", config=ta.AgentConfig(metrics_port=None))
    with pytest.raises(ValueError, match="malformed scheduled-LR state: list"):
        broken.load_state_dict(dict(state, scheduled_lr=[1e-3, 10]))
    broken.close(1.0)
    codes = {first[-1]["trainguard_optimizer_class"], second[0]["trainguard_optimizer_class"]}
    if switch:
        assert max(v.get("trainguard_scheduler_lr_ratio", 1.0) for v in second) == pytest.approx(1.0)
        assert "trainguard_scheduler_lr_peak" not in second[0]  # afresh: none for the first 8 steps
        assert second[-1]["trainguard_scheduler_lr_peak"] == pytest.approx(0.1)
        assert len(codes) == 2 and "the learning-rate envelope starts afresh" in caplog.text
    else:
        assert len(codes) == 1 and "starts afresh" not in caplog.text
        assert second[0]["trainguard_scheduler_lr_peak"] == pytest.approx(1e-3)


def test_marking_run_changes_often_is_warned_about_once(caplog) -> None:
    """``run_changed()`` counts each mark (``trainguard_run_changes_total``); marks fewer than 16
    reports apart are warned about, once: each starts the spike rules' baselines afresh."""
    import trainer_agent as ta

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=None, report_every=2))

    def steps(n: int) -> None:
        for _ in range(n):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(1.0)

    with caplog.at_level("WARNING", logger="trainer_agent.agent"):
        agent.run_changed()
        steps(32)  # 16 reports later: no warning
        agent.run_changed()
        assert "run_changed()" not in caplog.text
        steps(4)
        agent.run_changed()
        steps(4)
        agent.run_changed()
        steps(2)
    assert caplog.text.count("run_changed() at step") == 1
    assert "4 steps after the last" in caplog.text
    assert agent.latest()["trainguard_run_changes_total"] == 4.0
    assert agent.state_dict()["run_changes_total"] == 4
    agent.close(1.0)


def test_the_jump_the_guard_reads_is_the_built_in_rules() -> None:
    from trainer_agent.measure.schedule import LR_JUMP
    from trainguard.service.rules import default_rules_text, load_rules

    (rule,) = [r for r in load_rules(default_rules_text()).base if r.name == "scheduler_lr_jump"]
    assert (rule.metric, rule.op, rule.value) == ("trainguard_scheduler_lr_ratio", ">", LR_JUMP)


def test_an_optimizer_that_sizes_its_own_steps_reports_no_scheduled_lr_and_keeps_its_updates(caplog) -> None:
    # Hugging Face's Adafactor with relative_step=True keeps lr=None in its groups and computes its
    # step size itself: the agent reads no scheduled LR from it (no error per step), and an LR
    # command leaves its updates as they are, said once, instead of failing in every step.
    transformers = pytest.importorskip("transformers")
    import trainer_agent as ta
    from trainguard.protocol.commands import DesiredState

    def trained(attached: bool) -> tuple[list[torch.Tensor], object]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = transformers.optimization.Adafactor(model.parameters(), lr=None, relative_step=True,
                                                  scale_parameter=True, warmup_init=False)
        agent = ta.attach(model, opt, job="j", run="r", config=ta.AgentConfig(metrics_port=None, report_every=1, skip_nonfinite=True)) \
            if attached else None
        if agent is not None:
            agent.control._set(DesiredState(generation=1, lr_scale=0.5), 0)
        for _ in range(6):
            x = torch.randn(4, 8)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if agent is not None:
                agent.end_step(loss)
        return [p.detach().clone() for p in model.parameters()], agent

    reference, _ = trained(False)
    with caplog.at_level("WARNING"):
        params, agent = trained(True)
    latest, errors = agent.latest(), agent.errors.count
    agent.close(1.0)
    assert errors == 0
    assert "trainguard_scheduler_lr" not in latest
    for p, q in zip(params, reference):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert sum("param group whose LR is None" in r.getMessage() for r in caplog.records) == 1

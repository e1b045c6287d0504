"""The close of a step (trainer_agent/agent_parts/step_end.py): a loop that calls ``end_step`` per
micro-batch instead of once per optimizer step is told so, once; a loop that skips a rare step of
its own, or accumulates and calls ``end_step`` after the optimizer step, is not."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
from prometheus_client import generate_latest

import trainer_agent as ta

ACCUMULATION = 4


def _warnings(caplog: pytest.LogCaptureFixture, mode: str, steps: int = 60) -> tuple[list[str], int]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run=f"r-{mode}", config=ta.AgentConfig(metrics_port=None, report_every=10))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer_agent.agent"):
        for k in range(steps):
            for m in range(ACCUMULATION):
                loss = model(torch.randn(2, 4)).square().mean() / ACCUMULATION
                loss.backward()
                if mode == "per_micro_batch" and m < ACCUMULATION - 1:
                    agent.end_step(loss.detach())
            if mode == "own_skips" and k % 10 == 9:
                opt.zero_grad()  # the loop's own skip of a step (e.g. a non-finite loss it guards against)
            else:
                opt.step()
                opt.zero_grad()
            agent.end_step(loss.detach())
    step = agent.step
    agent.close()
    return [r.getMessage() for r in caplog.records if "end_step calls" in r.getMessage()], step


def test_end_step_per_micro_batch_is_told_once(caplog: pytest.LogCaptureFixture) -> None:
    found, step = _warnings(caplog, "per_micro_batch")
    assert step == 60 * ACCUMULATION  # what the agent counted: one step per call
    (warning,) = found
    assert warning.startswith("trainguard: 24 of the first 32 end_step calls closed a step in which optimizer.step() "
                              "did not run")  # 3 in every 4 calls
    assert "once per optimizer step" in warning


@pytest.mark.parametrize("mode", ["once_per_optimizer_step", "own_skips"])
def test_a_loop_calling_end_step_per_optimizer_step_is_not_warned(caplog: pytest.LogCaptureFixture, mode: str) -> None:
    found, step = _warnings(caplog, mode)
    assert step == 60 and found == []


def _closed_agent(run: str) -> tuple[ta.Agent, torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run=run, config=ta.AgentConfig(metrics_port=None, report_every=2))
    for _ in range(3):
        model(torch.randn(2, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(1.0)
    agent.close()
    return agent, model, opt


def test_end_step_after_close_is_warned_once_and_does_nothing() -> None:
    agent, model, opt = _closed_agent("r-closed")
    reported = agent.latest()["trainguard_step"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning recorded: the agent itself gives just one
        for _ in range(5):  # a loop that goes on after a framework callback closed the agent
            model(torch.randn(2, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(torch.tensor(2.0))
        _, other_model, other_opt = _closed_agent("r-closed-2")
        other = ta.attach(other_model, other_opt, job="j", run="r-closed-3",
                          config=ta.AgentConfig(metrics_port=None))
        other.close()
        other.end_step(1.0)  # another agent: warned of its own
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2
    assert messages[0].startswith("trainguard: end_step of run 'r-closed' after the agent was closed")
    assert messages[1].startswith("trainguard: end_step of run 'r-closed-3' after the agent was closed")
    assert caught[0].filename == __file__  # it points at the loop's end_step call
    assert agent.step == 3  # the 3 steps before close
    assert agent.latest()["trainguard_step"] == reported == 2.0  # no report built after close
    assert agent.errors.count == 0


def test_a_step_without_a_loss_counts_and_invents_no_loss() -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run="r-no-loss", config=ta.AgentConfig(metrics_port=None, report_every=2))
    reports = []
    for loss in (None, None, 3.0, None, None, None):
        if loss is not None:
            model(torch.randn(2, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        reports.append(dict(agent.latest()))
    agent.close()
    assert agent.step == 6
    assert reports[1]["trainguard_step"] == 2.0 and "trainguard_loss" not in reports[1]  # no step had a loss yet
    assert reports[3]["trainguard_step"] == 4.0 and reports[3]["trainguard_loss"] == 3.0  # its interval's last loss
    assert reports[5]["trainguard_step"] == 6.0 and "trainguard_loss" not in reports[5]  # no step of its interval had one
    assert reports[5]["trainguard_nonfinite_steps_total"] == 0.0 and agent.errors.count == 0


def _loop(plan: list[str], run: str, *, controller: str | None = None, report_every: int = 2) -> list[dict]:
    """Two layers, SGD; per step of ``plan``: ``loss`` (a backward and a step), ``nan`` (a NaN loss whose
    step the loop skips; ``nanstep``: the optimizer steps on its gradients), ``zero`` (a loss times 0:
    every gradient exactly 0, and a step), ``none`` (an optimizer step without a loss or any gradient, end_step(None)),
    ``idle`` (end_step(None) alone). Returns per step the latest values, the loss rank vector and the
    gradient norm the step had (NaN without one)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run=run, controller=controller,
                      config=ta.AgentConfig(metrics_port=None, report_every=report_every))
    out = []
    for what in plan:
        loss, norm = None, math.nan
        if what in ("loss", "nan", "nanstep", "zero"):
            loss = model(torch.randn(2, 4)).square().mean() * {"loss": 1.0, "zero": 0.0}.get(what, math.nan)
            loss.backward()
            norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))
        if what in ("loss", "none", "nanstep", "zero"):
            opt.step()
        opt.zero_grad()
        agent.end_step(None if loss is None else loss.detach())
        out.append({"values": dict(agent.latest()), "ranks": dict(agent.rank_values), "norm": norm,
                    "metrics": generate_latest(agent.registry).decode()})
    assert agent.errors.count == 0
    agent.close()
    return out


def test_a_nonfinite_loss_is_in_one_report_only() -> None:
    # step 3: a NaN loss (the loop skips its step); 4-8: optimizer steps without a loss; 9-10: losses again
    steps = _loop(["loss", "loss", "nan", "none", "none", "none", "idle", "none", "loss", "loss"], "r-nan-once")
    reports = [s for i, s in enumerate(steps) if s["values"].get("trainguard_step") == i + 1]
    reports = reports[1:]  # (step 1's report: a loss like step 2's)
    assert [r["values"]["trainguard_step"] for r in reports] == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert math.isnan(reports[1]["values"]["trainguard_loss"]) and math.isnan(reports[1]["ranks"]["loss"][0])
    for r in reports[2:4]:  # no step of their intervals had a loss: none, and no NaN for one
        assert "trainguard_loss" not in r["values"] and r["ranks"]["loss"] == []
        assert "trainguard_loss{" not in r["metrics"] and "trainguard_loss{" in reports[0]["metrics"]
    assert math.isfinite(reports[4]["values"]["trainguard_loss"]) and reports[4]["ranks"]["loss"] != []
    assert [r["values"]["trainguard_nonfinite_steps_total"] for r in reports] == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_the_controllers_rules_see_a_nonfinite_loss_once_and_no_loss_as_none() -> None:
    """What the agent sends, replayed through the controller's default rules and recovery, reports two
    minutes apart (past every cooldown): a run whose first interval has no loss is not acted on, and
    one NaN loss fires its rule at one report."""
    from tests.control.fake_controller import FakeController
    from tests.service.report_replay import RULES
    from trainguard.service.engine import simulate

    fired = {}
    for name, plan in (("no-loss", ["none"] * 4 + ["loss"] * 4), ("nan", ["loss", "loss", "nan"] + ["none"] * 7)):
        ctl = FakeController()
        try:
            _loop(plan, f"r-rules-{name}", controller=ctl.url)
        finally:
            ctl.close()
        sent = [r.model_copy(update={"time": 1000.0 + 120.0 * i}) for i, r in enumerate(ctl.reports)]
        assert [r.step_last for r in sent] == [1, *range(2, len(plan) + 1, 2)]
        steps = simulate(RULES.base, sent, world_size=1, policy=RULES.file.recovery, snapshot_keep=4)
        fired[name] = [(s.step_last, f.finding.rule.name) for s in steps for f in s.fired]
    assert fired == {"no-loss": [], "nan": [(4, "loss_nonfinite")]}


def test_a_step_without_gradients_has_no_gradient_values() -> None:
    # 2: gradients; 4: both steps without any (.grad None); 6: step 5 had one, step 6 none; 8: a NaN
    # gradient at 7, none at 8; 10: a NaN gradient at the report step, applied by the optimizer
    steps = _loop(["loss", "loss", "none", "none", "loss", "idle", "nan", "none", "loss", "nanstep"], "r-no-grad")
    gradient_values = ("trainguard_grad_norm", "trainguard_grad_max_abs", "trainguard_effective_lr",
                       "trainguard_update_size_ratio", "trainguard_nonfinite_grads", "trainguard_update_ratio",
                       "trainguard_update_ratio_per_lr")
    first, no_grad, after_grad, after_nan, nan_now = (steps[i] for i in (1, 3, 5, 7, 9))
    assert all(k in first["values"] for k in gradient_values) and "trainguard_grad_max_abs{" in first["metrics"]
    assert first["values"]["trainguard_grad_norm"] == pytest.approx(first["norm"], rel=1e-6)
    for s in (no_grad, after_grad, after_nan):  # absent: not 0, -inf or the last step's value
        assert [k for k in gradient_values if k in s["values"]] == []
        assert not any(k.startswith("trainguard_layer_grad") for k in s["values"])
        assert s["ranks"]["grad_norm"] == []
        assert "trainguard_grad_norm{" not in s["metrics"] and "trainguard_grad_max_abs{" not in s["metrics"]
    assert "trainguard_grad_norm_max" not in no_grad["values"]  # no step of the interval had a gradient
    assert "trainguard_param_norm" in no_grad["values"]  # (the weights are reported, not how a gradient moved them)
    assert after_grad["values"]["trainguard_grad_norm_max"] == pytest.approx(steps[4]["norm"], rel=1e-6)
    assert math.isnan(after_nan["values"]["trainguard_grad_norm_max"])  # no finite norm in the interval
    # a real NaN gradient stays NaN
    assert math.isnan(nan_now["values"]["trainguard_grad_norm"]) and math.isnan(nan_now["ranks"]["grad_norm"][0])
    assert math.isnan(nan_now["values"]["trainguard_grad_max_abs"]) and nan_now["values"]["trainguard_nonfinite_grads"] == 25
    assert math.isnan(nan_now["values"]["trainguard_effective_lr"]) and math.isnan(nan_now["values"]["trainguard_update_ratio"])


def test_a_step_whose_gradients_are_all_zero_has_no_effective_lr() -> None:
    """Step 2's loss is multiplied by 0: every gradient is exactly 0 and SGD leaves the weights
    where they were. The update ratio is that 0 (a step with a gradient); the effective LR,
    ||dW|| / ||g||, is 0/0: no LR, absent rather than a NaN that reads as a non-finite gradient."""
    zero, = (s["values"] for s in _loop(["loss", "zero"], "r-zero-grad")[1:])
    assert zero["trainguard_grad_norm"] == 0.0 and zero["trainguard_nonfinite_grads"] == 0.0
    assert zero["trainguard_update_ratio"] == 0.0
    assert "trainguard_effective_lr" not in zero


STEP_TIMES = ("trainguard_step_duration_seconds", "trainguard_tokens_per_second", "trainguard_forward_seconds")


@pytest.mark.parametrize("resumed_at", [0, 1])
def test_the_first_step_after_attach_has_no_step_times(resumed_at: int) -> None:
    """The first step an agent times runs from attach and holds the warm-up: here torch.compile
    traces the model in its first forward. Its report (step 1, or the first step after a resume
    that is a report step) has no step time, throughput or forward time, on /metrics and in the
    rank's row; the next report has them, its throughput the step's tokens over its time."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(compiled, opt, job="j", run=f"r-warm-up-{resumed_at}",
                      config=ta.AgentConfig(metrics_port=None, report_every=2))
    if resumed_at:
        agent.load_state_dict({"version": 1, "step": resumed_at, "nonfinite_steps_total": 0.0,
                               "amp_skipped_steps_total": 0})
    seen = []
    try:
        for _ in range(3):
            loss = compiled(torch.randn(2, 4)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(loss.detach(), tokens=8)
            seen.append((dict(agent.latest()), dict(agent.rank_values), generate_latest(agent.registry).decode()))
        assert agent.errors.count == 0
    finally:
        agent.close()
    (first, first_ranks, first_metrics), _, (later, later_ranks, later_metrics) = seen
    assert (first["trainguard_step"], later["trainguard_step"]) == ((1, 2) if resumed_at == 0 else (2, 4))
    assert [k for k in STEP_TIMES if k in first or f"{k}{{" in first_metrics] == []
    assert math.isnan(first_ranks["step_duration_seconds"][0]) and math.isnan(first_ranks["forward_seconds"][0])
    assert all(later[k] > 0 and f"{k}{{" in later_metrics for k in STEP_TIMES)
    assert later["trainguard_tokens_per_second"] == 8 / later["trainguard_step_duration_seconds"]
    assert later_ranks["step_duration_seconds"] == [later["trainguard_step_duration_seconds"]]
    assert "trainguard_loss" in first and "trainguard_grad_norm" in first  # (the rest is reported)


def test_a_step_that_recompiled_has_no_step_times_and_is_counted() -> None:
    """torch.compile compiles again when the input's shape changes mid-run (step 4 here): that step's
    time is the compiler's (tens to thousands of steps' worth), not a slow step. Its report has no
    step time, throughput or forward time (NaN in the rank's row, which the straggler rules skip)
    and counts it in trainguard_compile_steps_total; the steps around it are reported as usual."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(compiled, opt, job="j", run="r-recompile", config=ta.AgentConfig(metrics_port=None, report_every=1))
    seen = []
    try:
        for rows in (2, 2, 2, 3, 3, 3):  # the first call compiles (the warm-up), 3 rows compile again
            loss = compiled(torch.randn(rows, 4)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(loss.detach(), tokens=rows)
            seen.append((dict(agent.latest()), dict(agent.rank_values), generate_latest(agent.registry).decode()))
        assert agent.errors.count == 0
    finally:
        agent.close()
    timed = [all(k in values for k in STEP_TIMES) for values, _, _ in seen]
    assert timed == [False, True, True, False, True, True]
    recompiled, ranks, metrics = seen[3]
    assert [k for k in STEP_TIMES if k in recompiled or f"{k}{{" in metrics] == []
    assert math.isnan(ranks["step_duration_seconds"][0]) and math.isnan(ranks["forward_seconds"][0])
    assert [values["trainguard_compile_steps_total"] for values, _, _ in seen] == [0, 0, 0, 1, 1, 1]
    after, after_ranks, _ = seen[4]
    assert after["trainguard_tokens_per_second"] == 3 / after["trainguard_step_duration_seconds"]
    assert after_ranks["step_duration_seconds"] == [after["trainguard_step_duration_seconds"]]

"""ControlPlane in one process, through the real agent (``ta.attach``) and a real ``trainguard
serve`` process (one per module; each test has runs of its own): lr_scale against independent
scheduler references, skipped non-finite steps bit for bit, checkpoint/stop, pause with /metrics
answering, restart, state_dict, reports. Commands go through the operator API, acks are read from
the run's audit log and reports from the controller's database, so the agent meets only states
the real API can produce."""

from __future__ import annotations

import copy
import math
import threading
import time
import urllib.request
import warnings
import pytest
import torch
from torch import nn
from prometheus_client.parser import text_string_to_metric_families

import trainer_agent as ta
from tests.control.procs import ControllerProcess, module_controller, until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ctl(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    yield from module_controller(tmp_path_factory, operator_only=True)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 6, generator=g)


def _attach(model, opt, ctl: ControllerProcess | None, run: str = "unused", on_checkpoint=None, **cfg):  # type: ignore[no-untyped-def]
    cfg.setdefault("report_every", 1)
    cfg.setdefault("metrics_port", None)
    agent = ta.attach(model, opt, job="job-ctl", run=run, on_checkpoint=on_checkpoint,
                      config=ta.AgentConfig(controller=ctl.url if ctl else None, **cfg))
    if ctl is not None:  # the operator API knows only registered runs
        assert until(lambda: agent.control.client.desired is not None and ctl.run_detail(run) is not None, 30.0)
    return agent


def _command(ctl: ControllerProcess, run: str, command: str, **body: object) -> int:
    """An operator command through the REST API; the generation it published."""
    return int(ctl.command(run, command, **body)["desired"]["generation"])


def _wait_seen(agent, generation: int) -> None:  # type: ignore[no-untyped-def]
    """Block the test until the leader's client has seen ``generation`` (deterministic steps)."""
    assert until(lambda: (d := agent.control.client.desired) is not None and d.generation >= generation, 30.0)


@pytest.mark.parametrize("schedule", ["warm_restarts", "lambda"])
def test_lr_scale_multiplies_the_scheduler_lr_and_leaves_the_schedule_alone(ctl: ControllerProcess, schedule: str) -> None:
    def make(params):  # type: ignore[no-untyped-def]
        opt = torch.optim.SGD(params, lr=0.1)
        if schedule == "warm_restarts":
            sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=4, T_mult=2, eta_min=1e-3)
        else:
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1.0 + 0.3 * e))
        return opt, sched

    # independent reference: the same scheduler on a bare optimizer, no agent
    ref_opt, ref_sched = make([torch.nn.Parameter(torch.zeros(1))])
    ref_lrs = []
    for _ in range(16):
        ref_lrs.append(ref_opt.param_groups[0]["lr"])
        ref_opt.step()
        ref_sched.step()

    run = f"lr-{schedule}"
    model = _model()
    opt, sched = make(model.parameters())
    agent = _attach(model, opt, ctl, run)
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))
    scales = {3: 0.5, 9: 0.25, 12: 1.0}  # command after end_step of these steps
    for step in range(1, 17):
        x = _batch(step)
        before = [p.detach().clone().double() for p in model.parameters()]
        loss = model(x).pow(2).mean()
        loss.backward()
        grads = [p.grad.detach().clone().double() for p in model.parameters()]
        opt.step()
        # plain SGD: W_after = W_before - lr_used * g, checked in float64
        for b, g, p in zip(before, grads, model.parameters()):
            torch.testing.assert_close(p.detach().double(), b - used[-1] * g, rtol=1e-6, atol=1e-7)
        opt.zero_grad()
        sched.step()
        agent.end_step(loss)
        if step in scales:
            _wait_seen(agent, _command(ctl, run, "lr-scale", scale=scales[step]))
    applied = {a.step: a.lr_scale for a in agent.control.history}
    assert applied == {4: 0.5, 10: 0.25, 13: 1.0}  # the next step boundary after each command
    scale = 1.0
    for step in range(1, 17):
        # the LR of step s is applied at end_step(s-1)
        scale = applied.get(step - 1, scale)
        assert used[step - 1] == ref_lrs[step - 1] * scale, step
    assert sched.get_last_lr() == ref_sched.get_last_lr()  # the schedule never saw the scale
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    latest = agent.latest()
    assert latest['trainguard_learning_rate{group="0"}'] == used[-1]
    assert latest["trainguard_lr_scale"] == 1.0
    assert latest["trainguard_applied_generation"] == 3.0
    assert until(lambda: ctl.acks(run) == [(1, 4), (2, 10), (3, 13)], 30.0), ctl.acks(run)
    agent.close(2.0)


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_skip_nonfinite_leaves_params_and_adam_state_bit_identical(scheduler_first: bool) -> None:
    model = _model(1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e) if scheduler_first else None
    agent = _attach(model, opt, None, skip_nonfinite=True)
    if sched is None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e)
    post_hook_calls = []
    opt.register_step_post_hook(lambda o, a, k: post_hook_calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "optimizer.step() has been overridden after ..."
        for step in range(1, 9):
            x = _batch(step)
            handle = None
            if step == 3:  # an Inf appears in one gradient during backward; the loss is finite
                handle = model[0].weight.register_hook(lambda g: g.index_put((torch.tensor([1]),), torch.tensor(math.inf)))
            if step == 6:  # a NaN input: loss and every gradient NaN
                x[0, 2] = math.nan
            loss = model(x).pow(2).mean()
            loss.backward()
            if handle is not None:
                handle.remove()
            params = [p.detach().clone() for p in model.parameters()]
            state = copy.deepcopy(opt.state_dict()["state"])
            opt.step()
            changed = [not torch.equal(a, p) for a, p in zip(params, model.parameters())]
            if step in (3, 6):
                assert not any(changed)
                after = opt.state_dict()["state"]
                assert state.keys() == after.keys()
                for k in state:
                    for name, t in state[k].items():
                        assert torch.equal(t, after[k][name]), (k, name)
            else:
                assert all(changed)
            opt.zero_grad()
            sched.step()
            agent.end_step(loss)
    assert len(post_hook_calls) == 6  # the skipped steps never reached the optimizer
    assert sched.last_epoch == 8 and opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.9**8, rel=1e-12)
    assert int(opt.state_dict()["state"][0]["step"]) == 6
    latest = agent.latest()
    assert latest['trainguard_skipped_steps_total{reason="nonfinite"}'] == 2.0
    assert latest["trainguard_nonfinite_steps_total"] == 2.0
    assert agent.state_dict()["control"]["skipped_steps_total"] == 2
    agent.close(1.0)
    assert "step" not in vars(opt) or scheduler_first  # unwrapped (a scheduler's own wrapper may stay)


def test_checkpoint_once_per_seq_then_stop_on_every_call(ctl: ControllerProcess) -> None:
    calls: list[int] = []
    run = "checkpoints"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = _attach(model, opt, ctl, run, on_checkpoint=calls.append)
    # step 8: a new generation with the same checkpoint_seq (2) must not checkpoint again
    commands = {2: ("checkpoint", {}), 4: ("lr-scale", {"scale": 0.5}), 6: ("checkpoint", {}),
                8: ("lr-scale", {"scale": 0.25}), 10: ("stop", {})}
    step = 0
    while not agent.should_stop and step < 30:
        step += 1
        loss = model(_batch(step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        if step in commands:
            what, body = commands[step]
            _wait_seen(agent, _command(ctl, run, what, **body))
    assert calls == [3, 7, 11]  # seq 1 at 3, seq 2 at 7, nothing for the same seq, stop at 11
    assert step == 11 and agent.should_stop
    assert [(a.generation, a.step, a.checkpoint_seq) for a in agent.control.history] == [
        (1, 3, 1), (2, 5, 1), (3, 7, 2), (4, 9, 2), (5, 11, 2)]
    agent.close(2.0)
    assert ctl.run_detail(run)["status"] in ("stopped", "finished")


def test_pause_blocks_end_step_while_metrics_answer_then_resume(ctl: ControllerProcess) -> None:
    run = "pause"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = _attach(model, opt, ctl, run, metrics_port=0)
    scraped: list[float] = []
    resumed_at: list[float] = []

    def operator() -> None:
        assert until(lambda: agent.control.paused, 30.0)
        with urllib.request.urlopen(agent.metrics_url, timeout=5) as r:
            for fam in text_string_to_metric_families(r.read().decode()):
                if fam.name == "trainguard_paused":
                    scraped.extend(s.value for s in fam.samples)
        resumed_at.append(time.monotonic())
        _command(ctl, run, "resume")

    op = threading.Thread(target=operator)
    returned_at = 0.0
    for step in range(1, 7):
        loss = model(_batch(step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        if step == 3:
            returned_at = time.monotonic()  # end_step(3) applied the pause and returned
        if step == 2:
            _wait_seen(agent, _command(ctl, run, "pause"))
            op.start()
        if step == 4:
            _wait_seen(agent, _command(ctl, run, "lr-scale", scale=0.5))
    op.join(30)
    assert scraped == [1.0]  # /metrics answered while the step was blocked
    assert resumed_at and returned_at > resumed_at[0]  # end_step(3) returned only after the resume
    assert [(a.generation, a.step, a.paused) for a in agent.control.history] == [(1, 3, True), (2, 3, False), (3, 5, False)]
    assert agent.latest()["trainguard_paused"] == 0.0 and agent.control.lr_scale == 0.5
    assert until(lambda: ctl.acks(run) == [(1, 3), (2, 3), (3, 5)], 30.0), ctl.acks(run)
    agent.close(2.0)


def test_restarted_run_applies_the_registration_state_before_its_first_step(ctl: ControllerProcess) -> None:
    run = "restart"
    calls: list[int] = []
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = _attach(model, opt, ctl, run)  # the job before it died: it never reaches a step boundary again
    assert _command(ctl, run, "lr-scale", scale=0.25) == 1
    assert _command(ctl, run, "checkpoint") == 2
    assert _command(ctl, run, "pause") == 3  # the run was paused when its job died
    first.close(2.0)
    assert ctl.acks(run) == []

    attached: list[object] = []
    returned_at: list[float] = []

    def restart() -> None:  # attach blocks while the run is paused
        attached.append(ta.attach(model, opt, job="job-ctl", run=run, on_checkpoint=calls.append,
                                  config=ta.AgentConfig(controller=ctl.url, report_every=1, metrics_port=None)))
        returned_at.append(time.monotonic())

    t = threading.Thread(target=restart)
    t.start()
    # the restarted leader applied the paused state at registration and acked it at step 0
    assert until(lambda: ctl.acks(run) == [(3, 0)], 30.0), ctl.acks(run)
    resumed_at = time.monotonic()
    assert _command(ctl, run, "resume") == 4
    t.join(30)
    assert not t.is_alive() and returned_at[0] > resumed_at  # attach returned only after the resume
    (agent,) = attached
    assert agent.step == 0 and not agent.control.paused  # type: ignore[attr-defined]
    assert agent.control.applied_generation == 4 and agent.control.lr_scale == 0.25  # type: ignore[attr-defined]
    assert calls == []  # checkpoints requested before the restart are not taken again
    used = []
    opt.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))
    model(_batch(1)).sum().backward()
    opt.step()
    assert used == [0.1 * 0.25]
    assert until(lambda: ctl.acks(run) == [(3, 0), (4, 0)], 30.0), ctl.acks(run)
    agent.close(2.0)  # type: ignore[attr-defined]


def test_state_dict_round_trip_and_bad_input(ctl: ControllerProcess) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = _attach(model, opt, ctl, "state-a")
    _command(ctl, "state-a", "lr-scale", scale=0.5)
    _command(ctl, "state-a", "checkpoint")
    _wait_seen(agent, _command(ctl, "state-a", "checkpoint"))
    model(_batch(1)).sum().backward()
    # the spike guard (on with a controller) keeps the step's global gradient norm, here in float64
    gnorm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
    opt.step()
    agent.end_step(1.0)
    state = agent.state_dict()["control"]
    assert state == {"lr_scale": 0.5, "applied_generation": 3, "checkpoint_seq": 2, "rollback_seq": 0,
                     "skipped_steps_total": 0, "skipped_by_reason": {"spike": 0, "nonfinite": 0, "data": 0},
                     "spike_guard": {"norms": [pytest.approx(gnorm, rel=1e-6)], "consecutive": 0,
                                     "after_data_skip": False},
                     "accumulation": [0, "none"], "grad_clip_norm": 0.0, "reset_optimizer_seq": 0,
                     "momentum_scale": 1.0, "weight_decay_scale": 1.0}
    agent.close(1.0)

    agent = _attach(model, opt, ctl, "state-b")  # a run the controller has at generation 0: the checkpoint restores
    agent.load_state_dict({**agent.state_dict(), "control": {**state, "applied_generation": 4}})
    assert agent.state_dict()["control"] == {**state, "applied_generation": 4}
    agent.load_state_dict({**agent.state_dict(), "step": 100})  # a restart at step 100
    _wait_seen(agent, _command(ctl, "state-b", "lr-scale", scale=2.0))  # generation 1 < 4: never goes backwards
    model(_batch(1)).sum().backward()
    opt.step()
    agent.end_step(1.0)
    assert agent.control.lr_scale == 0.5 and agent.control.applied_generation == 4
    assert until(lambda: [r["steps"] for r in ctl.reports("state-b")] == [(101, 101)], 30.0), ctl.reports("state-b")
    with pytest.raises(ValueError, match="control state"):
        agent.control.load_state_dict({"lr_scale": 0.0, "applied_generation": 1, "checkpoint_seq": 0,
                                       "skipped_steps_total": 0})
    with pytest.raises(ValueError, match="control state"):
        agent.control.load_state_dict({"lr_scale": 1.0})
    agent.close(1.0)


def test_reports_carry_nan_and_contiguous_step_ranges(ctl: ControllerProcess) -> None:
    run = "reports"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = _attach(model, opt, ctl, run, report_every=2)
    for step in range(1, 9):
        loss = model(_batch(step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        # a NaN loss in the last report: the default rule's pause comes after the last step
        agent.end_step(loss * math.nan if step == 8 else loss)
    assert until(lambda: len(ctl.reports(run)) == 5, 30.0), ctl.reports(run)
    reps = ctl.reports(run)
    assert [r["steps"] for r in reps] == [(1, 1), (2, 2), (3, 4), (5, 6), (7, 8)]  # step 1 reports too
    assert math.isnan(reps[4]["values"]["trainguard_loss"]) and math.isnan(reps[4]["ranks"]["loss"][0])
    assert reps[1]["values"]["trainguard_loss"] == reps[1]["ranks"]["loss"][0] and reps[1]["ranks"]["loss"][0] > 0
    assert math.isnan(reps[1]["ranks"]["param_fingerprint"][0])  # one rank: no fingerprints to compare
    assert all(len(r["ranks"][f]) == 1 for r in reps for f in ("step_time_s", "grad_norm", "forward_s"))
    assert all(r["ranks"]["forward_s"][0] == r["values"]["trainguard_forward_seconds"] >= 0 for r in reps[1:])
    # step 1, the warm-up step: its time is the warm-up's, not a step's (absent, NaN in the row)
    assert math.isnan(reps[0]["ranks"]["forward_s"][0]) and "trainguard_forward_seconds" not in reps[0]["values"]
    assert "trainguard_lr_scale" in reps[0]["values"] and not any("{" in k for k in reps[0]["values"])
    # the NaN reached the controller's rules: its default rule paused the run
    assert until(lambda: ctl.run_detail(run)["desired"]["paused"], 30.0)
    agent.close(1.0)


def test_a_report_that_fails_to_build_does_not_keep_the_leader_from_applying(ctl: ControllerProcess) -> None:
    run = "report-fails"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = _attach(model, opt, ctl, run)  # report_every=1: every step is a report step
    try:
        def boom(step, rows):  # type: ignore[no-untyped-def]
            raise RuntimeError("injected: the report could not be built")

        agent.control._send_report = boom
        _wait_seen(agent, _command(ctl, run, "lr-scale", scale=0.25))
        loss = model(_batch(1)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        # the generation was applied at this step although its report failed (and was counted)
        assert agent.latest()["trainguard_lr_scale"] == 0.25
        assert agent.latest()["trainguard_applied_generation"] == 1
        assert agent.latest()["trainguard_agent_errors_total"] >= 1
        assert until(lambda: ctl.acks(run) == [(1, 1)], 30.0), ctl.acks(run)
    finally:
        agent.close(2.0)


def test_skip_nonfinite_reads_sparse_gradients_set_by_hand() -> None:
    """Gradients set by hand (no backward pass: the agent has measured nothing when the optimizer
    steps) and one of them sparse: the skip vote takes the norm of every gradient itself. A NaN
    in the sparse gradient skips the step; finite ones take it (the norm once raised on the
    sparse tensor, and the vote, failing open, took the NaN step)."""
    emb, lin = nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1)
    model = nn.ModuleDict({"emb": emb, "lin": lin})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = _attach(model, opt, None, skip_nonfinite=True)
    try:
        for step, bad in ((1, False), (2, True), (3, False)):
            values = torch.full((2, 3), math.nan if bad else 0.5)
            emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([[2, 2]]), values, (10, 3))
            lin.weight.grad, lin.bias.grad = torch.ones(1, 3), torch.ones(1)
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            changed = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
            assert not any(changed) if bad else all(changed), step
            opt.zero_grad()
            agent.end_step(torch.tensor(1.0))
        latest = agent.latest()
        assert latest['trainguard_skipped_steps_total{reason="nonfinite"}'] == 1.0
        assert latest["trainguard_agent_errors_total"] == 0.0
    finally:
        agent.close()

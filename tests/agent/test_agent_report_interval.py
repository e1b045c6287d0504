"""What a report carries about the steps since the previous one, and what the agent counts as errors."""

import math

import pytest
import torch
from prometheus_client import CollectorRegistry

import trainer_agent as ta


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_loss_between_reports_is_reported(bad: float) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r", registry=CollectorRegistry(),
                      config=ta.AgentConfig(report_every=5, metrics_port=None))
    losses = []
    try:
        for step in range(1, 16):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            # The loss the loop hands the agent turns non-finite at step 7 (not a report step:
            # 5, 10, 15 are); the weights stay finite so later losses are finite again.
            seen = loss.detach() * bad if step == 7 else loss.detach()
            losses.append(float(seen))
            agent.end_step(seen)
            if step == 10:
                at_10 = agent.latest()["trainguard_loss"]
        at_15 = agent.latest()["trainguard_loss"]
    finally:
        agent.close(timeout=5.0)
    # step 7's value, not step 10's finite loss
    assert (math.isnan(at_10) and math.isnan(bad)) or at_10 == bad
    # the next interval had only finite losses: the report is the last step's loss again
    assert at_15 == pytest.approx(losses[14], rel=1e-6)


def test_grad_norm_max_is_the_largest_finite_norm_of_the_interval() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run="r", registry=CollectorRegistry(),
                      config=ta.AgentConfig(report_every=4, metrics_port=None))
    norms: list[float] = []
    maxima: dict[int, float] = {}
    try:
        for step in range(1, 13):
            scale = 50.0 if step == 6 else 1.0  # a spike at a step between reports (4, 8, 12)
            loss = model(torch.randn(16, 6) * scale).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            norms.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())))
            opt.step()
            agent.end_step(loss)
            if step % 4 == 0:
                maxima[step] = agent.latest()["trainguard_grad_norm_max"]
    finally:
        agent.close(timeout=5.0)
    for end in (4, 8, 12):
        assert maxima[end] == pytest.approx(max(norms[end - 4:end]), rel=1e-6)
    assert maxima[8] > 5 * maxima[4]  # the spike at step 6 was not a report step, and is not lost


def test_grad_norm_max_is_nan_when_no_step_of_the_interval_had_a_finite_norm() -> None:
    """It read 0.0 (a vanished gradient) when every norm of the interval was NaN; one finite norm
    among NaN and Inf ones is still the interval's largest finite norm."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run="r", registry=CollectorRegistry(),
                      config=ta.AgentConfig(report_every=2, metrics_port=None))
    poison = {4: math.nan, 5: math.inf, 6: math.nan}  # report 4: one finite norm beside a NaN; report 6: none
    norms: dict[int, float] = {}
    maxima: dict[int, float] = {}
    try:
        for step in range(1, 7):
            loss = model(torch.randn(16, 6)).pow(2).mean() * poison.get(step, 1.0)
            opt.zero_grad()
            loss.backward()
            norms[step] = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
            for p in model.parameters():
                p.grad.nan_to_num_(0.0, 0.0, 0.0)  # (the weights stay finite for the next steps)
            opt.step()
            agent.end_step(loss.detach())
            if step % 2 == 0:
                maxima[step] = agent.latest()["trainguard_grad_norm_max"]
    finally:
        agent.close(timeout=5.0)
    assert not math.isfinite(norms[4]) and not math.isfinite(norms[5]) and not math.isfinite(norms[6])
    assert maxima[2] == pytest.approx(norms[2], rel=1e-6)  # (step 1 had a report of its own)
    assert maxima[4] == pytest.approx(norms[3], rel=1e-6)  # the finite one of the interval
    assert math.isnan(maxima[6])  # steps 5 and 6: no finite norm (0.0 before)


@pytest.mark.parametrize("restore", [False, True])
def test_grad_norm_max_of_a_short_interval_leaves_out_the_rows_no_step_wrote(restore: bool) -> None:
    """The report of step 1 covers one step and the one after it nine (report_every=10): their
    other rows held no norm of theirs, and read 0.0 (a norm below any limit) when the steps' own
    norms were all Inf (a GradScaler's skipped first steps); the controller took that 0 as the run
    crossing 1e3. Also after a restore, whose first interval is short again."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="j", run="r", registry=CollectorRegistry(),
                      config=ta.AgentConfig(report_every=10, metrics_port=None))
    # every norm Inf for the first 12 steps; with a restore to step 10 at step 13, up to step 20 again
    inf_for = 12 if not restore else 23
    norms: dict[int, float] = {}
    maxima: dict[int, float] = {}
    state, taken = None, 0
    try:
        while agent.step < 30:
            taken += 1
            loss = model(torch.randn(16, 6)).pow(2).mean() * (math.inf if taken <= inf_for else 1.0)
            opt.zero_grad()
            loss.backward()
            norms[agent.step + 1] = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))
            for p in model.parameters():
                p.grad.nan_to_num_(0.0, 0.0, 0.0)
            opt.step()
            agent.end_step(loss.detach() if taken > inf_for else None)
            if agent.step in (1, 10, 20, 30):
                maxima[agent.step] = agent.latest().get("trainguard_grad_norm_max", -1.0)
            if restore and agent.step == 10 and state is None:
                state = agent.state_dict()
            if restore and taken == 13:
                agent.load_state_dict(state)  # back to step 10: the next interval is short again
    finally:
        agent.close(timeout=5.0)
    assert all(not math.isfinite(norms[s]) for s in range(1, 13 if not restore else 21))
    assert math.isnan(maxima[1]) and math.isnan(maxima[10])  # 0.0 before: rows no step wrote
    if not restore:
        assert maxima[20] == pytest.approx(max(norms[s] for s in range(13, 21)), rel=1e-6)
    else:
        assert math.isnan(maxima[20])  # steps 11-20 after the restore: all Inf
    assert maxima[30] == pytest.approx(max(norms[s] for s in range(21, 31) if math.isfinite(norms[s])), rel=1e-6)


def test_batches_the_data_monitor_drops_count_as_agent_errors() -> None:
    import threading

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = ta.DataMonitor(vocab_size=16)
    gate = threading.Event()
    real = monitor.observe_batch

    def slow(*args, **kwargs):
        gate.wait(10)  # the worker is stuck until the loop has over-filled the queue
        return real(*args, **kwargs)

    monitor.observe_batch = slow
    agent = ta.attach(model, opt, job="j", run="r", registry=CollectorRegistry(), data_monitor=monitor,
                      config=ta.AgentConfig(report_every=1, metrics_port=None))
    try:
        for _ in range(40):
            agent.observe_batch(torch.randint(0, 16, (2, 8)))
        gate.set()
        dropped = agent.data.feed.dropped
        assert dropped > 0
        loss = model(torch.randn(3, 4)).sum()
        loss.backward()
        opt.step()
        agent.end_step(loss)
        assert agent.latest()["trainguard_agent_errors_total"] == dropped
    finally:
        gate.set()
        agent.close(timeout=5.0)


def test_nonfinite_steps_between_reports_are_counted_in_state_dict_and_report() -> None:
    """The interval's rows hold the per-step finite flags until the report: a checkpoint taken
    between reports counts them, a restore starts a clean interval, and every report counts each
    non-finite step once (loss NaN at step 2, gradient Inf at step 4, report_every 3)."""
    torch.manual_seed(2)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r", registry=CollectorRegistry(),
                      config=ta.AgentConfig(report_every=3, metrics_port=None))
    try:
        totals, states = {}, {}
        for step in range(1, 7):
            loss = model(torch.randn(4, 3)).pow(2).mean()
            opt.zero_grad()
            handle = model.weight.register_hook(lambda g: g.index_fill(1, torch.tensor([1]), math.inf)) \
                if step == 4 else None
            loss.backward()
            saved = model.weight.detach().clone()
            opt.step()
            if handle is not None:
                handle.remove()
                with torch.no_grad():
                    model.weight.copy_(saved)  # the Inf gradient's update undone: later steps finite
            agent.end_step(loss.detach() * math.nan if step == 2 else loss)
            states[step] = agent.state_dict()["nonfinite_steps_total"]
            assert bool(agent.step_finite_device) == (step not in (2, 4))
            if step % 3 == 0:
                totals[step] = agent.latest()["trainguard_nonfinite_steps_total"]
        assert states == {1: 0.0, 2: 1.0, 3: 1.0, 4: 2.0, 5: 2.0, 6: 2.0}
        assert totals == {3: 1.0, 6: 2.0}
        agent.load_state_dict({**agent.state_dict(), "step": 7, "nonfinite_steps_total": 5.0})
        assert agent.state_dict()["nonfinite_steps_total"] == 5.0
    finally:
        agent.close(timeout=5.0)


def test_reports_published_under_back_pressure_reach_the_callback_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies that never complete by themselves (a device far behind the host, as on CUDA with a
    small report_every): the pipeline waits for the oldest once MAX_IN_FLIGHT are pending. Every
    report still reaches the agent's callback (the controller, /metrics and the batch-size advisor
    read it there) exactly once and in order, the NaN of step 2 included."""
    from trainer_agent.agent_parts.export import MetricsExport
    from trainer_agent.report.pipeline import MAX_IN_FLIGHT, InFlight

    monkeypatch.setattr(InFlight, "ready", lambda self: False)
    seen: list[tuple[int, float]] = []
    advise = MetricsExport._advise_batch_size  # the callback's first reader of each report

    def recording(self, values):  # type: ignore[no-untyped-def]
        seen.append((int(values["trainguard_step"]), values["trainguard_loss"]))
        advise(self, values)

    monkeypatch.setattr(MetricsExport, "_advise_batch_size", recording)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="j", run="r", registry=CollectorRegistry(),
                      config=ta.AgentConfig(report_every=1, metrics_port=None))
    steps = 3 * MAX_IN_FLIGHT
    try:
        for step in range(1, steps + 1):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            agent.end_step(loss.detach() * math.nan if step == 2 else loss.detach())
        assert len(agent.reports.pending) == MAX_IN_FLIGHT  # the rest went out under back-pressure
        before_close = [s for s, _ in seen]
    finally:
        agent.close(timeout=5.0)
    assert before_close == list(range(1, steps - MAX_IN_FLIGHT + 1))
    assert [s for s, _ in seen] == list(range(1, steps + 1))  # close() publishes the rest, once each
    assert math.isnan(seen[1][1]) and all(math.isfinite(v) for s, v in seen if s != 2)


def test_a_run_shorter_than_one_report_interval_reports_its_first_step() -> None:
    """30 steps at report_every=50: the controller gets step 1's report (it got none before) and the
    run's finish at step 30."""
    from tests.control.fake_controller import FakeController

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, norms = [], []
    with FakeController() as fake:
        agent = ta.attach(model, opt, job="j", run="r-short", controller=fake.url, registry=CollectorRegistry(),
                          config=ta.AgentConfig(report_every=50, metrics_port=None))
        for _ in range(30):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            norms.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())))
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            agent.end_step(loss.detach())
        agent.close(timeout=10.0)
        reports, finishes = list(fake.reports), list(fake.finishes)
    assert [(r.step_first, r.step_last) for r in reports] == [(1, 1)]
    assert reports[0].values["trainguard_loss"] == pytest.approx(losses[0], rel=1e-6)
    assert reports[0].values["trainguard_grad_norm"] == pytest.approx(norms[0], rel=1e-6)
    assert [f.step for f in finishes] == [30]

"""ControlPlane's pause wait, ended by an operator's stop or resume through a real ``trainguard
serve`` process: the rank's log says which ended it (a stop sent while paused is not a resume)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import trainer_agent as ta
from tests.control.procs import ControllerProcess, module_controller, until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ctl(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    yield from module_controller(tmp_path_factory, operator_only=True)


@pytest.mark.parametrize("ending, expected", [
    ("stop", "rank 0 stopped while paused at step 3 (generation 2)"),
    ("resume", "rank 0 resumed at step 3 (generation 2)"),
])
def test_the_pause_log_says_what_ended_it(ctl: ControllerProcess, caplog: pytest.LogCaptureFixture,
                                          ending: str, expected: str) -> None:
    run = f"pause-then-{ending}"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = ta.attach(model, opt, job="job-pause", run=run,
                      config=ta.AgentConfig(controller=ctl.url, report_every=1, metrics_port=None))
    assert until(lambda: agent.control.client.desired is not None and ctl.run_detail(run) is not None, 30.0)

    def operator() -> None:
        assert until(lambda: agent.control.paused, 30.0)
        ctl.command(run, ending)

    op = threading.Thread(target=operator)
    caplog.set_level(logging.WARNING, logger="trainer_agent.control.plane")
    try:
        for step in range(1, 6):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(loss)
            if step == 2:
                generation = int(ctl.command(run, "pause")["desired"]["generation"])
                assert until(lambda: (d := agent.control.client.desired) is not None and d.generation >= generation, 30.0)
                op.start()
            if agent.should_stop:
                break
        op.join(30)
    finally:
        agent.close(2.0)
    lines = [r.getMessage().removeprefix("trainguard: ") for r in caplog.records if r.name == "trainer_agent.control.plane"]
    assert "rank 0 paused at step 3 (generation 1)" in lines
    assert expected in lines, lines
    if ending == "stop":
        assert not any("resumed" in line for line in lines), lines
        assert agent.should_stop
    first, second = list(agent.control.history)[:2]
    assert (first.generation, first.step, first.paused, first.stop) == (1, 3, True, False)
    assert (second.generation, second.step, second.stop) == (2, 3, ending == "stop")

"""ForwardTimer: forward_s per rank, against a model whose forward sleeps a known time.

The sleep is the measured workload (a lower bound: ``time.sleep`` never returns early), not a
synchronisation. Assertions are bounds and orderings with generous margins."""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks
from tests.tools.sleepy import Sleepy

SLEEP = 0.05



def test_forward_seconds_sums_micro_batches_on_report_steps_only() -> None:
    import trainer_agent as ta

    model = Sleepy(SLEEP)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="fwd", run="fwd-1", config=ta.AgentConfig(metrics_port=None, report_every=2))
    try:
        for step in range(1, 5):
            model.sleep = 10 * SLEEP if step % 2 else SLEEP  # odd steps are not reported: not measured
            for _ in range(3 if step == 4 else 1):  # step 4: three micro-batches
                model(torch.randn(5, 4)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            agent.end_step(0.0)
            if step == 2:
                two = agent.latest()["trainguard_forward_seconds"]
        four = agent.latest()["trainguard_forward_seconds"]
        assert SLEEP <= two < 10 * SLEEP  # step 2's one forward, not step 1's long one
        assert 3 * SLEEP <= four < 10 * SLEEP  # step 4's three forwards summed, not step 3's
        assert agent.rank_values["forward_seconds"] == [four]
    finally:
        agent.close()


def test_forwards_without_gradients_between_steps_are_not_the_step_s() -> None:
    """An evaluation (``no_grad``) and a generation (``inference_mode``) between two training steps
    run the model's forward too; they are not the training step's forward."""
    import trainer_agent as ta

    model = Sleepy(SLEEP)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="fwd", run="fwd-eval", config=ta.AgentConfig(metrics_port=None, report_every=1))
    try:
        model.sleep = 0.0
        model(torch.randn(5, 4)).square().mean().backward()
        agent.end_step(0.0)  # the warm-up step (its report has no forward time)
        model.sleep = 10 * SLEEP
        with torch.no_grad():
            model(torch.randn(5, 4))
        with torch.inference_mode():
            model(torch.randn(5, 4))
        model.sleep = SLEEP
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(0.0)
        assert SLEEP <= agent.latest()["trainguard_forward_seconds"] < 10 * SLEEP
    finally:
        agent.close()


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=20))
    import trainer_agent as ta

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Sleepy(SLEEP if rank == 1 else 0.0))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    agent = ta.attach(ddp, opt, job="fwd", run="fwd-ddp", config=ta.AgentConfig(metrics_port=None, report_every=2))
    for _ in range(4):
        ddp(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(0.0)
    latest = agent.latest()
    torch.save({"rank_values": agent.rank_values, "latest": latest}, f"{out}/rank{rank}.pt")
    agent.close()
    del agent, ddp
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_forward_seconds_names_the_slow_rank_although_step_times_are_equal(tmp_path) -> None:
    out = spawn_ranks(_worker, 2, tmp_path)
    fwd = out[0]["rank_values"]["forward_seconds"]  # the leader holds every rank's value
    assert fwd[1] >= SLEEP and fwd[1] > 5 * fwd[0], fwd  # rank 1 sleeps in forward, rank 0 does not
    for r in range(2):
        assert out[r]["latest"]["trainguard_forward_seconds"] == fwd[r]
    assert out[1]["rank_values"]["forward_seconds"] == [fwd[1]]  # the other rank: its own value only


class _FakeEvent:
    """A CUDA event on a fake timeline (``now``, seconds): recorded when the host records it."""

    now = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = _FakeEvent.now

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, end: "_FakeEvent") -> float:
        return (end.at - self.at) * 1000.0  # ms, as CUDA's


def _cuda_timer(monkeypatch) -> tuple[Any, Callable[[float], None]]:
    """A forward timer of a CUDA model on the fake timeline, reporting every step, and
    ``forward(seconds)``: one step whose forward takes ``seconds`` on that timeline."""
    from trainer_agent.measure.forward_timer import ForwardTimer
    from trainer_agent.measure.schedule import ReportSchedule

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    model, step = nn.Linear(2, 2), [0]
    timer = ForwardTimer(model, ReportSchedule(1), torch.device("cuda"), step=lambda: step[0], clock=lambda: 0.0,
                         on_error=lambda where, exc: pytest.fail(f"{where}: {exc}"))

    def forward(seconds: float) -> None:
        handle = model.register_forward_pre_hook(lambda *a: setattr(_FakeEvent, "now", _FakeEvent.now + seconds))
        model(torch.randn(1, 2))  # the timer's start is recorded first, then the fake timeline moves
        handle.remove()
        step[0] += 1

    return timer, forward


def test_on_cuda_the_warm_up_step_s_forward_is_not_reported_by_the_next_report(monkeypatch) -> None:
    """On CUDA a report carries the previous report step's forward time (its events read a report
    later): the warm-up step's forward (compilation inside it: 60 s here) is dropped at its own
    report (``skip``), not carried into the next one; the next reports carry their own steps'."""
    timer, forward = _cuda_timer(monkeypatch)
    forward(60.0)
    timer.skip()  # the warm-up step's report
    forward(0.5)
    assert math.isnan(timer.take())  # step 2's report: no earlier report step's events (not step 1's 60 s)
    forward(0.25)
    assert timer.take() == 0.5  # step 3's report: step 2's forward


def test_on_cuda_a_skipped_step_mid_run_leaves_the_next_report_without_an_older_forward(monkeypatch) -> None:
    """A report step that compiled (30 s in its forward here) is skipped mid-run: the next report,
    which would read that step's events, has none (NaN), not the report step's before it (an
    older step than the one it names); the report after it has its own step's again."""
    timer, forward = _cuda_timer(monkeypatch)
    forward(0.5)
    timer.take()  # (no earlier report step: NaN)
    forward(30.0)
    timer.skip()  # the step that compiled
    forward(0.25)
    assert math.isnan(timer.take())  # not 0.5, the forward of the report step before the skipped one
    forward(0.125)
    assert timer.take() == 0.25

"""An error inside the agent on one rank must not skip the report's all-gather that the other
ranks enter: the collective sequence of every rank stays aligned (no hang, no mismatched DDP
all-reduce). The job-level loss the controller gets is the mean of the gathered ranks' losses
(NaN when one rank's is), each rank's own stays per rank."""

from __future__ import annotations

import gc
import math
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed

WORLD = 2


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=8))
    import trainer_agent as ta
    from trainer_agent.report.pipeline import ReportPipeline

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    agent = ta.attach(ddp, opt, job="ddp", run="ddp-err",
                      config=ta.AgentConfig(metrics_port=None, report_every=2, per_layer="rank0"))
    original = ReportPipeline._layer_metrics
    calls = {"n": 0}

    def failing_once(self, *args, **kwargs):  # only rank 0 computes per-layer metrics
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected per-layer failure")
        return original(self, *args, **kwargs)

    ReportPipeline._layer_metrics = failing_once
    losses = []
    for step in range(4):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = ddp(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        losses.append(float(loss))
    latest = agent.latest()
    steps: list[int] = [None] * WORLD  # type: ignore[list-item]
    dist.all_gather_object(steps, agent.step)  # the ranks' collectives still line up
    torch.save({"latest": latest, "rank_values": agent.rank_values, "losses": losses, "steps": steps},
               f"{out}/rank{rank}.pt")
    agent.close()
    del agent, ddp  # DDP holds the process group: free it before the group goes (clean exit)
    gc.collect()
    dist.destroy_process_group()


def test_error_on_one_rank_keeps_the_report_gather(tmp_path) -> None:
    out = spawn_ranks(_worker, WORLD, tmp_path)
    assert out[0]["steps"] == out[1]["steps"] == [4, 4]
    assert out[0]["latest"]["trainguard_agent_errors_total"] == 1.0
    assert out[1]["latest"]["trainguard_agent_errors_total"] == 0.0
    # The second report (step 4) was gathered normally on both ranks: the leader holds every
    # rank's step-4 loss, the other rank its own.
    want = [out[k]["losses"][3] for k in range(WORLD)]
    for r, expected in enumerate([want] + [[w] for w in want[1:]]):
        got = out[r]["rank_values"]["loss"]
        assert len(got) == len(expected), (r, got)
        assert all(math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, expected)), (got, expected)


#: The loss each rank hands end_step at steps 1..4 (data parallelism: each its own batch); rank 1's
#: third is NaN.
LOCAL_LOSSES = ([1.0, 2.0, 3.0, 4.0], [3.0, 5.0, math.nan, 8.5])


def _reporting_rank(rank: int, init: str, run: str, report_every: int):  # type: ignore[no-untyped-def]
    """This rank's process group joined, and an agent attached that reports to the fake controller."""
    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
    import trainer_agent as ta

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="ddp", run=run, config=ta.AgentConfig(
        metrics_port=None, report_every=report_every, controller=os.environ["TG_FAKE_CONTROLLER"]))
    return agent, model, opt


def _loss_worker(rank: int, init: str, out: str) -> None:
    agent, model, opt = _reporting_rank(rank, init, "ddp-loss", 1)
    latest = []
    for loss in LOCAL_LOSSES[rank]:
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        latest.append(agent.latest().get("trainguard_loss"))
    agent.close(timeout=10.0)
    torch.save({"latest": latest}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_the_job_loss_is_the_mean_of_the_ranks_losses_and_a_nan_on_one_rank_shows(tmp_path, monkeypatch) -> None:
    from tests.control.fake_controller import FakeController

    with FakeController() as fake:
        monkeypatch.setenv("TG_FAKE_CONTROLLER", fake.url)
        out = spawn_ranks(_loss_worker, WORLD, tmp_path)
        reports = sorted(fake.reports, key=lambda r: r.step_last)
    assert [r.step_last for r in reports] == [1, 2, 3, 4]
    for i, report in enumerate(reports):
        local = [LOCAL_LOSSES[r][i] for r in range(WORLD)]
        mean = (local[0] + local[1]) / 2  # 2.0, 3.5, NaN, 6.25
        job = report.values["trainguard_loss"]
        assert (math.isnan(job) and math.isnan(mean)) or job == mean, (i, job, mean)
        assert [x if x == x else "nan" for x in report.ranks.loss] == [x if x == x else "nan" for x in local]
    assert math.isnan(reports[2].values["trainguard_loss"])
    # each rank's own metric stays its own loss (what its /metrics serves, labelled with its rank)
    for r in range(WORLD):
        assert [x if x == x else "nan" for x in out[r]["latest"]] == [x if x == x else "nan" for x in LOCAL_LOSSES[r]]


#: Per step, each rank's loss for end_step (None: an optimizer step without a loss or a gradient).
SPARSE_LOSSES = ([1.0, 2.0, None, None, 5.0, None, None, None], [3.0, 4.0, None, None, math.nan, None, None, None])


def _sparse_loss_worker(rank: int, init: str, out: str) -> None:
    agent, model, opt = _reporting_rank(rank, init, "ddp-sparse-loss", 2)
    rank_values = []
    for loss in SPARSE_LOSSES[rank]:
        if loss is not None:
            model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        agent.end_step(loss)
        rank_values.append({k: agent.rank_values.get(k) for k in ("loss", "grad_norm")})
    agent.close(timeout=10.0)
    torch.save({"rank_values": rank_values}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_a_report_without_a_loss_or_a_gradient_sends_no_nan_for_them(tmp_path, monkeypatch) -> None:
    """Steps without a loss and without a gradient on every rank: the report's loss and gradient
    norm vectors are empty (absent), not a NaN per rank that the controller's rules read as a
    non-finite loss; a real NaN on one rank still shows, in one report."""
    from tests.control.fake_controller import FakeController

    with FakeController() as fake:
        monkeypatch.setenv("TG_FAKE_CONTROLLER", fake.url)
        out = spawn_ranks(_sparse_loss_worker, WORLD, tmp_path)
        reports = sorted(fake.reports, key=lambda r: r.step_last)
    assert [r.step_last for r in reports] == [1, 2, 4, 6, 8]
    reports = reports[1:]  # (step 1's report: a loss like step 2's)
    assert list(reports[0].ranks.loss) == [2.0, 4.0] and len(reports[0].ranks.grad_norm) == WORLD
    for report in (reports[1], reports[3]):  # no step of the interval had a loss, nor a gradient
        assert list(report.ranks.loss) == [] and list(report.ranks.grad_norm) == []
        assert "trainguard_loss" not in report.values and "trainguard_grad_norm" not in report.values
    assert [x if x == x else "nan" for x in reports[2].ranks.loss] == [5.0, "nan"]
    assert math.isnan(reports[2].values["trainguard_loss"]) and list(reports[2].ranks.grad_norm) == []
    for r in range(WORLD):  # each rank's own: the leader's every rank, the other its own
        assert out[r]["rank_values"][3] == {"loss": [], "grad_norm": []}
        assert len(out[r]["rank_values"][1]["loss"]) == (WORLD if r == 0 else 1)

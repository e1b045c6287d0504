"""Rollback and the spike guard on 2 gloo ranks.

- A rollback asked by the controller (``rollback_seq`` + ``rollback_step``) is applied by both
  ranks at the same step, and leaves the weights, the optimizer state, the LR scheduler and the
  GradScaler bitwise equal to what each rank recorded itself right after the snapshot's step.
- The spike guard's decision is agreed: a poisoned batch on rank 1 only makes both ranks skip the
  same step, and rank 0's weights and optimizer state are unchanged by it.
"""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks

pytestmark = pytest.mark.distributed

WORLD = 2


def _state(model: nn.Module, opt: torch.optim.Optimizer, sched, scaler) -> dict:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "opt": {k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in v.items()}
                for k, v in opt.state_dict()["state"].items()},
        "sched": dict(sched.state_dict()),
        "scaler": dict(scaler.state_dict()),
        "lr": [g["lr"] for g in opt.param_groups],
    }


def _rollback_worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
    import trainer_agent as ta
    from tests.control.fake_controller import FakeController

    fake = FakeController() if rank == 0 else None
    url = [fake.url if fake else None]
    dist.broadcast_object_list(url, src=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    agent = ta.attach(model, opt, job="rb", run="rb-run", scaler=scaler, lr_scheduler=sched, controller=url[0],
                      config=ta.AgentConfig(metrics_port=None, report_every=5, snapshot_every=10, snapshot_keep=8,
                                            request_timeout_s=5.0))
    g = torch.Generator().manual_seed(rank)
    recorded: dict[int, dict] = {}
    result = None
    for step in range(1, 400):
        x = torch.randn(16, 8, generator=g)
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        sched.step()
        pre = _state(model, opt, sched, scaler)
        agent.end_step(loss.detach())
        if step % 10 == 0:
            recorded[step] = _state(model, opt, sched, scaler)
        if fake is not None and step == 25:
            fake.command("rb-run", rollback_seq=1, rollback_step=20, reason="test rollback")
        done = [h for h in agent.control.history if h.rollback_seq == 1]
        if done:  # the same step on every rank: the history is agreed
            result = {"applied": (done[0].generation, done[0].step, done[0].restored_step),
                      "after": _state(model, opt, sched, scaler), "pre": pre,
                      "snapshot_step": agent.latest().get("trainguard_snapshot_step"),
                      "rollbacks": agent.latest()["trainguard_rollbacks_total"]}
            break
    result = result or {"applied": None}
    result["recorded"] = recorded.get(20)
    agent.close()
    if fake is not None:
        fake.close()
    del agent
    gc.collect()
    dist.destroy_process_group()
    torch.save(result, f"{out}/rank{rank}.pt")


def _assert_equal(a: dict, b: dict) -> None:
    assert len(a["params"]) == len(b["params"])
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    assert a["opt"].keys() == b["opt"].keys()
    for k in a["opt"]:
        for n in a["opt"][k]:
            x, y = a["opt"][k][n], b["opt"][k][n]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (k, n)
    assert a["sched"] == b["sched"]
    assert a["scaler"] == b["scaler"]
    assert a["lr"] == b["lr"]


def test_rollback_restores_the_snapshot_bitwise_at_the_same_step_on_every_rank(tmp_path) -> None:
    out = spawn_ranks(_rollback_worker, WORLD, tmp_path, timeout=120.0)
    assert out[0]["applied"] is not None, "the rollback was never applied"
    assert out[0]["applied"] == out[1]["applied"]  # same generation, same step, same snapshot
    generation, step, restored = out[0]["applied"]
    assert step > 25 and restored == 20
    for o in out:
        assert o["rollbacks"] == 1.0 and o["snapshot_step"] == 20.0  # newer snapshots dropped
        _assert_equal(o["after"], o["recorded"])
        with pytest.raises(AssertionError):  # the state just before the rollback was another one
            _assert_equal(o["pre"], o["recorded"])


def _spike_worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
    import trainer_agent as ta

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    agent = ta.attach(model, opt, job="sg", run="sg-run",
                      config=ta.AgentConfig(metrics_port=None, report_every=10, skip_spikes=True))
    g = torch.Generator().manual_seed(rank)
    skipped_at = []
    before = after = None
    for step in range(1, 121):
        x = torch.randn(32, 8, generator=g)
        if rank == 1 and step == 90:
            x = x * 1e4  # a poisoned batch on rank 1 only
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        loss.backward()
        n = agent.control.skip.skipped
        if step == 90:
            before = _state_plain(model, opt)
        opt.step()
        if step == 90:
            after = _state_plain(model, opt)
        if agent.control.skip.skipped > n:
            skipped_at.append(step)
        opt.zero_grad()
        agent.end_step(loss.detach())
    res = {"skipped_at": skipped_at, "by_reason": dict(agent.control.skip.skipped_by_reason),
           "before": before, "after": after}
    agent.close()
    del agent
    gc.collect()
    dist.destroy_process_group()
    torch.save(res, f"{out}/rank{rank}.pt")


def _state_plain(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"params": [p.detach().clone() for p in model.parameters()],
            "opt": {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()},
            "sched": {}, "scaler": {}, "lr": [g["lr"] for g in opt.param_groups]}


def test_spike_guard_decision_is_the_same_on_every_rank(tmp_path) -> None:
    out = spawn_ranks(_spike_worker, WORLD, tmp_path, timeout=120.0)
    assert out[0]["skipped_at"] == out[1]["skipped_at"] == [90]
    assert out[0]["by_reason"] == out[1]["by_reason"] == {"spike": 1, "nonfinite": 0, "data": 0}
    _assert_equal(out[0]["before"], out[0]["after"])  # rank 0 saw a healthy batch and did not step either

"""A hardware fault end to end: two gloo ranks (DDP) and a real ``trainguard serve`` whose rules
stop a run with a faulty node (``recovery.ladders.hardware: [checkpoint, stop]``). From step 30
rank 1's device computes wrong values (one activation element's sign flipped, a different element
on every pass, as a failing unit does), so the gradient recompute check (every 5th step) does not
reproduce its gradient there. The controller's verdict is ``hardware`` naming rank 1 and its node;
every rank checkpoints at the same step, then stops at the same step with the documented exit
status: decided within a report of the recompute, applied at the first agreement after the
leader's client has it. A healthy run with post-local SGD (its ranks hold different values by
design) is neither checkpointed nor stopped."""

from __future__ import annotations

import itertools
import os
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
import yaml

from tests.control.procs import ROOT, ControllerProcess
from tests.control.spawn import spawn_ranks
from trainguard.protocol.wire import EXIT_HARDWARE_FAULT

pytestmark = pytest.mark.distributed

WORLD, ONSET, RUN = 2, 30, "hardware-e2e"


def _worker(rank: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    os.environ["TRAINGUARD_NODE_NAME"] = f"gpu-node-{rank}"  # each rank on a node of its own (one host here)
    import trainer_agent as ta

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    checkpoints: list[int] = []
    agent = ta.attach(model, opt, job="hw", run=RUN, controller=os.environ["TG_TEST_URL"], on_checkpoint=checkpoints.append,
                      config=ta.AgentConfig(metrics_port=0, metrics_host="127.0.0.1", report_every=1, verify_every=5,
                                            request_timeout_s=5.0))
    passes = itertools.count()
    step_box = [0]

    def faulty(module, inputs, output):  # rank 1's device from the onset: a wrong value, never the same one
        if rank == 1 and step_box[0] >= ONSET:
            output = output.clone()
            flat = output.view(-1)
            i = next(passes) % flat.numel()
            flat[i] = -flat[i]
            return output
        return None

    net[0].register_forward_hook(faulty)
    g = torch.Generator().manual_seed(rank)
    loss_fn = lambda m, b: (m(b[0]) - b[1]).square().mean()  # noqa: E731
    verified = []
    for step in range(1, 200):
        step_box[0] = step
        x = torch.randn(16, 8, generator=g)
        batch = (x, x.sum(1, keepdim=True))
        loss = loss_fn(model, batch)
        loss.backward()
        checked = agent.verify_step(batch, loss_fn)
        if checked is not None:
            verified.append([checked.step, checked.mismatch])
        opt.step()
        opt.zero_grad()
        agent.end_step(loss.detach())
        if agent.should_stop:
            break
    code = agent.exit_code
    history = [[h.generation, h.step, h.paused, h.lr_scale, h.checkpoint_seq, h.stop] for h in agent.control.history]
    agent.close(5.0)
    torch.save({"stopped_at": agent.step, "code": code, "checkpoints": checkpoints, "verified": verified,
                "history": history}, Path(out) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("ctl")
    rules = yaml.safe_load((ROOT / "service" / "default_rules.yaml").read_text())
    rules.setdefault("recovery", {})["ladders"] = {"hardware": ["checkpoint", "stop"]}
    (d / "rules.yaml").write_text(yaml.safe_dump(rules))
    ctl = ControllerProcess(d / "trainguard.db", rules=d / "rules.yaml").start()
    yield ctl
    ctl.kill()


def test_a_rank_whose_device_computes_wrong_values_is_named_checkpointed_and_stopped(controller, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TG_TEST_URL", controller.url)
    logs = spawn_ranks(_worker, WORLD, tmp_path, timeout=300.0)
    first_bad = min(s for s, mismatch in logs[1]["verified"] if mismatch)
    assert first_bad >= ONSET and not any(m for _, m in logs[0]["verified"])  # only the faulty rank's check fails
    assert logs[0]["history"] == logs[1]["history"]  # every generation applied at the same step
    assert logs[0]["checkpoints"] == logs[1]["checkpoints"] and logs[0]["checkpoints"]
    assert logs[0]["stopped_at"] == logs[1]["stopped_at"]
    assert first_bad <= logs[0]["checkpoints"][0] <= logs[0]["stopped_at"]
    assert logs[0]["code"] == logs[1]["code"] == EXIT_HARDWARE_FAULT
    assert all(h[3] == 1.0 for h in logs[0]["history"])  # the LR was never touched

    detail = httpx.get(f"{controller.url}/v1/runs/{RUN}", timeout=10).json()
    assert [(r["rank"], r["host"], r["node"]) for r in detail["ranks"]] == [(0, "127.0.0.1", "gpu-node-0"), (1, "127.0.0.1", "gpu-node-1")]
    host = "gpu-node-1"  # the node it registered, not its /metrics host (127.0.0.1 on every node)
    (incident,) = httpx.get(f"{controller.url}/v1/runs/{RUN}/incidents", timeout=10).json()["incidents"]
    assert incident["cause"] == "hardware" and (incident["verdict"]["ranks"], incident["verdict"]["hosts"]) == ([1], [host])
    assert [r["rung"] for r in incident["rungs"]] == ["checkpoint", "stop"] and incident["outcome"] == "escalated"
    # Decided within a report of the failing recompute (report_every=1). The ranks apply it at the
    # first agreement after the leader's client has it: a round trip the agent never waits for, so
    # its length in steps depends on how fast the machine trains (3 steps idle, 11 with the cores taken).
    checkpoint, stop = incident["rungs"]
    assert first_bad <= checkpoint["step"] <= stop["step"] <= first_bad + 1, incident["rungs"]
    def applied(generation: int) -> int:  # the step of the first state applied that holds it (states fold)
        return next(h[1] for h in logs[0]["history"] if h[0] >= generation)

    assert checkpoint["step"] < applied(checkpoint["generation"]) == logs[0]["checkpoints"][0]
    assert stop["step"] < applied(stop["generation"]) == logs[0]["stopped_at"]
    assert f"rank 1 on {host}" in incident["rungs"][1]["reason"]
    assert f"exit status {EXIT_HARDWARE_FAULT}" in detail["finish_reason"]


def _local_sgd_worker(rank: int, init: str, out: str) -> None:
    """A healthy run with post-local SGD (the ranks step on their own gradients between averaging steps)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    import trainer_agent as ta
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    model.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=dist.new_subgroups(group_size=1)[0],
                                               start_localSGD_iter=10), post_localSGD_hook)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = PostLocalSGDOptimizer(optim=inner, averager=PeriodicModelAverager(period=10, warmup_steps=10))
    agent = ta.attach(model, inner, job="hw", run=RUN + "-localsgd", controller=os.environ["TG_TEST_URL"],
                      config=ta.AgentConfig(metrics_port=0, metrics_host="127.0.0.1", report_every=2,
                                            request_timeout_s=5.0))
    g = torch.Generator().manual_seed(rank)
    target = torch.randn(8, 1, generator=torch.Generator().manual_seed(1))
    for _ in range(60):
        x = torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        loss.backward()
        opt.step()
        agent.end_step(loss.detach())
    history = [[h.generation, h.paused, h.checkpoint_seq, h.stop] for h in agent.control.history]
    agent.close(5.0)
    torch.save({"history": history, "code": agent.exit_code}, Path(out) / f"rank{rank}.pt")


def test_post_local_sgd_is_neither_checkpointed_nor_stopped_as_a_hardware_fault(controller, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TG_TEST_URL", controller.url)
    logs = spawn_ranks(_local_sgd_worker, WORLD, tmp_path, timeout=300.0)
    assert all(not paused and not seq and not stop for log in logs for _, paused, seq, stop in log["history"])
    assert logs[0]["code"] == logs[1]["code"] == 0
    run = RUN + "-localsgd"
    detail = httpx.get(f"{controller.url}/v1/runs/{run}", timeout=10).json()
    assert detail["desired"]["generation"] == 0 and detail["last_step"] >= 20
    assert httpx.get(f"{controller.url}/v1/runs/{run}/incidents", timeout=10).json()["incidents"] == []
    alerts = httpx.get(f"{controller.url}/v1/alerts", params={"run": run}, timeout=10).json()
    assert [a["rule"] for a in alerts if a["rule"] in ("grad_desync", "param_desync")] == []

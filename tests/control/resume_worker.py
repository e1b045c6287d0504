"""One rank of a job that dies and is restarted from an earlier checkpoint (gloo, CPU). Run as a
script, as ``dist_worker.py`` is (``RANK``, ``WORLD_SIZE``, ``DIST_INIT_METHOD``; a JSON config):

``"phase": "first"``
    Train with Adam, save the model, optimizer, scheduler and every rank's agent state at
    ``ckpt_step``, and die without closing anything at ``crash_step`` (``os._exit``), or with
    ``"crash_after_ack"`` at the first step after the controller recorded an applied generation.
``"phase": "resume"``
    Attach to the same run, load that checkpoint (the step goes back to ``ckpt_step``) and train to
    ``max_steps`` or until the controller stops the run; write this rank's applied generations
    (``ControlPlane.history``), ``on_checkpoint`` calls and the steps skipped for their data (the
    controller's data skip) to ``out``/resume-rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import trainer_agent as ta  # noqa: E402

torch.set_num_threads(1)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    x = torch.randn(16, 8, generator=g)
    return x, (x ** 2).sum(dim=1, keepdim=True) * 0.3


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: torch.optim.lr_scheduler.LRScheduler,
           batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One optimizer step (and 5 ms of "device" time); its loss."""
    loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    time.sleep(0.005)
    return loss


def _acked(agent: ta.Agent, cfg: dict) -> bool:
    """With ``"crash_after_ack"``: whether the leader's client has sent an ack (the controller
    recorded an applied generation), the same answer on every rank (a broadcast)."""
    if not cfg.get("crash_after_ack"):
        return False
    client = agent.control.client
    flag = torch.tensor([int(client is not None and client.counts.acks_sent > 0)])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _recorded(act: object, steps: list[int]) -> None:
    """``act`` (a sequence command's actuator) appends the step to ``steps`` each time it acts."""
    original = act.act  # type: ignore[attr-defined]

    def recorded(new: object, step: int) -> None:
        steps.append(step)
        original(new, step)

    act.act = recorded  # type: ignore[attr-defined]


def _record_acts(agent: ta.Agent) -> dict[str, list[int]]:
    """The steps at which the rollback and the optimizer reset actuators act (filled as they do)."""
    acted: dict[str, list[int]] = {"rollback": [], "reset_optimizer": []}
    for name, steps in acted.items():
        _recorded(agent.control.actuators[name], steps)
    return acted


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["DIST_INIT_METHOD"], rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    out, first = Path(cfg["out"]), cfg["phase"] == "first"
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: min(1.0, (e + 1) / 20))
    checkpoints: list[int] = []
    agent = ta.attach(model, opt, job="resume-job", run=cfg["run"], lr_scheduler=sched, on_checkpoint=checkpoints.append,
                      config=ta.AgentConfig(controller=cfg["controller"], report_every=1, metrics_port=None,
                                            request_timeout_s=2.0))
    acted = _record_acts(agent)
    saved, step = out / "checkpoint.pt", 0
    if cfg["phase"] == "resume":
        state = torch.load(saved, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        agent.load_state_dict(state["agent"][rank])
        step = state["step"]
    data_skipped: list[int] = []  # the steps whose optimizer step was skipped for their data
    while not agent.should_stop and step < cfg["max_steps"] and agent.control.applied_generation < cfg.get(
            "until_generation", float("inf")):
        step += 1
        skipped = agent.control.skip.skipped_by_reason["data"]
        agent.end_step(_train(model, opt, sched, _batch(rank, step)))
        if agent.control.skip.skipped_by_reason["data"] > skipped:
            data_skipped.append(step)
        if first and step == cfg["ckpt_step"]:
            states: list[object] = [None] * world
            dist.all_gather_object(states, agent.state_dict())
            if rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                            "agent": states, "step": step}, saved)
            dist.barrier()
        if first and (step == cfg["crash_step"] or _acked(agent, cfg)):
            os._exit(1)  # the job dies: nothing closed, nothing flushed
        if step == 1:
            (out / f"started-rank{rank}").touch()
    history = [[a.generation, a.step, a.paused, a.lr_scale, a.checkpoint_seq, a.stop] for a in agent.control.history]
    agent.close(3.0)
    (out / f"resume-rank{rank}.json").write_text(json.dumps({
        "history": history, "checkpoints": checkpoints, "data_skipped": data_skipped, "acted": acted,
        "lr_scale": agent.control.lr_scale, "step": step}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One rank of the multi-process control tests (gloo, CPU). Run as a script:

    RANK=r WORLD_SIZE=n DIST_INIT_METHOD=file:///tmp/x/store python dist_worker.py '<json>'

(``DIST_INIT_METHOD`` is the process group's init method; without it, ``env://`` with
MASTER_ADDR/MASTER_PORT.)

The JSON names the scenario and where to write this rank's log (``out``/<name>-rank<r>.json):

``trials``
    For each of ``trials`` runs ``<prefix>-<k>``: attach an agent to a small DDP model and train
    until the controller says stop (the test drives pause/resume/lr-scale/checkpoint/stop at
    random moments), with a random per-rank sleep per step. All trials share one process group.
``restart``
    Attach to a run that is paused already (a restarted job): every rank waits in ``attach``
    (the non-leaders on the store) until the test resumes it, then trains ``max_steps`` steps.
``pause``
    Train with ``skip_nonfinite``; at ``nan_step`` every rank's batch holds a NaN, so the
    controller's default rule pauses the run; the test resumes it with ``trainguard resume``
    after a pause longer than the (deliberately short) process-group timeout, then the run goes
    on to ``steps``. Then the negative control: rank 0 sleeps as long as that pause while the
    other ranks enter a collective, which must fail with the group's timeout.

Each log records, per optimizer step, the LR the optimizer used and the scheduler's LR, the
generations this rank applied (``ControlPlane.history``), the on_checkpoint calls and step times,
and the gradient recompute checks the controller's ``verify`` command asked for.

``"parallel": "fsdp"`` in the JSON shards the model with FSDP2 (``fully_shard`` per layer and at
the root) instead of wrapping it in DDP.
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
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
BASE_LR = 0.05


def lr_lambda(epoch: int) -> float:
    """The scheduler's factor; the test recomputes it independently."""
    return 1.0 / (1.0 + 0.01 * epoch)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    x = torch.randn(8, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.1


def _parallel(cfg: dict, model: torch.nn.Module) -> torch.nn.Module:
    if cfg.get("parallel", "ddp") == "ddp":
        return DDP(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def run_one(cfg: dict, rank: int, run: str, *, nan_step: int | None = None) -> dict:
    """Train one run until the controller stops it (or ``max_steps``); return this rank's log."""
    rng = random.Random(f"{run}/{rank}")
    model = _parallel(cfg, _model())  # its set-up collectives run under the long start-up timeout
    if "pg_timeout_s" in cfg:  # every rank is here: from now on the short timeout the scenario asks for
        dist.barrier()
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=cfg["pg_timeout_s"]))
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    checkpoints: list[int] = []
    agent = ta.attach(
        model, opt, job="ctl-test", run=run, lr_scheduler=sched, on_checkpoint=checkpoints.append,
        config=ta.AgentConfig(controller=cfg["controller"], report_every=cfg.get("report_every", 1),
                              metrics_port=None, request_timeout_s=2.0,
                              skip_nonfinite=cfg.get("skip_nonfinite", False)),
    )
    attached_at = time.time()  # attach returns only once the run is not paused
    steps: list[list[float]] = []  # step, lr used, scheduler lr, scheduler epoch, end time, step s
    used: list[float] = []
    verified: list[list] = []  # step, rel_diff, bitwise, mismatch, float32 rel_diff of each recompute check
    opt.register_step_pre_hook(lambda o, a, k: used.append(float(o.param_groups[0]["lr"])))
    attach_state = [agent.control.applied_generation, agent.control.paused, agent.control.lr_scale, agent.step]
    t_last = time.monotonic()
    step = 0
    while not agent.should_stop and step < cfg["max_steps"]:
        step += 1
        x, y = _batch(rank, step)
        if step == nan_step:
            x[0, 0] = math.nan
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.get("autocast", False)):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        checked = agent.verify_step((x, y), lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1]))
        if checked is not None:  # the controller's verify command: the step after the one it was applied at
            verified.append([checked.step, checked.rel_diff, checked.bitwise, checked.mismatch,
                             checked.float32_rel_diff])
        used.clear()
        sched_lr, epoch = sched.get_last_lr()[0], sched.last_epoch
        opt.step()
        opt.zero_grad()
        sched.step()
        time.sleep(rng.uniform(0.0, cfg.get("jitter_s", 0.0)))
        agent.end_step(loss)
        now = time.monotonic()
        steps.append([step, used[0] if used else math.nan, sched_lr, epoch, time.time(), now - t_last])
        t_last = now
    history = [[a.generation, a.step, a.paused, a.lr_scale, a.checkpoint_seq, a.stop, a.time]
               for a in agent.control.history]
    t0 = time.monotonic()
    agent.close(3.0)
    return {"run": run, "rank": rank, "steps": steps, "history": history, "checkpoints": checkpoints,
            "attached_at": attached_at, "attach_state": attach_state, "verified": verified,
            "stopped": agent.should_stop, "close_s": time.monotonic() - t0,
            "skipped": agent.latest().get('trainguard_skipped_steps_total{reason="nonfinite"}', 0.0)}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ.get("DIST_INIT_METHOD", "env://"), rank=rank,
                            world_size=world, timeout=timedelta(seconds=180))
    out = Path(cfg["out"])
    if cfg["scenario"] == "trials":
        logs = [run_one(cfg, rank, f"{cfg['prefix']}-{k}") for k in range(cfg["trials"])]
        (out / f"trials-rank{rank}.json").write_text(json.dumps(logs))
    elif cfg["scenario"] == "restart":
        log = run_one(cfg, rank, cfg["prefix"])
        (out / f"restart-rank{rank}.json").write_text(json.dumps(log))
    elif cfg["scenario"] == "pause":
        log = run_one(cfg, rank, cfg["prefix"], nan_step=cfg["nan_step"])
        (out / f"pause-rank{rank}.json").write_text(json.dumps(log))
        # negative control: a pause that waits in a collective instead of on the store
        t0 = time.monotonic()
        error = ""
        if rank == 0:
            time.sleep(cfg["naive_pause_s"])
        else:
            try:
                dist.all_reduce(torch.zeros(1))
            except Exception as exc:  # noqa: BLE001 - the failure is what we measure
                error = f"{type(exc).__name__}: {exc}"
        neg = {"rank": rank, "error": error[:500], "after_s": time.monotonic() - t0}
        (out / f"negative-rank{rank}.json").write_text(json.dumps(neg))
        os._exit(0)  # the group is broken by design now; do not wait on it at exit
    gc.collect()  # the runs' DDP models hold the process group: free them before it goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

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

A JSON with a ``phase`` is one process of a job that dies and is restarted from an earlier
checkpoint (run ``run``; its ``scenario`` names only its files), training a wider model with Adam
and a warm-up (:data:`CHECKPOINTED`), 5 ms a step:

``"phase": "first"``
    Save the model, optimizer, scheduler and every rank's agent state at ``ckpt_step``, and die
    without closing anything in ``crash_step`` (``os._exit`` once the steps before it were
    reported), or with ``"crash_after_ack"`` at the first step after the controller recorded an
    applied generation.
``"phase": "resume"``
    Load that checkpoint after attaching (the step goes back to ``ckpt_step``).
Any phase
    Train to ``max_steps``, until the controller stops the run, or until the applied generation
    reaches ``until_generation``; touch ``out``/started-rank<r> after step 1; write the log to
    ``out``/resume-rank<r>.json, with the steps skipped for their data (the controller's data skip),
    the steps at which the rollback and optimizer reset actuators acted, and the history without
    its times (which differ between ranks).
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

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


@dataclass(frozen=True)
class Recipe:
    """What a scenario trains: the job it reports as, the model's hidden width, the rows of a
    batch and its target, the optimizer, the scheduler's factor and the time a step takes at the
    least."""

    job: str
    hidden: int
    rows: int
    target: Callable[[torch.Tensor], torch.Tensor]
    optimizer: Callable[..., torch.optim.Optimizer]
    lr_factor: Callable[[int], float]
    step_s: float = 0.0


SCENARIOS = Recipe("ctl-test", 16, 8, lambda x: x.sum(dim=1, keepdim=True) * 0.1,
                   lambda params: torch.optim.SGD(params, lr=BASE_LR), lr_lambda)
CHECKPOINTED = Recipe("resume-job", 64, 16, lambda x: (x ** 2).sum(dim=1, keepdim=True) * 0.3,
                      lambda params: torch.optim.Adam(params, lr=3e-3), lambda e: min(1.0, (e + 1) / 20), 0.005)


def _model(recipe: Recipe = SCENARIOS) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, recipe.hidden), torch.nn.Tanh(), torch.nn.Linear(recipe.hidden, 1))


def _batch(rank: int, step: int, recipe: Recipe = SCENARIOS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    x = torch.randn(recipe.rows, 8, generator=g)
    return x, recipe.target(x)


def _parallel(cfg: dict, model: torch.nn.Module) -> torch.nn.Module:
    if cfg.get("parallel", "ddp") == "ddp":
        return DDP(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _recorded(act: object, steps: list[int]) -> None:
    """``act`` (a sequence command's actuator) appends the step to ``steps`` each time it acts."""
    original = act.act  # type: ignore[attr-defined]

    def recorded(new: object, step: int) -> None:
        steps.append(step)
        original(new, step)

    act.act = recorded  # type: ignore[attr-defined]


class Job:
    """One run on this rank: the model, optimizer and scheduler of ``recipe`` with an agent
    attached, trained step by step, and what it logs."""

    def __init__(self, cfg: dict, rank: int, run: str, recipe: Recipe) -> None:
        self.cfg, self.rank, self.run, self.recipe = cfg, rank, run, recipe
        self.rng = random.Random(f"{run}/{rank}")
        self.model = _parallel(cfg, _model(recipe))  # its set-up collectives run under the long start-up timeout
        if "pg_timeout_s" in cfg:  # every rank is here: from now on the short timeout the scenario asks for
            dist.barrier()
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=cfg["pg_timeout_s"]))
        self.opt = recipe.optimizer(self.model.parameters())
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, recipe.lr_factor)
        self.checkpoints: list[int] = []
        self.agent = ta.attach(
            self.model, self.opt, job=recipe.job, run=run, lr_scheduler=self.sched,
            on_checkpoint=self.checkpoints.append,
            config=ta.AgentConfig(controller=cfg["controller"], report_every=cfg.get("report_every", 1),
                                  metrics_port=None, request_timeout_s=2.0,
                                  skip_nonfinite=cfg.get("skip_nonfinite", False)),
        )
        self.attached_at = time.time()  # attach returns only once the run is not paused
        control = self.agent.control
        self.attach_state = [control.applied_generation, control.paused, control.lr_scale, self.agent.step]
        self.acted: dict[str, list[int]] = {"rollback": [], "reset_optimizer": []}  # the steps they acted at
        for name, steps in self.acted.items():
            _recorded(control.actuators[name], steps)
        self.used: list[float] = []
        self.opt.register_step_pre_hook(lambda o, a, k: self.used.append(float(o.param_groups[0]["lr"])))
        self.steps: list[list[float]] = []  # step, lr used, scheduler lr, scheduler epoch, end time, step s
        self.verified: list[list] = []  # step, rel_diff, bitwise, mismatch, float32 rel_diff of each recompute check
        self.data_skipped: list[int] = []  # the steps whose optimizer step was skipped for their data
        self.step = 0
        self.t_last = time.monotonic()

    def training(self) -> bool:
        """Whether to train another step: not stopped, not at ``max_steps`` nor ``until_generation``."""
        return (not self.agent.should_stop and self.step < self.cfg["max_steps"]
                and self.agent.control.applied_generation < self.cfg.get("until_generation", math.inf))

    def train_step(self, nan_step: int | None = None) -> None:
        """One optimizer step on this rank's batch (a NaN in it at ``nan_step``), logged."""
        agent, model, cfg = self.agent, self.model, self.cfg
        self.step += 1
        skipped = agent.control.skip.skipped_by_reason["data"]  # (counted by the optimizer's step)
        x, y = _batch(self.rank, self.step, self.recipe)
        if self.step == nan_step:
            x[0, 0] = math.nan
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.get("autocast", False)):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        checked = agent.verify_step((x, y), lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1]))
        if checked is not None:  # the controller's verify command: the step after the one it was applied at
            self.verified.append([checked.step, checked.rel_diff, checked.bitwise, checked.mismatch,
                                  checked.float32_rel_diff])
        self.used.clear()
        sched_lr, epoch = self.sched.get_last_lr()[0], self.sched.last_epoch
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        time.sleep(self.recipe.step_s + self.rng.uniform(0.0, cfg.get("jitter_s", 0.0)))
        agent.end_step(loss)
        if agent.control.skip.skipped_by_reason["data"] > skipped:
            self.data_skipped.append(self.step)
        now = time.monotonic()
        self.steps.append([self.step, self.used[0] if self.used else math.nan, sched_lr, epoch, time.time(),
                           now - self.t_last])
        self.t_last = now

    def close(self) -> dict:
        """Close the agent; this rank's log."""
        agent = self.agent
        history = [[a.generation, a.step, a.paused, a.lr_scale, a.checkpoint_seq, a.stop, a.time]
                   for a in agent.control.history]
        t0 = time.monotonic()
        agent.close(3.0)
        return {"run": self.run, "rank": self.rank, "steps": self.steps, "history": history,
                "checkpoints": self.checkpoints, "attached_at": self.attached_at, "attach_state": self.attach_state,
                "verified": self.verified, "stopped": agent.should_stop, "close_s": time.monotonic() - t0,
                "skipped": agent.latest().get('trainguard_skipped_steps_total{reason="nonfinite"}', 0.0),
                "data_skipped": self.data_skipped, "acted": self.acted, "lr_scale": agent.control.lr_scale,
                "step": self.step}


def run_one(cfg: dict, rank: int, run: str, *, nan_step: int | None = None) -> dict:
    """Train one run until the controller stops it (or ``max_steps``); return this rank's log."""
    job = Job(cfg, rank, run, SCENARIOS)
    while job.training():
        job.train_step(nan_step)
    return job.close()


def _save(job: Job, saved: Path, world: int) -> None:
    """Save the model, optimizer, scheduler, step and every rank's agent state (from rank 0)."""
    states: list[object] = [None] * world
    dist.all_gather_object(states, job.agent.state_dict())
    if job.rank == 0:
        torch.save({"model": job.model.state_dict(), "opt": job.opt.state_dict(), "sched": job.sched.state_dict(),
                    "agent": states, "step": job.step}, saved)
    dist.barrier()


def _acked(job: Job, cfg: dict) -> bool:
    """With ``"crash_after_ack"``: whether the leader's client has sent an ack (the controller
    recorded an applied generation), the same answer on every rank (a broadcast)."""
    if not cfg.get("crash_after_ack"):
        return False
    client = job.agent.control.client
    flag = torch.tensor([int(client is not None and client.counts.acks_sent > 0)])
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _delivered(job: Job, reports: int, timeout_s: float = 120.0) -> None:
    """Wait on the leader until its first ``reports`` reports were delivered: a job that dies at the
    next step died after them whatever the machine's load (its sender thread may lag the steps)."""
    client = job.agent.control.client
    deadline = time.monotonic() + timeout_s
    while client is not None and client.counts.reports_sent < reports and time.monotonic() < deadline:
        time.sleep(0.01)


def checkpointed_job(cfg: dict, rank: int, world: int, out: Path) -> None:
    """One process of the job of ``cfg["run"]`` in its ``phase`` (the module's docstring)."""
    first, saved = cfg["phase"] == "first", out / "checkpoint.pt"
    job = Job(cfg, rank, cfg["run"], CHECKPOINTED)
    if cfg["phase"] == "resume":
        state = torch.load(saved, weights_only=False)
        job.model.load_state_dict(state["model"])
        job.opt.load_state_dict(state["opt"])
        job.sched.load_state_dict(state["sched"])
        job.agent.load_state_dict(state["agent"][rank])
        job.step = state["step"]
    while job.training():
        if first and job.step + 1 == cfg.get("crash_step"):
            # The job dies in this step, before it ends: its report cannot race the exit, so the
            # controller holds exactly the steps before it, whatever the machine's load.
            _delivered(job, job.step)
            os._exit(1)  # nothing closed, nothing flushed
        job.train_step()
        if first and job.step == cfg["ckpt_step"]:
            _save(job, saved, world)
        if first and _acked(job, cfg):
            os._exit(1)  # the job dies: nothing closed, nothing flushed
        if job.step == 1:
            (out / f"started-rank{rank}").touch()
    log = job.close()
    log["history"] = [h[:6] for h in log["history"]]
    (out / f"resume-rank{rank}.json").write_text(json.dumps(log))


def negative_control(cfg: dict, rank: int, out: Path) -> None:
    """A pause that waits in a collective instead of on the store: rank 0 sleeps ``naive_pause_s``
    while the others enter a collective, which fails with the group's timeout."""
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


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ.get("DIST_INIT_METHOD", "env://"), rank=rank,
                            world_size=world, timeout=timedelta(seconds=180))
    out = Path(cfg["out"])
    if "phase" in cfg:
        checkpointed_job(cfg, rank, world, out)
    elif cfg["scenario"] == "trials":
        logs = [run_one(cfg, rank, f"{cfg['prefix']}-{k}") for k in range(cfg["trials"])]
        (out / f"trials-rank{rank}.json").write_text(json.dumps(logs))
    elif cfg["scenario"] == "restart":
        log = run_one(cfg, rank, cfg["prefix"])
        (out / f"restart-rank{rank}.json").write_text(json.dumps(log))
    elif cfg["scenario"] == "pause":
        log = run_one(cfg, rank, cfg["prefix"], nan_step=cfg["nan_step"])
        (out / f"pause-rank{rank}.json").write_text(json.dumps(log))
        negative_control(cfg, rank, out)
        os._exit(0)  # the group is broken by design now; do not wait on it at exit
    gc.collect()  # the runs' DDP models hold the process group: free them before it goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

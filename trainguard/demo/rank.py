"""One rank of the demo's training run (:func:`rank_main`) and the healthy run beside it
(:func:`healthy_main`), each in a spawned process."""

from __future__ import annotations

import gc
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from trainguard.demo.config import JOB, DemoConfig
from trainguard.demo.model import FaultPlan

__all__ = ["rank_main", "healthy_main", "training_setup"]


def rank_main(rank: int, cfg_dict: dict[str, Any], init_method: str, controller: str, token: str,
              run: str, log_dir: str) -> None:
    """Train on one rank. Runs in a spawned process."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_agent  # noqa: F401 - imported before the process group is set up

    cfg = DemoConfig(**cfg_dict)
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=cfg.world_size)

    faults = FaultPlan(burst=cfg.burst, lr_blowup=cfg.lr_blowup, lr_blowup_factor=cfg.lr_blowup_factor,
                       nan_step=cfg.nan_step)
    # A schedule that "does not fit the optimizer": the stability guide's opening story.
    model, optimizer, scheduler, corpus = training_setup(cfg, faults)
    ddp = DDP(model)
    lr_used: list[float] = [math.nan]
    # Registered before the agent's hooks, so it runs before the agent restores the scheduler's LR:
    # it sees the LR optimizer.step actually used (scheduler LR x lr_scale).
    optimizer.register_step_post_hook(lambda opt, args, kwargs: lr_used.__setitem__(0, opt.param_groups[0]["lr"]))
    agent = _attach(cfg, model, optimizer, scheduler, run=run, controller=controller, token=token)
    log: list[dict[str, Any]] = []
    step = 0  # steps completed; the step being trained is step + 1, the agent's numbering
    try:
        while step < cfg.steps and not agent.should_stop:
            entry, values = _train_step(cfg, rank, step + 1, agent, ddp, model, optimizer, scheduler,
                                        corpus, faults, lr_used)
            step += 1
            log.append(entry)
            if rank == 0 and not cfg.quiet and step % cfg.report_every == 0:
                print(_status_line(step, cfg.steps, values), flush=True)
    finally:
        agent.close(timeout=5.0)
        Path(log_dir, f"rank{rank}.json").write_text(json.dumps(log))
        # DDP's reducer holds the process group: free it (and the agent's hooks that reach it)
        # before the group goes, so no gloo thread is left for the interpreter's exit to destroy.
        del agent, ddp
        gc.collect()
        dist.destroy_process_group()


def _attach(cfg: DemoConfig, model: Any, optimizer: Any, scheduler: Any, *, run: str, controller: str,
            token: str) -> Any:
    """The agent on this rank, with a data monitor that reacts within the demo."""
    import trainer_agent as ta
    from trainguard.demo.model import CONTROL_BYTE_IDS, VOCAB_SIZE

    window = 32 * cfg.batch_size  # sequences: about 32 steps, so the monitor reacts within the demo
    monitor = ta.DataMonitor(VOCAB_SIZE, special_ids=CONTROL_BYTE_IDS, window=window,
                             reference_tokens=16 * cfg.batch_size * (cfg.seq_len + 1))
    return ta.attach(
        model, optimizer, job=JOB, run=run, lr_scheduler=scheduler, data_monitor=monitor,
        controller=controller, token=token,
        config=ta.AgentConfig(report_every=cfg.report_every, skip_nonfinite=True,
                              metrics_port=cfg.metrics_port, metrics_host=cfg.metrics_host,
                              layer_depth=2, snapshot_every=cfg.snapshot_every, snapshot_keep=cfg.snapshot_keep),
    )


def _train_step(cfg: DemoConfig, rank: int, step: int, agent: Any, ddp: Any, model: Any, optimizer: Any,
                scheduler: Any, corpus: Any, faults: FaultPlan,
                lr_used: list[float]) -> tuple[dict[str, Any], dict[str, float]]:
    """Train step ``step`` (the agent's numbering) on this rank; its log entry and the agent's
    latest values."""
    import torch

    from trainguard.demo.model import next_byte_loss

    ids, mask = corpus.batch(step, rank, faults)
    agent.observe_batch(ids, mask)
    loss = next_byte_loss(ddp, ids, mask)
    if step == faults.nan_step and rank == cfg.world_size - 1:
        loss = loss * float("nan")  # the injected fault: one rank's loss turns NaN
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    lr_used[0] = math.nan  # stays NaN when the step is skipped
    optimizer.step()  # the agent's hooks apply lr_scale (and skip a non-finite step)
    optimizer.zero_grad(set_to_none=True)
    lr_sched = scheduler.get_last_lr()[0]  # the scheduler's LR for this step
    scheduler.step()
    t0 = time.perf_counter()
    agent.end_step(loss, tokens=int(mask.sum()))  # may block: a pause waits here on purpose
    waited = time.perf_counter() - t0
    values = agent.latest()
    return {"step": step, "loss": float(loss.detach()), "lr_sched": lr_sched,
            "lr_scale": values.get("trainguard_lr_scale", 1.0), "lr_used": lr_used[0],
            "generation": values.get("trainguard_applied_generation", 0), "end_step_s": waited,
            "grad_norm_max": values.get("trainguard_grad_norm_max")}, values


def training_setup(cfg: DemoConfig, faults: FaultPlan) -> tuple[Any, Any, Any, Any]:
    """Model (the same initial weights in every process), AdamW, the LR schedule (warm-up, times
    the fault plan's multiplier) and the corpus: what the ranks and the healthy run share."""
    import torch

    from trainguard.demo.model import ByteCorpus, TinyGPT, stdlib_source_bytes

    torch.manual_seed(0)
    model = TinyGPT(seq_len=cfg.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = 10
    # LambdaLR's argument is the number of steps taken: the LR of step s + 1.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * faults.lr_multiplier(s + 1))
    corpus = ByteCorpus(stdlib_source_bytes(), seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=1)
    return model, optimizer, scheduler, corpus


def healthy_main(cfg_dict: dict[str, Any], log_dir: str) -> None:
    """The run without faults and without trainguard, in one process: each step averages the
    losses of every rank's batch, which gives the gradient DDP gives the ranks (the mean of theirs).
    Runs in a spawned process."""
    import torch

    from trainguard.demo.model import next_byte_loss

    cfg = DemoConfig(**cfg_dict)
    torch.set_num_threads(1)
    no_faults = FaultPlan(burst=(0, 0), lr_blowup=(0, 0), nan_step=0)
    model, optimizer, scheduler, corpus = training_setup(cfg, no_faults)
    losses = []
    for step in range(1, cfg.steps + 1):
        loss = sum(next_byte_loss(model, *corpus.batch(step, rank)) for rank in range(cfg.world_size)) / cfg.world_size
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(float(loss.detach()))
    Path(log_dir, "healthy.json").write_text(json.dumps(losses))


def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def _status_line(step: int, total: int, v: dict[str, float]) -> str:
    width = 20
    done = int(width * step / total)
    bar = "#" * done + "." * (width - done)
    return (
        f"[{bar}] step {step:4d}/{total} loss {_fmt(v.get('trainguard_loss'), '.3f')}"
        f" gnorm {_fmt(v.get('trainguard_grad_norm'))} upd {_fmt(v.get('trainguard_update_ratio'), '.2e')}"
        f" | dup {_fmt(v.get('trainguard_data_duplicate_ratio'), '.2f')}"
        f" kl {_fmt(v.get('trainguard_data_token_kl_divergence'), '.2f')}"
        f" ctrl {_fmt(v.get('trainguard_data_special_token_ratio'), '.1e')}"
        f" len-p {_fmt(v.get('trainguard_data_length_shift_pvalue'), '.2g')}"
        f" | paused {int(v.get('trainguard_paused', 0))} lr_scale {_fmt(v.get('trainguard_lr_scale', 1.0), '.3g')}"
    )

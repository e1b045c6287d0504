"""One gloo rank of tests/control/test_control_adaptive_batch.py. Run as a script:

    RANK=r WORLD_SIZE=n DIST_INIT_METHOD=file:///tmp/x/store python adaptive_batch_worker.py '<json>'

Trains a tiny next-token model under DDP with a decaying LR schedule (LambdaLR), attached with
its own accumulation steps (``cfg["own"]``) so the controller may change them; the loss is scaled
down (``cfg["loss_scale"]``) so that the gradient variance the agent measures is low. Each step
runs ``agent.accumulation_steps`` micro-batches and logs (step, micro-batches, the schedule's LR,
the LR the optimizer used); it stops after 10 steps at other steps than its own (at most
``steps``). Writes ``out/<run>-rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import trainer_agent as ta  # noqa: E402

torch.set_num_threads(1)
VOCAB = 32


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["DIST_INIT_METHOD"], rank=rank, world_size=world,
                            timeout=timedelta(seconds=180))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s / 1000.0))
    own = cfg["own"]
    agent = ta.attach(ddp, opt, job="batch-job", run=cfg["run"], controller=cfg["controller"],
                      config=ta.AgentConfig(report_every=5, sync_every=5), accumulation_steps=own)
    used_lr: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: used_lr.append(o.param_groups[0]["lr"]))  # after the agent's
    data = torch.Generator().manual_seed(1000 + rank)
    steps, changed = [], 0
    for step in range(cfg["steps"]):
        micro = agent.accumulation_steps
        scheduled = sched.get_last_lr()[0]
        tokens = 0
        for _ in range(micro):
            ids = torch.randint(0, VOCAB, (4, 17), generator=data)
            logits = ddp(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
            (loss * cfg["loss_scale"] / micro).backward()
            tokens += ids[:, 1:].numel()
        opt.step()
        opt.zero_grad()
        sched.step()
        agent.end_step(loss.detach(), tokens=tokens)
        steps.append([step + 1, micro, scheduled, used_lr[-1]])
        changed = changed + 1 if micro != own else 0
        if changed == 10:  # every rank reaches this at the same step
            break
    out = {"rank": rank, "steps": steps,
           "history": [[h.generation, h.step, h.accumulation_steps] for h in agent.control.history]}
    agent.close()
    del ddp
    dist.destroy_process_group()
    Path(cfg["out"], f"{cfg['run']}-rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""One rank of the console's multi-rank test (gloo, CPU), run as a script:

    RANK=r WORLD_SIZE=n python console_worker.py '<json>'

The ranks meet through a file store in ``out`` (no port). Trains the control tests' small DDP model with the agent attached (``controller``, ``token``,
``run`` from the JSON) until the controller stops the run, rank r sleeping ``sleep_s * (r + 1)``
per step (a visibly slower rank for the per-rank view), and writes the generations this rank
applied (``ControlPlane.history``) to ``out``/console-rank<r>.json.
"""

from __future__ import annotations

import gc
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
from tests.control.dist_worker import BASE_LR, _batch, _model  # noqa: E402

torch.set_num_threads(1)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{Path(cfg['out'], 'store')}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    agent = ta.attach(model, opt, job="job-ui", run=cfg["run"], controller=cfg["controller"], token=cfg["token"],
                      config=ta.AgentConfig(report_every=1, metrics_port=None, request_timeout_s=5.0))
    step = 0
    while not agent.should_stop and step < cfg["max_steps"]:
        step += 1
        x, y = _batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(cfg["sleep_s"] * (rank + 1))
        agent.end_step(loss, tokens=x.numel())
    history = [{"generation": a.generation, "step": a.step, "paused": a.paused, "stop": a.stop} for a in agent.control.history]
    agent.close(3.0)
    Path(cfg["out"], f"console-rank{rank}.json").write_text(json.dumps({"rank": rank, "steps": step, "history": history}))
    del agent, opt, model
    gc.collect()  # DDP holds the process group: free it before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

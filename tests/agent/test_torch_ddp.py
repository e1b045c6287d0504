"""DDP's private member (``trainer_agent/compat/torch_ddp.py``), exercised on a real
``DistributedDataParallel`` in a one-rank gloo group: the test fails when the member is gone or no
longer holds the registered hooks' states."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.control.spawn import spawn_ranks


def _worker(rank: int, init: str, out: str) -> None:
    from datetime import timedelta

    from trainer_agent.compat import DEGRADED, torch_ddp

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=1, timeout=timedelta(seconds=60))
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    before = torch_ddp.comm_hook_states(ddp)
    state = object()
    ddp.register_comm_hook(state, lambda s, bucket: torch.futures.Future())
    after = torch_ddp.comm_hook_states(ddp)
    torch.save({"before": before, "same": len(after) == 1 and after[0] is state, "degraded": dict(DEGRADED)},
               f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_comm_hook_states_are_the_registered_hooks_states(tmp_path):
    (result,) = spawn_ranks(_worker, 1, tmp_path, timeout=120)
    assert result["before"] == [] and result["same"] and result["degraded"] == {}

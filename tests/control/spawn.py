"""Spawn gloo ranks for a test, with a deadline instead of an unbounded join (a hang fails the
test instead of blocking the suite), and load what each rank saved."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def spawn_ranks(worker: Callable[..., None], world: int, tmp_path: Path, timeout: float = 240.0) -> list[Any]:
    """Run ``worker(rank, init_method, out_dir)`` in ``world`` spawned processes; each must save
    ``out_dir/rank{r}.pt``. Kills the ranks and fails when they have not finished by ``timeout``."""
    ctx = mp.start_processes(worker, args=(f"file://{tmp_path}/store", str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks hung"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]

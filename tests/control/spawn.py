"""Spawn gloo ranks for a test, with a deadline instead of an unbounded join (a hang fails the
test instead of blocking the suite), and load what each rank saved.

A rank that is still running shortly before the deadline writes every thread's stack to stderr
(``faulthandler``) and exits, so that a hang fails with the place where each rank waits instead of
a bare timeout; a rank that crashes (a signal) writes its Python stacks the same way. Each rank's stdout and stderr go to a file beside its results, copied to the test's
stderr when the ranks are done (pytest shows it with a failure), stacks included."""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_DUMP_MARGIN_S = 15.0  # the stacks are written this long before the parent gives up

# Ranks start from a fork server that has imported torch once instead of a fresh interpreter each
# (``spawn``), which re-imported torch for every rank: on a 2-core machine those imports were about
# half the distributed tests' time. The fork server was started by an earlier test, with that test's
# environment, working directory and (captured) stdout and stderr: a rank takes the current test's
# environment and working directory from the parent, and writes its output to its own file
# (:func:`_rank_main`). Where there is no fork server (Windows), plain spawn.
_START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
if _START_METHOD == "forkserver":
    mp.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel"])


def _rank_main(rank: int, worker: Callable[..., None], init: str, out: str, dump_after: float,
               environ: dict[str, str], cwd: str) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(_output_file(out, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)  # the file descriptors, so that C++ (gloo) and faulthandler write there too
    os.dup2(log, 2)
    os.close(log)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a crash (SIGSEGV, SIGABRT) leaves its stacks
    faulthandler.dump_traceback_later(dump_after, exit=True, file=sys.stderr)
    try:
        worker(rank, init, out)
        if dist.is_initialized():  # a worker that left its group: leave it together, then destroy
            dist.barrier()
            dist.destroy_process_group()
    finally:
        faulthandler.cancel_dump_traceback_later()


def _output_file(out: str | Path, rank: int) -> str:
    return os.path.join(out, f"rank{rank}.output")


def spawn_ranks(worker: Callable[..., None], world: int, tmp_path: Path, timeout: float = 240.0) -> list[Any]:
    """Run ``worker(rank, init_method, out_dir)`` in ``world`` spawned processes; each must save
    ``out_dir/rank{r}.pt``. Fails when the ranks have not finished by ``timeout`` (each still
    running writes its threads' stacks to its output first), and kills what is left; the ranks'
    output (``out_dir/rank{r}.output``) is copied to this process's stderr."""
    dump_after = max(1.0, timeout - _DUMP_MARGIN_S)
    ctx = mp.start_processes(_rank_main, args=(worker, f"file://{tmp_path}/store", str(tmp_path), dump_after, dict(os.environ), os.getcwd()),
                             nprocs=world, join=False, start_method=_START_METHOD)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "the ranks hung (their stacks are in the captured stderr)"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
        for r in range(world):
            path = Path(_output_file(tmp_path, r))
            text = path.read_text(errors="replace") if path.exists() else ""
            if text:
                sys.stderr.write(f"---- rank {r} output ----\n{text}{'' if text.endswith(chr(10)) else chr(10)}")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]

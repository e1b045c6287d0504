"""A snapshot backend that writes the model and optimizer state to ``torch.distributed.checkpoint``
directories, asynchronously, for models whose state does not fit a host-memory copy per snapshot.

    snaps = DcpSnapshots("/scratch/run-7/snapshots", model, optimizer)
    agent = ta.attach(model, optimizer, job=..., run=..., snapshot_backend=snaps,
                      config=ta.AgentConfig(snapshot_every=200, snapshot_keep=3))

One directory per snapshot, ``<directory>/step-<step>``, holding this rank's shards (``get_state_dict``
gives the sharded FSDP2/DTensor state as it is, a plain module's state whole) and, from the group's
first rank, DCP's ``.metadata``. The agent calls the three methods on every rank of the group at the
same step (:class:`trainer_agent.control.snapshots.SnapshotBackend`):

- ``save(step)``: ``dcp.async_save`` copies the state (DCP's default stager: a copy into fresh host
  memory, on the training thread; the step waits for it), then a background thread writes the files
  and frees the copy. The writer shares the CPU and the GIL with the training thread while it runs
  (``bench/snapshots.py`` measures both). At most one write is in
  flight: a save waits for the previous one to finish first, so a write slower than the snapshot
  interval holds the next snapshot step (back-pressure, instead of staged copies piling up in host
  memory). A failed write does not fail the next save; loading that snapshot raises.
- ``load(handle)``: waits for the pending write (every write, not only that handle's: the load's own
  collectives must not interleave with a write's on the same group), then ``dcp.load`` into the
  state dicts and ``set_state_dict``. Each rank reads only its own shards. ``dcp.load`` reads into
  the live tensors: a load that fails half-way (a damaged file) leaves the state partly restored.
- ``drop(handle)``: waits for that handle's write, then the group's first rank removes the directory;
  the other ranks remove nothing. That is safe because a write's future completes on a rank only
  after DCP has gathered every rank's write results on the group's first rank and written the
  metadata there, so when it has completed on the first rank, no rank is writing into the
  directory any more. It needs a file system every rank of the group sees, as ``dcp.load`` does.

Collectives: under ``torch.distributed`` the writes run their collectives (planning, gathering the
write results) on a gloo process group of their own, made by the constructor over the ranks of
``process_group`` (default: all ranks), so that they never interleave with the training thread's
collectives (FSDP's, the agent's agreement) on the training's groups. The constructor therefore is a
collective call: every rank of the default group calls it, in the same order as its other
``new_group`` calls. Without ``torch.distributed`` (a single process) no group is used.

Give each run a directory of its own: a step directory found there is overwritten, and ``drop``
removes it. Call :meth:`close` on every rank before the process group is destroyed: it waits for the
last write, whose collectives need the group.
"""

from __future__ import annotations

import math
import os
import shutil
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

__all__ = ["DcpSnapshots"]


class DcpSnapshots:
    """Snapshots of ``model`` and ``optimizer`` in ``directory/step-<step>`` (see the module docstring).

    ``timeout_s`` bounds every wait for a write (and the collectives of the backend's own group): a
    write not done by then raises ``TimeoutError`` instead of hanging the step."""

    def __init__(self, directory: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 *, process_group: dist.ProcessGroup | None = None, timeout_s: float = 600.0) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not str(directory):
            raise ValueError(f"directory must be a path, got {directory!r}")
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        distributed = dist.is_available() and dist.is_initialized()
        if process_group is not None and not distributed:
            raise ValueError("process_group given but torch.distributed is not initialised")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(f"process_group must be a torch.distributed.ProcessGroup, got {type(process_group).__name__}")
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"directory {str(self.directory)!r} exists and is not a directory")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.model, self.optimizer = model, optimizer
        self.timeout_s = float(timeout_s)
        self._group: dist.ProcessGroup | None = None
        self._first = True
        """Whether this process is the group's first rank (the one that removes directories)."""
        if distributed:
            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            self._group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            self._first = dist.get_rank(self._group) == 0
        self._writes: dict[str, Future] = {}
        """Writes not yet waited for, by handle (at most one is in flight)."""
        self._failed: dict[str, BaseException] = {}
        """Handles whose write failed, with the error."""
        self.failed_writes = 0

    def _path(self, step: int) -> str:
        return str(self.directory / f"step-{step:09d}")

    def _wait(self, handle: str) -> None:
        """Wait for ``handle``'s write if it is pending; a failure is recorded, not raised."""
        future = self._writes.get(handle)
        if future is None:
            return
        try:
            future.result(timeout=self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"the snapshot write to {handle} did not finish within {self.timeout_s} s") from None
        except (Exception, CheckpointException) as exc:  # the write failed (DCP's error is a BaseException)
            self._failed[handle] = exc
            self.failed_writes += 1
        del self._writes[handle]

    def _wait_all(self) -> None:
        for handle in list(self._writes):
            self._wait(handle)

    def save(self, step: int) -> str:
        """Stage the state after ``step`` and start writing it; returns the directory (the handle)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._wait_all()  # one write in flight: a second would run its collectives beside the first's
        handle = self._path(step)
        self._failed.pop(handle, None)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        # The default stager copies the state before async_save returns; the write runs on a thread.
        try:
            response = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=handle,
                                      process_group=self._group, no_dist=self._group is None)
        except CheckpointException as exc:  # a BaseException, as in load
            raise RuntimeError(f"saving the snapshot {handle} failed: {exc}") from exc
        self._writes[handle] = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        return handle

    def load(self, handle: str) -> None:
        """Restore the model and optimizer state saved under ``handle`` (on every rank of the group)."""
        self._check(handle)
        self._wait_all()
        if handle in self._failed:
            raise RuntimeError(f"the snapshot write to {handle} failed: {self._failed[handle]!r}")
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optim": optim_state}
        try:
            dcp.load(state, checkpoint_id=handle, process_group=self._group, no_dist=self._group is None)
        except CheckpointException as exc:  # a BaseException: it would get past the agent's error counting
            raise RuntimeError(f"loading the snapshot {handle} failed: {exc}") from exc
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def drop(self, handle: str) -> None:
        """Free ``handle``: wait for its write, then the group's first rank removes its directory."""
        self._check(handle)
        self._wait(handle)
        self._failed.pop(handle, None)
        if self._first:
            shutil.rmtree(handle, ignore_errors=True)

    def close(self) -> None:
        """Wait for the pending write (call before the process exits, on every rank)."""
        self._wait_all()

    def _check(self, handle: Any) -> None:
        if not isinstance(handle, str) or Path(handle).parent != self.directory:
            raise ValueError(f"{handle!r} is not a snapshot handle of {str(self.directory)!r}")

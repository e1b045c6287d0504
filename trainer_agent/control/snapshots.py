"""In-memory snapshots of the training state, and the rollback that restores one.

``AgentConfig(snapshot_every=N, snapshot_keep=K)``: at the end of every N-th step the agent copies
the model's and optimizer's state dicts, the LR scheduler's and GradScaler's, and its own spike
guard baseline into host memory, and keeps K of them spaced out geometrically (the newest, then
gaps of up to 2N, 4N, 8N...: ``trainguard/protocol/retention.py``), so that a rollback can still
reach back before an incident that lasted longer than K x N steps. No snapshot is taken at the end
of a snapshot interval in which the agent skipped a step (a gradient spike or a non-finite step):
that state is suspect, and the older snapshots stay. On CUDA the copies go non-blocking into
pinned host memory (the step is not held up by the copy; a CUDA event says when it is complete,
and a restore waits for it); on the CPU they are plain clones. The agent tells the controller the
step of its newest snapshot in every report (``trainguard_snapshot_step``); the controller, which
knows which of them were followed by healthy reports, picks the target of a rollback.

A ``rollback`` (the desired state's ``rollback_seq`` grew) is applied by every rank at the same
step (the control plane's agreement): each restores the newest snapshot taken at or before the
desired state's ``rollback_step``. Every rank takes its snapshots at the same steps, so they all
restore the same one. The data stream is not rewound: the batches seen since the snapshot are
skipped, as PaLM's team did by hand. The agent's step counter and its counters are not rewound
either (they count work done); the LR scheduler is, so the schedule resumes from the snapshot.
Snapshots newer than the restored one are dropped.

Large models: pass ``attach(..., snapshot_backend=B)`` to keep the model and optimizer state where
it belongs, e.g. a ``torch.distributed.checkpoint`` directory written asynchronously for sharded
(FSDP) state. ``B.save(step)`` returns a handle, ``B.load(handle)`` restores it and
``B.drop(handle)`` frees it when the snapshot is no longer kept (:class:`SnapshotBackend`); the agent
keeps only the handle (and the scheduler's, scaler's and its own small state) per snapshot. The
methods run on every rank at the same step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from trainguard.protocol.retention import retained
from trainer_agent.compat import torch_private

__all__ = ["Snapshot", "SnapshotBackend", "SnapshotStore"]


@runtime_checkable
class SnapshotBackend(Protocol):
    """Where the model and optimizer state of a snapshot is kept, instead of host memory."""

    def save(self, step: int) -> Any:
        """Save the state after ``step``; returns a handle for :meth:`load` and :meth:`drop`."""

    def load(self, handle: Any) -> None:
        """Restore the model and optimizer state saved under ``handle``."""

    def drop(self, handle: Any) -> None:
        """The snapshot is no longer kept: free what it holds (files, memory)."""


@dataclass(slots=True)
class Snapshot:
    step: int
    model: Any
    """The model state (host copy) or the user's save handle."""
    optimizer: Any
    extra: dict[str, Any]
    """LR scheduler, GradScaler and agent state (host copies)."""
    ready: Any = None
    """A CUDA event recorded after the non-blocking copies (None on the CPU)."""


def _to_host(obj: Any, pinned: bool) -> Any:
    """A copy of ``obj`` whose tensors are host tensors that share nothing with the originals."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return obj.detach().clone()
        out = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=pinned)
        out.copy_(obj.detach(), non_blocking=pinned)
        return out
    if isinstance(obj, dict):
        out = type(obj)((k, _to_host(v, pinned)) for k, v in obj.items())
        torch_private.copy_state_dict_metadata(obj, out)  # a module state dict's per-module versions
        return out
    if isinstance(obj, list):
        return [_to_host(v, pinned) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_host(v, pinned) for v in obj)
    return copy.deepcopy(obj)


class SnapshotStore:
    """``keep`` snapshots of ``model``/``optimizer`` and the ``extra`` state, spaced out as
    :func:`~trainguard.protocol.retention.retained` says.

    ``extra_state()`` returns the small state saved with each snapshot (scheduler, scaler, agent);
    ``load_extra(state)`` restores it. ``backend`` replaces the host copies of the model and
    optimizer state (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, every: int, keep: int,
                 extra_state: Callable[[], dict[str, Any]], load_extra: Callable[[dict[str, Any]], None],
                 backend: SnapshotBackend | None = None) -> None:
        if backend is not None and not isinstance(backend, SnapshotBackend):
            raise ValueError("snapshot_backend needs save(step), load(handle) and drop(handle) methods")
        self.model, self.optimizer = model, optimizer
        self.every, self.keep = every, keep
        self._extra_state, self._load_extra = extra_state, load_extra
        self.backend = backend
        self.snapshots: list[Snapshot] = []
        """Oldest first."""
        self.rollbacks = 0
        self.withheld = 0
        """Snapshots not taken because a step of their interval was skipped."""
        self._skipped_at_due = 0
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._cuda = device.type == "cuda"

    @property
    def newest_step(self) -> int | None:
        return self.snapshots[-1].step if self.snapshots else None

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def take_unless_skipped(self, step: int, skipped_total: int) -> Snapshot | None:
        """Take the snapshot of ``step`` unless a step was skipped since the last one was due
        (``skipped_total``: the agent's skipped steps so far; the same on every rank, the skip
        decision being agreed)."""
        last, self._skipped_at_due = self._skipped_at_due, skipped_total
        if skipped_total != last:
            self.withheld += 1
            return None
        return self.take(step)

    def take(self, step: int) -> Snapshot:
        """Snapshot the state after ``step`` (call at the end of the step, on every rank)."""
        pinned = self._cuda
        if self.backend is not None:
            model_state, optim_state = self.backend.save(step), None
        else:
            model_state = _to_host(self.model.state_dict(), pinned)
            optim_state = _to_host(self.optimizer.state_dict(), pinned)
        extra = _to_host(self._extra_state(), pinned)
        ready = None
        if pinned:
            ready = torch.cuda.Event()
            ready.record()
        snap = Snapshot(step, model_state, optim_state, extra, ready)
        self._keep_only([s for s in self.snapshots if s.step < step] + [snap])
        return snap

    def _keep_only(self, candidates: list[Snapshot]) -> None:
        """Keep the retention rule's choice of ``candidates``; the backend frees the others."""
        keep = set(retained((s.step for s in candidates), every=self.every, keep=self.keep))
        kept = [s for s in candidates if s.step in keep]
        if self.backend is not None:
            gone = {id(s): s for s in self.snapshots + candidates}
            for s in kept:
                del gone[id(s)]
            for s in gone.values():
                self.backend.drop(s.model)
        self.snapshots = kept

    def find(self, at_or_before: int) -> Snapshot | None:
        """The newest snapshot taken at or before step ``at_or_before``."""
        for snap in reversed(self.snapshots):
            if snap.step <= at_or_before:
                return snap
        return None

    def restore(self, at_or_before: int) -> int | None:
        """Restore the newest snapshot at or before ``at_or_before``; its step, or None when no
        snapshot is that old (nothing is changed then). Newer snapshots are dropped."""
        snap = self.find(at_or_before)
        if snap is None:
            return None
        if snap.ready is not None:
            snap.ready.synchronize()  # SYNC: rollback only; the snapshot's copies are complete
        if self.backend is not None:
            self.backend.load(snap.model)
        else:
            self.model.load_state_dict(snap.model)  # copies into the parameters: the snapshot stays intact
            # The optimizer keeps references to the state tensors it is given: hand it a copy.
            self.optimizer.load_state_dict(_to_host(snap.optimizer, False))
        self._load_extra(copy.deepcopy(snap.extra))
        while self.snapshots and self.snapshots[-1].step > snap.step:
            dropped = self.snapshots.pop()
            if self.backend is not None:
                self.backend.drop(dropped.model)
        self.rollbacks += 1
        return snap.step

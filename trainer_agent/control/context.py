"""What the control plane (``trainer_agent/control/plane.py``) is given and what it records: the agent's
side of it (``ControlContext``: identity, configuration, the optimizer, readers of the step in
progress) and one generation applied on a rank (``Applied``, ``ControlPlane.history``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.protocol.wire import DesiredState
from trainer_agent.config import AgentConfig
from trainer_agent.measure.schedule import ReportSchedule

__all__ = ["ControlContext", "Applied"]


@dataclass(frozen=True, slots=True)
class ControlContext:
    """What the control plane needs from the agent: identity, configuration, the optimizer it acts
    on, and two readers of the step in progress (host int; device scalar, no read)."""

    job: str
    run: str
    rank: int
    world_size: int
    local_rank: int
    config: AgentConfig
    schedule: ReportSchedule
    optimizer: torch.optim.Optimizer
    metrics_url: str | None
    step: Callable[[], int]
    """Optimizer steps completed (``end_step`` calls)."""
    grad_norm: Callable[[], torch.Tensor | None]
    """The pre-clip global gradient norm of the step in progress (0-dim float64 device tensor),
    valid in the optimizer's pre-hook; None before the first backward of the step."""
    accumulation_steps: int | None = None
    """The run's own accumulation steps when it lets the controller change them (else None)."""
    named_parameters: Callable[[], Any] = lambda: ()
    """The model's ``named_parameters`` (the optimizer reset names layers by them)."""
    regime: Callable[[], Any] | None = None
    """What the run trains now and how (the spike guard's ``regime``): the elements that require a
    gradient and the changes the user marked."""
    lr_jumped: Callable[[], bool] | None = None
    """Whether this step's scheduled LR jumped above every LR the run trained at or was built on
    (more than ``schedule.LR_JUMP`` times: the spike guard's ``lr_jumped``,
    ``ScheduledLr.above_envelope``)."""


@dataclass(frozen=True, slots=True)
class Applied:
    """One generation applied on this rank (``ControlPlane.history``)."""

    generation: int
    step: int
    paused: bool
    lr_scale: float
    checkpoint_seq: int
    stop: bool
    time: float
    """Wall-clock time (``time.time()``) at which it was applied."""
    rollback_seq: int = 0
    restored_step: int | None = None
    """The step of the snapshot a rollback of this generation restored (None: no rollback, or
    no snapshot old enough)."""
    accumulation_steps: int = 0
    """Accumulation steps in force from this step (0: the run did not opt in)."""
    desired: DesiredState | None = None
    """The state applied (every command's fields)."""


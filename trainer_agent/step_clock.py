"""The agent's step clock: the optimizer steps counted by ``end_step``, the wall time between
them, the host time spent inside the agent (``overhead_seconds_total``), the GradScaler's skipped
steps and the last step's loss and (loss, gradient norm) row (``trainer_agent/agent.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StepClock"]


class StepClock:
    """``now`` is the agent's clock; the hooks add what they spend to ``overhead`` (this step's),
    ``close_step`` moves it into ``overhead_total``."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.step = 0
        self.overhead_total = 0.0
        self.overhead = 0.0
        self.last_end = now()
        self.amp_skipped = 0
        self.loss: torch.Tensor | None = None
        self.row: torch.Tensor | None = None

    def read_step(self) -> int:
        """The step reader the collaborators get."""
        return self.step

    def begin_end_step(self, t0: float, scaler: Any, stepped: bool, backwards: int) -> float:
        """Count the step ending at ``t0``; returns its wall time since the previous one."""
        self.step += 1
        duration, self.last_end = t0 - self.last_end, t0
        if scaler is not None and scaler.is_enabled() and not stepped and backwards:
            self.amp_skipped += 1  # GradScaler.step skipped optimizer.step: inf/NaN gradients
        return duration

    def loss_of(self, loss: torch.Tensor | float, device: torch.device) -> torch.Tensor:
        """The step's loss as a 0-dim float64 device tensor (no host read), kept in ``loss``."""
        if isinstance(loss, torch.Tensor):
            loss_t = loss.detach().to(device, torch.float64)
            if loss_t.dim():
                loss_t = loss_t.reshape(())
        else:
            loss_t = torch.full((), float(loss), dtype=torch.float64, device=device)  # a fill, no copy
        self.loss = loss_t
        return loss_t

    def close_step(self, t0: float, meter: Any) -> None:
        """After ``end_step`` (started at ``t0``): this step's overhead, the meter's included."""
        self.overhead += self.now() - t0 + meter.overhead
        self.overhead_total += self.overhead
        self.overhead = meter.overhead = 0.0

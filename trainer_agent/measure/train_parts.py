"""What the agent's diagnostics run a pass on (``trainer_agent/diagnostics/verify.py``,
``trainer_agent/diagnostics/preflight.py``): the model, its optimizer and loss scaler, the parameter index,
the step meter and forward timer whose step state a pass resets, this rank's place and a step
reader. The narrow view of the agent they get instead of the ``Agent``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer_agent.measure.forward_timer import ForwardTimer
from trainer_agent.measure.optim import optimizer_class
from trainer_agent.measure.params import ParamIndex
from trainer_agent.measure.step_stats import StepMeter

__all__ = ["TrainParts"]


@dataclass(slots=True)
class TrainParts:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    params: ParamIndex
    meter: StepMeter
    rank: int
    world_size: int
    step: Callable[[], int]
    """The optimizer steps completed (``Agent.step``)."""
    forward: ForwardTimer | None = None
    """Set once the agent's hooks are registered."""
    optimizer_class: tuple[str, float] = field(init=False)
    """The optimizer's class and its code (``optim.optimizer_class``): fixed for the agent's life."""

    def __post_init__(self) -> None:
        self.optimizer_class = optimizer_class(self.optimizer)

    @property
    def device(self) -> torch.device:
        return self.params.device

    @property
    def layers(self) -> list[str]:
        return self.params.layers

    def reset_step(self) -> None:
        """A pass outside the training step leaves no step state behind."""
        self.meter.reset()
        if self.forward is not None:
            self.forward.reset()

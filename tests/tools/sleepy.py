"""A linear layer whose forward sleeps a given time: a rank made compute-slow on purpose (the
workload itself, not a synchronisation)."""

from __future__ import annotations

import time

import torch
from torch import nn


class Sleepy(nn.Module):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.sleep = sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep:
            time.sleep(self.sleep)
        return self.lin(x)

"""Time each step waits for its input, for any loader.

The wait of a step is the time from the return of the previous ``end_step`` to the first forward
pass of the model after it (a module forward pre-hook): the time the training loop spent getting
its next batch (the loader's ``__next__``, collation, the host-to-device copy issued before the
forward, ``observe_batch``). The first step has no previous ``end_step`` and is not measured; with
gradient accumulation only the first forward of a step counts (the others wait for micro-batches
inside the step). Host clock only, no device sync: on CUDA a copy that is still in flight when
the forward starts is not counted.

A rank whose wait is high while the others' is not is *data-slow* (its loader cannot keep up); a
rank whose step time is high while its wait is not is *compute-slow*. Under data parallelism
every rank's step time equalises at the gradient all-reduce, so the wait is what tells them apart.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

from torch import nn

from trainer_agent.measure.module_hooks import add_forward_pre_hook

__all__ = ["InputWait"]


class InputWait:
    """Measures the input wait of each step of a model; see the module docstring."""

    def __init__(self, model: nn.Module, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._ended_at: float | None = None
        self._sum = 0.0
        self._count = 0
        self.last = math.nan
        """The wait of the last measured step (seconds)."""
        self._lock = threading.Lock()
        self._handle = add_forward_pre_hook(model, self._pre_forward)

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        ended = self._ended_at
        if ended is None:
            return
        wait = self._clock() - ended
        self._ended_at = None
        with self._lock:
            self.last = wait
            self._sum += wait
            self._count += 1

    def step_ended(self) -> None:
        """Call at the very end of ``end_step``: the next forward closes this step's wait."""
        self._ended_at = self._clock()

    def take(self) -> float:
        """Mean wait per measured step since the previous call (NaN when none was measured)."""
        with self._lock:
            total, n = self._sum, self._count
            self._sum, self._count = 0.0, 0
        return total / n if n else math.nan

    def remove(self) -> None:
        self._handle.remove()

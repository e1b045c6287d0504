"""Wall time inside the model's forward, per step (``trainguard_forward_seconds``, ``forward_s``).

Under data parallelism every rank's step time is equalised by the gradient all-reduce (the fast
ranks wait for the slow one inside backward), so a straggler shows in the time it spends in its own
forward pass, not in its step time. Measured by a forward pre-hook and a forward hook on the model
given to ``attach``, on the steps that end with a report only, summed over the micro-batches of the
step. Forwards run without gradients (an evaluation or a generation under ``torch.no_grad()`` or
``torch.inference_mode()`` between training steps) are not the step's and are not timed: a rank
that evaluates alone would otherwise read as a straggler.

- CPU parameters: the host clock (the forward's work is synchronous).
- CUDA parameters: a pair of CUDA events around each forward (recording them does not sync). They
  are read one report later, when the next report step is built: by then they have completed
  (``query()``), so reading them needs no sync; a pair still pending is reported as NaN. On CUDA the
  value in a report is therefore the forward time of the previous report step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer_agent.measure.module_hooks import add_forward_hook, add_forward_pre_hook
from trainer_agent.measure.schedule import ReportSchedule

__all__ = ["ForwardTimer"]


class ForwardTimer:
    """Registers the two hooks on ``model``; ``take()`` at the report returns the step's seconds."""

    def __init__(self, model: nn.Module, schedule: ReportSchedule, device: torch.device, *,
                 step: Callable[[], int], clock: Callable[[], float],
                 on_error: Callable[[str, BaseException], None]) -> None:
        self._schedule = schedule
        self._step = step
        self._clock = clock
        self._on_error = on_error
        self._cuda = device.type == "cuda"
        self._depth = 0  # nested calls of the hooked module (e.g. a wrapper calling itself) count once
        self._started = 0.0
        self._seconds = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._previous: list[tuple[Any, Any]] = []  # CUDA: the last report step's pairs
        self.handles = [add_forward_pre_hook(model, self._pre), add_forward_hook(model, self._post)]
        #: True while the agent runs forward passes of its own (a gradient recompute check): not timed.
        self.excluded = False

    def _measured(self) -> bool:
        return not self.excluded and torch.is_grad_enabled() and self._schedule.is_report(self._step() + 1)

    def _pre(self, module: nn.Module, args: Any) -> None:
        try:
            self._depth += 1
            if self._depth > 1 or not self._measured():
                return
            if self._cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                self._events.append((start, None))
            else:
                self._started = self._clock()
        except Exception as exc:  # never raise into forward
            self._on_error("forward_timer", exc)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        try:
            self._depth = max(self._depth - 1, 0)
            if self._depth > 0 or not self._measured():
                return
            if self._cuda:
                if self._events and self._events[-1][1] is None:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self._events[-1] = (self._events[-1][0], end)
            else:
                self._seconds += self._clock() - self._started
        except Exception as exc:
            self._on_error("forward_timer", exc)

    def take(self) -> float:
        """Seconds inside forward of the measured step just finished (CUDA: of the previous report
        step, NaN if its events are still pending or there was none); resets the count."""
        self._depth = 0
        if not self._cuda:
            seconds, self._seconds = self._seconds, 0.0
            return seconds
        pairs, self._previous, self._events = self._previous, [e for e in self._events if e[1] is not None], []
        if not pairs or not all(end.query() for _, end in pairs):
            return math.nan
        return sum(start.elapsed_time(end) for start, end in pairs) / 1000.0  # ms -> s

    def skip(self) -> None:
        """The measured step just finished is the warm-up (``StepClock.warm_up``: compilation and
        first-call initialisation run inside its forward) or compiled (``CompileWatch``): forget
        its time, on CUDA its events too, which the next report would read, and the previous
        report step's, which the next report would then read in their place (a step older than
        the one it names): the next report has none (NaN)."""
        self._depth = 0
        self._seconds = 0.0
        self._events = []
        self._previous = []

    def reset(self) -> None:
        """A step that is not reported: forget what was measured (nothing is, normally)."""
        self._depth = 0
        self._seconds = 0.0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

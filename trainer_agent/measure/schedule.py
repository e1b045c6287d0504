"""Schedules: which steps are report steps and which are agreement steps (decided here, and only
here), and what the user's LR schedule asked for at each step (:class:`ScheduledLr`).

Every rank must take the same decision at the same step (the collectives of those steps pair up
across ranks), so the decision depends on the step number and the configuration only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LR_JUMP", "ReportSchedule", "ScheduledLr"]

#: A scheduled LR more than this multiple of its envelope is a jump, not the schedule's plan: the
#: built-in rule ``scheduler_lr_jump``'s limit (a warm-up or a cyclic schedule climbs by at most
#: ~2x per report interval after its first; a schedule bug multiplies the LR by 10 or 1000).
LR_JUMP = 4.0


@dataclass(frozen=True, slots=True)
class ReportSchedule:
    """``report_every`` and ``sync_every`` of :class:`~trainer_agent.config.AgentConfig`."""

    report_every: int
    sync_every: int = 1

    def is_report(self, step: int) -> bool:
        """Step ``step`` (1-based, as counted by ``end_step``) ends with a report: the device
        statistics are copied to the host and, with several ranks, the ranks' rows are gathered
        in the step's one collective (which also carries the controller's desired state). Every
        ``report_every``-th step, and the first (as torchtitan logs step 1): a run shorter than one
        report interval is reported, and the controller sees a run's loss from its start. (A run
        resumed past step 1 reports from its next ``report_every``-th step: every rank resumes at
        the same step, so all decide alike.)"""
        return step % self.report_every == 0 or step == 1

    def agrees(self, step: int) -> bool:
        """Step ``step`` ends with an agreement of the ranks on the controller's desired state:
        inside the report collective on report steps, a broadcast of the state otherwise."""
        return self.is_report(step) or step % self.sync_every == 0


class ScheduledLr:
    """What the user's LR scheduler asked for, step by step: the largest LR of the optimizer's
    param groups, read in the optimizer's pre-hook *before* the control plane multiplies it by
    ``lr_scale`` (so it is the schedule's own value, whatever the controller does), for each step
    the optimizer takes. Host floats only: a group whose LR lives in a device tensor (a
    ``capturable`` optimizer) makes the step unobserved rather than cost a device read. A step the
    agent skips (non-finite or spiking gradients) is observed too: the schedule asked for it.

    :meth:`take` gives a report's values and starts the next interval:

    - ``trainguard_scheduler_lr``: the scheduled LR of the last step taken (the step whose
      update ratio the report carries);
    - ``trainguard_scheduler_lr_max``: the largest scheduled LR of the interval's steps (a jump of
      a few steps between two reports is not missed);
    - ``trainguard_scheduler_lr_peak``: the largest scheduled LR of all the steps before the
      interval, or the LR the schedule was built on if that is larger (the param groups'
      ``initial_lr``, which every ``torch.optim.lr_scheduler`` records at construction and a
      warm-up rises to: a warm-up stepped once per epoch, as torchvision's recipes do, multiplies
      the LR 20x at its first epoch boundary, within its plan), and
      ``trainguard_scheduler_lr_ratio`` = max / peak: how far the schedule went above every LR the
      run had trained at or was built to reach. A warm-up climbs by at most ~2x per report interval
      after its first, a restart (cosine with warm restarts, a re-warm after resume) goes back to
      the peak, decays go below it; a schedule that jumps 1000x goes 1000x above it. Both are left
      out until ``min_steps`` steps were taken before the interval (the first steps of a warm-up
      from ~0 multiply the LR many times over).

    The peak and the step count are part of the agent's ``state_dict`` (a resumed run keeps its
    envelope)."""

    def __init__(self, *, min_steps: int = 8) -> None:
        if type(min_steps) is not int or min_steps < 1:
            raise ValueError(f"min_steps must be an int >= 1, got {min_steps!r}")
        self.min_steps = min_steps
        self.last: float | None = None
        self.interval_max: float | None = None
        self.peak: float | None = None
        self.steps = 0
        """Steps observed (before the current interval: :attr:`steps_before`)."""
        self.steps_before = 0
        self._observed_step: int | None = None

    def observe(self, optimizer: Any, step: int | None = None) -> None:
        """Before ``lr_scale`` is applied (the optimizer's pre-hook, and the skip decision of a
        step the agent may not take): record the step's scheduled LR. ``step``: the agent's step
        counter then; a second call for the same step is ignored."""
        if step is not None:
            if step == self._observed_step:
                return
            self._observed_step = step
        lr = -math.inf
        for group in optimizer.param_groups:  # _host(group["lr"]), inlined: every step, per group (+10 % as a call)
            v = group["lr"]
            if v is None:
                continue  # a group that sets no LR (Hugging Face's Adafactor with relative_step sizes its own steps)
            if isinstance(v, torch.Tensor):
                if v.device.type != "cpu":
                    return  # on the device: no read here
                v = v.item()  # a CPU tensor: host memory, no device sync
            lr = max(lr, float(v))
        if not math.isfinite(lr):
            return  # no groups, or a non-finite LR: nothing the envelope can use
        self.last = lr
        self.interval_max = lr if self.interval_max is None else max(self.interval_max, lr)
        self.steps += 1

    def take(self, optimizer: Any = None) -> dict[str, float]:
        """The report's values (see the class docstring); the interval starts afresh. ``optimizer``:
        whose param groups' ``initial_lr`` the envelope holds (read here, once per report, not in
        every step's hook)."""
        out: dict[str, float] = {}
        if self.last is None:
            return out
        out["trainguard_scheduler_lr"] = self.last
        if self.interval_max is None:  # no step taken in this interval
            return out
        out["trainguard_scheduler_lr_max"] = self.interval_max
        if self.peak is not None and self.peak > 0 and self.steps_before >= self.min_steps:
            base = _built_on(optimizer) if optimizer is not None else None
            envelope = self.peak if base is None else max(self.peak, base)
            out["trainguard_scheduler_lr_peak"] = envelope
            out["trainguard_scheduler_lr_ratio"] = self.interval_max / envelope
        self.peak = self.interval_max if self.peak is None else max(self.peak, self.interval_max)
        self.interval_max = None
        self.steps_before = self.steps
        return out

    def above_envelope(self, optimizer: Any) -> bool:
        """Whether the last step's scheduled LR is more than :data:`LR_JUMP` times the envelope
        of :meth:`take` (every LR of the steps before the current report interval, and the LR the
        schedule was built on): a jump the schedule did not plan. False until ``min_steps``
        steps were taken before the interval. The spike guard reads it on a climbing gradient
        norm only."""
        if self.last is None or self.peak is None or not self.peak > 0 or self.steps_before < self.min_steps:
            return False  # (an LR of 0 so far, without initial_lr, gives no envelope, as in take())
        base = _built_on(optimizer)
        envelope = self.peak if base is None else max(self.peak, base)
        return self.last > LR_JUMP * envelope

    def state_dict(self) -> dict[str, Any]:
        return {"peak": self.peak, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            peak = state["peak"]
            peak = None if peak is None else float(peak)
            steps = int(state["steps"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed scheduled-LR state: {exc!r}") from None
        if peak is not None and not (math.isfinite(peak) and peak >= 0) or steps < 0:
            raise ValueError(f"malformed scheduled-LR state: peak {peak!r}, steps {steps!r}")
        self.peak, self.steps, self.steps_before = peak, steps, steps
        self.interval_max = None
        self._observed_step = None


def _built_on(optimizer: Any) -> float | None:
    """The largest ``initial_lr`` of ``optimizer``'s param groups: the LR its schedule was built on
    (None without an LR scheduler; a value held on a device is not read)."""
    base = max((v for group in optimizer.param_groups if (v := _host(group.get("initial_lr"))) is not None),
               default=-math.inf)
    return base if math.isfinite(base) and base > 0 else None


def _host(value: Any) -> float | None:
    """A param group's value as a host float: a CPU tensor's (host memory, no device sync); None
    for a device tensor (no read here) and for no value."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.device.type == "cpu" else None
    return None if value is None else float(value)

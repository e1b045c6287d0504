"""The actuators: what the control plane changes in training. Everything else in the agent observes.

- :class:`LrScale`: the optimizer's LR times the agreed ``lr_scale`` for the step, restored after
  it (the scheduler keeps its own state).
- :class:`NonfiniteSkip`: the optimizer's ``step`` wrapped so that a step whose gradients hold a
  NaN/Inf on any rank — or, with a :class:`~trainer_agent.spike_guard.SpikeGuard`, whose gradient
  norm spikes on any rank — is not taken on any rank; nor a step the controller's data skip covers
  (``data_skip``: the same answer on every rank, from the agreed state, with no read or collective).

Pause and checkpoint act through the control plane's ``on_end_step`` (blocking there, calling
``on_checkpoint(step)``); see ``trainer_agent/control.py``.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from functools import wraps
from typing import Any

import torch
import torch.distributed as dist

from trainer_agent import optim
from trainer_agent.compat import torch_private
from trainer_agent.spike_guard import SpikeGuard

__all__ = ["LrScale", "NonfiniteSkip", "SKIP_REASONS"]

#: Why a step was skipped (``trainguard_skipped_steps_total{reason}``), by the flag value the
#: ranks all-reduce (max: a non-finite gradient on any rank wins over a spike on another).
SKIP_REASONS: dict[int, str] = {1: "spike", 2: "nonfinite"}


class LrScale:
    """Multiplies every param group's LR by ``scale`` between the optimizer's pre- and post-hook."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._saved: list[Any] | None = None

    def before_step(self, scale: float) -> None:
        """Optimizer pre-hook: each group's LR becomes scheduler LR x ``scale`` for this step."""
        if self._saved is not None:  # the last post-hook did not run (the step raised)
            self.after_step()
        if scale == 1.0:
            return
        groups = self._optimizer.param_groups
        self._saved = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = g["lr"] * scale

    def after_step(self) -> None:
        """Optimizer post-hook: restore the scheduler's LR objects (floats or tensors) as they were."""
        saved, self._saved = self._saved, None
        if saved is None:
            return
        for g, lr in zip(self._optimizer.param_groups, saved):
            g["lr"] = lr


class NonfiniteSkip:
    """Wraps ``optimizer.step``: before the real step every rank reads whether its global gradient
    norm (``grad_norm()``, measured by the agent at the end of backward, after DDP's all-reduce, in
    float64: finite exactly when every gradient element is) is finite — SYNC: one device read per
    optimizer step — and the ranks all-reduce (max) that flag on ``group``. If any rank saw a
    non-finite gradient, no rank takes the step: parameters and optimizer state stay bit-identical.
    A non-finite *loss* with finite gradients is not skipped (the loss reaches the agent only after
    the step; it is counted in ``trainguard_nonfinite_steps_total``). A step called with a closure
    (``step(closure)``: Lightning, LBFGS) evaluates the closure first and decides on the gradients
    it produced; a skipped one returns the closure's result, the closure having run exactly once
    (``trainer_agent/optim.py``).

    With a ``guard`` (``AgentConfig.skip_spikes``), the same device read gives the norm's value
    and the guard's verdict joins the flag (1: spike, 2: non-finite; the all-reduce takes the
    max): a spike is skipped exactly like a non-finite step, at the same step on every rank, with
    no further sync or collective.

    ``grad_norm`` is an attribute so that a test can inject a failing reader."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, world_size: int, group: Any,
                 grad_norm: Callable[[], torch.Tensor | None],
                 on_error: Callable[[str, BaseException], None],
                 guard: SpikeGuard | None = None, data_skip: Callable[[], bool] | None = None,
                 check_gradients: bool = True, on_data_skip: Callable[[], Any] | None = None) -> None:
        self.optimizer = optimizer
        self.world_size = world_size
        self.group = group
        self.grad_norm = grad_norm
        self.guard = guard
        self.data_skip = data_skip
        """True (on every rank alike) while the controller's data skip covers the step in progress."""
        self.check_gradients = check_gradients
        """False: only the data skip decides (no device read, no collective: the run did not ask for
        the non-finite or spike checks)."""
        self._on_data_skip = on_data_skip
        self._on_error = on_error
        self.skipped_by_reason = {reason: 0 for reason in (*SKIP_REASONS.values(), "data")}
        self._orig: tuple[Any, bool, Any] | None = None
        self._wrap()

    def _wrap(self) -> None:
        optimizer = self.optimizer
        had_own = "step" in vars(optimizer)
        inner = optimizer.step
        skip = self

        @wraps(getattr(inner, "__func__", inner))  # keeps an LR scheduler's '_wrapped_by_lr_sched' mark
        def step(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            # With a closure, it runs first: the decision is on the gradients it produces.
            return optim.guarded_step(inner, args, kwargs, skip.skip_this_step)

        # A bound method, as LR schedulers expect (they wrap ``optimizer.step.__func__``).
        optimizer.step = types.MethodType(step, optimizer)  # type: ignore[method-assign]
        self._orig = (optimizer, had_own, inner)

    def unwrap(self) -> None:
        if self._orig is None:
            return
        optimizer, had_own, inner = self._orig
        self._orig = None
        if had_own:
            optimizer.step = inner
        else:
            vars(optimizer).pop("step", None)

    @property
    def skipped(self) -> int:
        """Steps skipped, whatever the reason."""
        return sum(self.skipped_by_reason.values())

    def skip_this_step(self) -> bool:
        """True (on every rank) if any rank's gradients hold a NaN/Inf, or spike (with a guard), or
        the data skip covers the step."""
        try:
            data = self.data_skip is not None and self.data_skip()
        except Exception as exc:  # noqa: BLE001 - the agreed state is the same on every rank: cannot differ
            self._on_error("skip_data", exc)
            data = False
        if data:  # every rank: the agreed state says so (the spike guard's window is left as it was)
            self.skipped_by_reason["data"] += 1
            if self._on_data_skip is not None:
                try:
                    self._on_data_skip()
                except Exception as exc:  # noqa: BLE001 - the user's data hook must not break the step
                    self._on_error("skip_data", exc)
            return True
        if not self.check_gradients:
            return False
        bad = 0
        value = math.nan
        try:
            norm = self.grad_norm()
            if norm is None:
                grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
                norm = (torch.stack([n.to(grads[0].device, torch.float64) for n in torch_private.foreach_norm(grads)]).sum()
                        if grads else None)
            if norm is not None:
                value = float(norm)  # SYNC: one device read per optimizer step
                if not math.isfinite(value):
                    bad = 2
                elif self.guard is not None and self.guard.is_spike(value):
                    bad = 1
        except Exception as exc:  # noqa: BLE001 - fail open: this rank votes to take the step
            self._on_error("skip_nonfinite", exc)
        if self.world_size > 1:
            # Every rank reaches this all-reduce, whatever happened above on it.
            try:
                flag = torch.tensor([bad], dtype=torch.int64)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)  # gloo, CPU tensor
                bad = int(flag.item())
            except Exception as exc:  # noqa: BLE001 - fail open: take the step
                self._on_error("skip_nonfinite", exc)
                bad = 0
        if bad:
            self.skipped_by_reason[SKIP_REASONS[bad]] += 1
        if self.guard is not None:
            if bad:
                self.guard.skipped()
            else:
                self.guard.taken(value)
        return bool(bad)

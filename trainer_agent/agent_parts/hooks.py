"""The agent's hooks on the training loop (see ``trainer_agent/agent.py``): (1) the gradient hooks,
(2) the optimizer step pre/post hooks, (4) the forward timer, the input wait and the DDP comm
timing. Every hook body times itself into the step clock's overhead and keeps its errors out of
the loop."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer_agent.compat import torch_private
from trainer_agent.measure import optim
from trainer_agent.measure.comm_timing import CommTiming
from trainer_agent.measure.compile_watch import CompileWatch
from trainer_agent.config import AgentConfig
from trainer_agent.measure.forward_timer import ForwardTimer
from trainer_agent.measure.inputs import InputWait
from trainer_agent.measure.module_hooks import add_forward_hook
from trainer_agent.measure.params import ParamIndex
from trainer_agent.diagnostics.preflight import PreflightOnly
from trainer_agent.measure.schedule import ReportSchedule, ScheduledLr
from trainer_agent.measure.step_clock import StepClock
from trainer_agent.measure.step_stats import GradHooks, StepMeter

__all__ = ["AgentHooks"]


class AgentHooks:
    """``verifier``: the recompute check (or None); ``control``: the control plane, set once it
    is built; ``preflight_only``: under ``trainguard preflight`` an optimizer step ends the script."""

    def __init__(self, meter: StepMeter, clock: StepClock, scheduled_lr: ScheduledLr, *, verifier: Any,
                 on_error: Callable[[str, BaseException], None], preflight_only: bool, rank: int,
                 on_scaler: Callable[[Any], None] | None = None) -> None:
        self.meter, self.clock, self.scheduled_lr, self.verifier = meter, clock, scheduled_lr, verifier
        self._error = on_error
        #: Called with a ``GradScaler`` found stepping the optimizer (:meth:`find_scaler`); None
        #: once one is known (passed to ``attach`` or found).
        self.on_scaler = on_scaler
        self.preflight_only, self.rank = preflight_only, rank
        self.control: Any = None
        self.handles: list[Any] = []
        self.forward: ForwardTimer | None = None
        self.comm: CommTiming | None = None  # AgentConfig.comm_timing (trainer_agent/measure/comm_timing.py)
        self.input_wait: InputWait | None = None
        self.compiles: CompileWatch | None = None  # steps that compiled (trainer_agent/measure/compile_watch.py)

    def register(self, model: nn.Module, optimizer: torch.optim.Optimizer, params: ParamIndex,
                 schedule: ReportSchedule, config: AgentConfig) -> None:
        self.handles = [
            optimizer.register_step_pre_hook(self.pre_step),
            optimizer.register_step_post_hook(self.post_step),
        ]
        # One hook per layer on ordinary steps; every parameter only on the steps that read each
        # incoming gradient (``sync_grad_hooks``).
        hooks = GradHooks(params.params, params.layer_ids.tolist(), self.sentinel_hook, self.grad_hook)
        self.meter.hooks = hooks
        self.handles.append(hooks)
        self.sync_grad_hooks()
        if params.sharding is not None:
            self.handles.append(add_forward_hook(model, self.meter.watch_output))
        clock = self.clock
        self.forward = ForwardTimer(model, schedule, params.device, step=clock.read_step,
                                    clock=clock.now, on_error=self._error)
        self.handles += self.forward.handles
        if config.comm_timing:
            self.comm = CommTiming(model, on_error=self._error, clock=clock.now)
            self.handles.append(self.comm)
        self.input_wait = InputWait(model, clock.now)
        self.compiles = CompileWatch(self._error)
        self.handles.append(self.compiles)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.forward is not None:
            self.forward.remove()
        if self.input_wait is not None:
            self.input_wait.remove()

    # ------------------------------------------------------------------ (1) backward

    def sync_grad_hooks(self) -> None:
        """Hook every parameter for the step in progress only when it reads every incoming
        gradient: the verifier's armed step, the noise scale's report step (``StepMeter``)."""
        hooks = self.meter.hooks
        if hooks is not None:
            verifier = self.verifier
            hooks.want((verifier is not None and verifier.armed) or self.meter.wants_every_grad())

    def sentinel_hook(self, grad: torch.Tensor) -> None:
        verifier = self.verifier
        if verifier is not None and verifier.recomputing:
            return  # the agent's own recompute is not the step's
        self.meter.sentinel(grad)

    def grad_hook(self, index: int, grad: torch.Tensor) -> None:
        clock = self.clock
        t0 = clock.now()
        try:
            verifier = self.verifier
            if verifier is not None and verifier.armed:
                if verifier.recomputing:
                    return  # the agent's own recompute is not the step's
                verifier.on_grad(index, grad)
            self.meter.on_grad(index, grad)
        except Exception as exc:  # never raise into backward
            self._error("gradient_hook", exc)
        finally:
            clock.overhead += clock.now() - t0

    # ------------------------------------------------------------------ (2) optimizer step

    def find_scaler(self) -> None:
        """Without a ``GradScaler`` passed to ``attach``: the one whose ``step()`` runs this
        optimizer step, if any, handed to ``on_scaler`` (its gradients were measured scaled; from
        this step on they are measured as with the scaler passed). Read from the step hooks, so the
        first step the scaler takes is found (not the ones it skipped before it)."""
        if self.on_scaler is None:
            return
        try:
            scaler = torch_private.stepping_grad_scaler()
            if scaler is not None:
                found, self.on_scaler = self.on_scaler, None
                found(scaler)
        except Exception as exc:
            self.on_scaler = None
            self._error("grad_scaler", exc)

    def grad_norm_before_step(self, optimizer: torch.optim.Optimizer) -> Any:
        """The gradient norm the skip decision reads (``NonfiniteSkip``), before any hook of the
        step runs: the step's scheduled LR is recorded here too, so a step that is then skipped
        still shows what the schedule asked for."""
        self.find_scaler()
        try:
            self.scheduled_lr.observe(optimizer, self.clock.step)
        except Exception as exc:
            self._error("scheduled_lr", exc)
        return self.meter.grad_norm

    def pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple | None:
        if self.preflight_only:  # ``trainguard preflight`` on a script that trains before any pre-flight
            raise PreflightOnly(None, self.rank)
        clock = self.clock
        t0 = clock.now()
        self.find_scaler()
        clock.found_inf = optim.fused_found_inf(optimizer)
        replaced, pending = None, False
        try:  # a closure's later evaluations (LBFGS) are not the step's: trainer_agent/measure/optim.py
            pending = optim.closure_pending(args, kwargs)
            replaced = optim.with_step_closure(args, kwargs, functools.partial(optim.unmeasured, self.meter),
                                               functools.partial(self.after_closure, optimizer) if pending else None)
        except Exception as exc:
            self._error("optimizer_closure", exc)
        try:
            self.scheduled_lr.observe(optimizer, clock.step)  # before lr_scale multiplies it below
        except Exception as exc:
            self._error("scheduled_lr", exc)
        if self.control is not None:
            try:
                self.control.before_optimizer_step()
            except Exception as exc:
                self._error("control_before_step", exc)
        try:
            with torch.no_grad():  # the hook runs outside the optimizer's no_grad: record no graph
                self.meter.before_step(optimizer, closure_pending=pending)
        except Exception as exc:
            self._error("optimizer_pre_step", exc)
        finally:
            clock.overhead += clock.now() - t0
        return replaced

    def after_closure(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's closure, run by the optimizer after ``pre_step``, has returned: the
        gradients it made are the ones the step applies (``optim.StepClosure``)."""
        clock = self.clock
        t0 = clock.now()
        try:
            with torch.no_grad():
                self.meter.step_grads(optimizer)
        except Exception as exc:
            self._error("optimizer_closure", exc)
        finally:
            clock.overhead += clock.now() - t0

    def post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        clock = self.clock
        t0 = clock.now()
        try:
            with torch.no_grad():  # the hook runs outside the optimizer's no_grad: record no graph
                self.meter.after_step()
        except Exception as exc:
            self._error("optimizer_post_step", exc)
        finally:
            clock.overhead += clock.now() - t0
        if self.verifier is not None:
            self.verifier.after_optimizer_step()
        if self.control is not None:
            try:
                self.control.after_optimizer_step()
            except Exception as exc:
                self._error("control_after_step", exc)

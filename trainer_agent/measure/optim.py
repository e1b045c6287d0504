"""Optimizers as training frameworks hand them out, and optimizer steps driven by a closure.

**Wrapped optimizers.** Frameworks give user code a wrapper around the real optimizer:
accelerate's ``AcceleratedOptimizer`` (what the Hugging Face ``Trainer`` passes to its callbacks),
Lightning's ``LightningOptimizer`` (``LightningModule.optimizers()``). The step hooks the agent needs
live on the real ``torch.optim.Optimizer``, which every such wrapper holds in ``.optimizer``:
:func:`unwrap_optimizer` follows ``.optimizer`` down to it. The wrapper's ``step`` ends in the real
optimizer's ``step``, so the hooks fire whichever of the two the loop calls.

**Closures** (``optimizer.step(closure)``: Lightning calls every step this way; LBFGS needs it).
The closure computes the gradients *inside* ``step``, after the optimizer's pre-step hooks have run.
Two things follow, handled here:

- Skipping a non-finite step (``AgentConfig.skip_nonfinite``) must decide on the gradients the
  closure produces, so :func:`guarded_step` evaluates the closure first, then decides, then calls
  the real ``step`` with a :class:`StepClosure` that hands the optimizer that first result instead of
  evaluating again. A skipped step returns the closure's result without calling the real ``step``:
  the closure ran exactly once, as frameworks that check it require (Lightning raises "The closure
  hasn't been executed" otherwise).
- The optimizer's pre-step hooks run before the closure, while ``.grad`` holds an earlier step's
  gradients (or none): what the agent reads of the gradients the step applies (on report steps the
  per-layer statistics, the fingerprints) is read when the closure's first evaluation returns
  (:class:`StepClosure`'s ``after_first``), after what the closure does past its backward pass
  (Lightning's gradient clipping); the gradient norm at the end of its backward pass, as without
  a closure.
- An optimizer may evaluate its closure more than once per step (LBFGS's line search). The step's
  gradient is that of the first evaluation (the point the step starts from): its norm and its
  statistics are all of that one evaluation's gradients; later evaluations run with the agent's
  gradient measurement set aside, so they are not counted as micro-batches (the noise scale would
  be wrong) and replace none of the step's gradient values.

**Fused optimizers under a GradScaler** (``Adam``/``AdamW``/``SGD`` with ``fused=True``) unscale the
gradients inside their own kernel: ``GradScaler.step`` leaves the gradients scaled and sets the
scale as ``optimizer.grad_scale`` for the duration of the step (:func:`applied_grad_scale`). What
reads the gradients in the step hooks divides by it. A non-finite step is then skipped by that
kernel, not by the scaler: the step (and its hooks) runs, with ``optimizer.found_inf`` > 0
(:func:`fused_found_inf`).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainer_agent.compat import torch_private

__all__ = ["applied_grad_scale", "closure_pending", "fused_found_inf", "optimizer_class", "state_age", "unwrap_optimizer",
           "StepClosure", "guarded_step", "with_step_closure", "unmeasured"]

#: Wrapper levels followed at most (a wrapper of a wrapper of ...; bounds a cycle).
_MAX_DEPTH = 8
_NOT_RUN = object()


def applied_grad_scale(optimizer: object) -> torch.Tensor | None:
    """Inside ``optimizer.step()`` (its hooks), the loss scale its gradients still carry: the
    ``grad_scale`` tensor a ``GradScaler`` sets on an optimizer that unscales in its own kernel
    (None once the user unscaled them, and for every other optimizer, whose gradients the scaler
    unscaled in place before the step)."""
    return _step_tensor(optimizer, "grad_scale")


def fused_found_inf(optimizer: object) -> torch.Tensor | None:
    """Inside ``optimizer.step()``: the ``found_inf`` tensor a ``GradScaler`` sets on an optimizer
    that unscales in its own kernel (> 0: the kernel skips this step), else None."""
    return _step_tensor(optimizer, "found_inf")


def _step_tensor(optimizer: object, name: str) -> torch.Tensor | None:
    value = getattr(optimizer, name, None)
    return value if isinstance(value, torch.Tensor) else None


def _usable(optimizer: object) -> bool:
    """A torch optimizer that ran ``Optimizer.__init__`` (it has the step-hook registries)."""
    return (isinstance(optimizer, torch.optim.Optimizer)
            and torch_private.optimizer_has_step_hooks(optimizer)
            and isinstance(getattr(optimizer, "param_groups", None), list))


def unwrap_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """The real ``torch.optim.Optimizer`` behind ``optimizer``: the innermost usable one along the
    chain ``optimizer``, ``optimizer.optimizer``, ... (a framework's wrappers, nested or not).
    ``ValueError`` naming the types passed when there is none."""
    chain: list[str] = []
    found: torch.optim.Optimizer | None = None
    current = optimizer
    for _ in range(_MAX_DEPTH):
        chain.append(type(current).__name__)
        if _usable(current):
            found = current  # type: ignore[assignment]
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current:
            break
        current = inner
    if found is not None:
        return found
    raise ValueError(
        f"optimizer must be a torch.optim.Optimizer, or a framework's wrapper holding one in .optimizer "
        f"(accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer); got {' wrapping '.join(chain)}")


def optimizer_class(optimizer: object) -> tuple[str, float]:
    """The optimizer's class as ``module.QualName``, and a code of it (its CRC-32, a float: a
    report value). An optimizer that steps another held in ``.optim`` (``ZeroRedundancyOptimizer``)
    names both: switching the optimizer under it is a switch too. What changes when a run switches
    optimizer (Adam to SGD, or back) and re-attaches the agent, and nothing else does: the agent's
    LR envelope and the controller's spike rules start afresh there."""
    def name(obj: object) -> str:
        return f"{type(obj).__module__}.{type(obj).__qualname__}"

    inner = getattr(optimizer, "optim", None)
    full = name(optimizer) + (f"({name(inner)})" if isinstance(inner, torch.optim.Optimizer) else "")
    return full, float(zlib.crc32(full.encode()))


#: States whose step count a report reads (:func:`state_age`): the newest (a state is created when
#: its parameter first steps, so a new optimizer's, a reset part's and a newly trained layer's are
#: last in ``optimizer.state``) and an even spread of the others: reading every state's count (about
#: 0.8 us each) took 3.8 ms of each report step at 5,000 tensors, 0.07 ms at 100.
_AGE_NEWEST = 64
_AGE_SPREAD = 64


def _age_sample(states: list[Any]) -> list[Any]:
    if len(states) <= _AGE_NEWEST + _AGE_SPREAD:
        return states
    older = states[:-_AGE_NEWEST]
    return older[::-(-len(older) // _AGE_SPREAD)] + states[-_AGE_NEWEST:]


def state_age(optimizer: torch.optim.Optimizer) -> torch.Tensor | float | None:
    """The age of the optimizer's state: the smallest step count of its per-parameter states
    (``state[p]["step"]`` of Adam, AdamW, Adagrad, RMSprop, ...: the steps that parameter's moments
    have accumulated), so that a part whose state started afresh (a new optimizer on a resumed
    run, parameters that start to train, a ``reset_optimizer``) shows. Of more than 128 states,
    the 64 created last and 64 spread over the others are read (:data:`_AGE_NEWEST`). None when no
    state holds such a count: an optimizer without one (SGD, LBFGS), or before its first step.
    Counts kept on the device (fused or capturable Adam on CUDA) give a 0-dim tensor there, for
    the report's device-to-host copy; counts on the host a float (no device read)."""
    host: list[float] = []
    device: list[torch.Tensor] = []
    for state in _age_sample(list(optimizer.state.values())):
        step = state.get("step") if isinstance(state, dict) else None
        if type(step) is torch.Tensor and step.numel() == 1:  # (a tensor subclass, DTensor, is left out)
            if step.device.type == "cpu":
                host.append(step.item())
            else:
                device.append(step.reshape(()))
        elif isinstance(step, (int, float)) and not isinstance(step, bool):
            host.append(float(step))
    youngest = min(host) if host else None
    if not device:
        return youngest
    same = all(t.dtype == device[0].dtype and t.device == device[0].device for t in device)
    on_device = torch.stack(device if same else [t.to(device[0].device, torch.float64) for t in device]).min()
    return on_device if youngest is None else torch.clamp(on_device.to(torch.float64), max=youngest)


def _closure_of(args: tuple[Any, ...], kwargs: dict[str, Any],
                at: int = 0) -> tuple[Any, Callable[[Any], tuple[tuple, dict]]]:
    """The closure passed to ``step(closure=None)`` (by name, or positionally at ``args[at]``),
    and a function that returns ``(args, kwargs)`` with another closure in its place."""
    if "closure" in kwargs:
        return kwargs["closure"], lambda c: (args, {**kwargs, "closure": c})
    if len(args) > at:
        return args[at], lambda c: ((*args[:at], c, *args[at + 1:]), kwargs)
    return None, lambda c: (args, kwargs)


@contextlib.contextmanager
def unmeasured(meter: Any) -> Iterator[None]:
    """Backward passes inside this block leave the step in progress as it was: the agent's
    gradient hooks write into a throwaway step state of ``meter`` (``step_stats.StepMeter``), and
    the step's own state (gradient norms, micro-batch count) is put back after."""
    state = meter.state
    meter.state = type(state)()
    try:
        yield
    finally:
        meter.state = state


class StepClosure:
    """The closure of one optimizer step as the optimizer sees it. Its first evaluation is the
    step's (measured by the agent); with :meth:`evaluate_first` that evaluation happens before the
    optimizer's ``step`` and the optimizer's first call receives its result. Later evaluations run
    under ``set_aside()`` (:func:`unmeasured`), which the agent's pre-step hook provides, as it
    provides ``after_first()``: called when the first evaluation, run by the optimizer, returns."""

    def __init__(self, closure: Callable[[], Any],
                 set_aside: Callable[[], contextlib.AbstractContextManager] | None = None,
                 after_first: Callable[[], None] | None = None) -> None:
        self.closure = closure
        self.set_aside = set_aside
        self.after_first = after_first
        self.evaluations = 0
        self._held: Any = _NOT_RUN

    def evaluate_first(self) -> Any:
        """Evaluate the closure now (with gradients enabled, as optimizers do); the result is
        handed to the optimizer's first call."""
        with torch.enable_grad():
            result = self.closure()
        self.evaluations = 1
        self._held = result
        return result

    def __call__(self) -> Any:
        if self._held is not _NOT_RUN:
            result, self._held = self._held, _NOT_RUN
            return result
        self.evaluations += 1
        if self.evaluations == 1:
            result = self.closure()
            if self.after_first is not None:
                self.after_first()
            return result
        if self.set_aside is None:
            return self.closure()
        with self.set_aside():
            return self.closure()


def with_step_closure(args: tuple[Any, ...], kwargs: dict[str, Any],
                      set_aside: Callable[[], contextlib.AbstractContextManager],
                      after_first: Callable[[], None] | None = None) -> tuple[tuple, dict] | None:
    """For an optimizer pre-step hook (its ``args`` start with the optimizer): ``(args, kwargs)``
    with the closure wrapped in a :class:`StepClosure` whose later evaluations run under
    ``set_aside`` and whose first evaluation is followed by ``after_first()``, or None when there
    is no closure, or it is a StepClosure already (it gets ``set_aside`` then, and ``after_first``
    when it has not run yet)."""
    closure, replace = _closure_of(args, kwargs, at=1)
    if closure is None:
        return None
    if isinstance(closure, StepClosure):
        closure.set_aside = closure.set_aside or set_aside
        if not closure.evaluations:
            closure.after_first = closure.after_first or after_first
        return None
    return replace(StepClosure(closure, set_aside, after_first))


def closure_pending(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """For an optimizer pre-step hook: the step has a closure that has not run yet (its gradients
    are made after the hook: what ``.grad`` holds now is an earlier step's, or nothing)."""
    closure, _ = _closure_of(args, kwargs, at=1)
    return closure is not None and not (isinstance(closure, StepClosure) and closure.evaluations)


def guarded_step(step: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 skip: Callable[[], bool]) -> Any:
    """``step(*args, **kwargs)`` unless ``skip()`` says no. With a closure, the closure is
    evaluated first, so ``skip`` sees its gradients; a skipped step returns the closure's result."""
    closure, replace = _closure_of(args, kwargs)
    if closure is None:
        return None if skip() else step(*args, **kwargs)
    wrapped = closure if isinstance(closure, StepClosure) else StepClosure(closure)
    result = wrapped.evaluate_first()  # a user's exception propagates, as from the optimizer
    if skip():
        return result
    args, kwargs = replace(wrapped)
    return step(*args, **kwargs)

"""One-line callbacks for training frameworks, each in its own module so that importing
``trainer_agent`` (or this package) imports no framework:

- ``trainer_agent.integrations.hf.TrainguardCallback``: the Hugging Face ``transformers.Trainer``
  (extra ``trainguard[hf]``);
- ``trainer_agent.integrations.lightning.TrainguardCallback``: Lightning's ``Trainer``
  (extra ``trainguard[lightning]``).

:class:`StepSession` is what both do around the agent, framework-free.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StepSession"]


class StepSession:
    """One training run seen by a framework callback: attaches the agent once, sums the losses of
    the current optimizer step's micro-batches on the device (no host read), ends the step, and
    turns the controller's ``checkpoint`` command into a flag the callback hands to the framework.

    ``attach_kwargs`` go to ``trainer_agent.attach`` (``config``, ``controller``, ``token``,
    ``scaler``, ``data_monitor``, ``registry``, ...); ``on_checkpoint`` is the callback's own."""

    def __init__(self, job: str, run: str, attach_kwargs: dict[str, Any]) -> None:
        if "on_checkpoint" in attach_kwargs:
            raise ValueError("on_checkpoint is set by the callback: the controller's checkpoint command "
                             "saves through the framework's own checkpointing")
        self.job, self.run = job, run
        self.attach_kwargs = attach_kwargs
        self.agent: Any = None
        self.checkpoint_requested = False
        self._closed = False
        self._loss: Any = None
        self._micro_batches = 0
        self._tokens: int | None = 0
        self._applied: tuple[list[Any], float] | None = None
        self._lr_hook: Any = None

    def attach(self, model: Any, optimizer: Any, **defaults: Any) -> Any:
        """Attach an agent (a new one after :meth:`close`: a second ``fit``/``train``);
        ``defaults`` (e.g. the framework's GradScaler) yield to ``attach_kwargs``."""
        if self.agent is None or self._closed:
            from trainer_agent.agent import attach

            kwargs = {**{k: v for k, v in defaults.items() if v is not None}, **self.attach_kwargs}
            self._loss, self._micro_batches, self._tokens = None, 0, 0
            self.checkpoint_requested = self._closed = False
            self.agent = attach(model, optimizer, job=self.job, run=self.run,
                                on_checkpoint=self._on_checkpoint, **kwargs)
            self._applied = None
            self._lr_hook = self.agent.optimizer.register_step_pre_hook(self._record_applied_lr)
        return self.agent

    def _on_checkpoint(self, step: int) -> None:
        self.checkpoint_requested = True

    def add_micro_batch(self, loss: Any, tokens: int | None) -> None:
        """One micro-batch's loss (a device tensor, not read here) and token count (None: unknown).
        Never raises into the loop: a loss that is not a tensor is counted as an agent error."""
        try:
            loss = loss.detach()
            self._loss = loss if self._loss is None else self._loss + loss
        except Exception as exc:  # noqa: BLE001 - e.g. a training_step override returning None
            if self.agent is not None:
                self.agent._error("integration_loss", exc)
            return
        self._micro_batches += 1
        self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens

    def end_step(self, scale: float = 1.0, *, without_loss: bool = False) -> bool:
        """End the optimizer step with ``scale x`` the sum of its micro-batch losses; False (and no
        step ended) when no micro-batch was seen, unless ``without_loss``: the framework took the
        optimizer step anyway (every micro-batch skipped), ended with no loss."""
        if self.agent is None or self._loss is None and not without_loss:
            return False
        loss = None if self._loss is None else self._loss * scale if scale != 1.0 else self._loss
        tokens = self._tokens
        self._loss, self._micro_batches, self._tokens = None, 0, 0
        self.agent.end_step(loss, tokens=tokens)
        return True

    def _record_applied_lr(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer pre-hook, registered after the agent's (hooks run in that order): the param
        groups' LRs as the step applies them (the scheduler's x the agent's multiplier)."""
        control = self.agent.control
        self._applied = ([g["lr"] for g in optimizer.param_groups], 1.0 if control is None else control.lr_scale)

    def applied_lrs(self) -> dict[str, float]:
        """The LR the last optimizer step applied, for the framework's own logs beside its
        ``learning_rate`` (the scheduler's LR: while ``lr_scale`` is not 1 it is not the LR in use).

        ``trainguard/applied_lr``: param group 0's LR in that step (the scheduler's LR x the
        agreed ``lr_scale``, and an accumulation command's LR factor); ``trainguard/applied_lr_pg<i>``
        the same for group ``i`` > 0; ``trainguard/lr_scale``: the ``lr_scale`` of that step. Empty
        before the first step. A device-tensor LR is read on the host here (at a logging step)."""
        if self._applied is None:
            return {}
        lrs, lr_scale = self._applied
        out = {"trainguard/applied_lr" if i == 0 else f"trainguard/applied_lr_pg{i}": float(lr)
               for i, lr in enumerate(lrs)}
        out["trainguard/lr_scale"] = float(lr_scale)
        return out

    @property
    def micro_batches(self) -> int:
        """Micro-batches seen since the last ``end_step``."""
        return self._micro_batches

    def take_checkpoint_request(self) -> bool:
        """True once per checkpoint the controller asked for (and at a stop)."""
        requested, self.checkpoint_requested = self.checkpoint_requested, False
        return requested

    @property
    def should_stop(self) -> bool:
        return self.agent is not None and self.agent.should_stop

    def close(self) -> None:
        """Close the agent (it stays readable: ``agent.latest()``)."""
        if self.agent is not None and not self._closed:
            self._closed = True
            self._lr_hook.remove()
            self.agent.close()


def tokens_of(batch: Any) -> int | None:
    """Token positions in a batch, read from host-side shapes (no device read): the ``input_ids``
    of a mapping, or an integer tensor (alone or first in a tuple/list); None otherwise."""
    if isinstance(batch, dict) or hasattr(batch, "keys") and hasattr(batch, "get"):
        batch = batch.get("input_ids")
    elif isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    dtype = getattr(batch, "dtype", None)
    if dtype is None or getattr(dtype, "is_floating_point", True) or getattr(dtype, "is_complex", False):
        return None
    return int(batch.numel())

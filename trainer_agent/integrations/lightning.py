"""trainguard for Lightning's ``Trainer``, in one line (extra ``trainguard[lightning]``)::

    from trainer_agent.integrations.lightning import TrainguardCallback
    trainer = L.Trainer(callbacks=[TrainguardCallback(job="llm-7b", run="llm-7b-0001")])

=======================  ============================================================================
``on_fit_start``         the strategy has set up the module and its optimizer:
                         ``trainer_agent.attach(module, trainer.optimizers[0], ...)`` (the real torch
                         optimizer; ``LightningOptimizer`` wrappers are unwrapped the same way)
``on_train_batch_end``   ``outputs["loss"]`` of the micro-batch, which Lightning has divided by
                         ``accumulate_grad_batches``, is added up on the device and the batch's tokens
                         counted; when ``trainer.global_step`` moved (an optimizer step was taken or
                         skipped), ``agent.end_step(loss)`` with the *mean of the micro-batches'
                         training_step losses*, whatever the window's length (the last window of an
                         epoch may be shorter). Manual optimization, a ``training_step`` that returns
                         no loss: the losses it gave to ``manual_backward``, and the step's loss is
                         the *sum* of its micro-batches' (the loss its gradient is of).
                         A step whose every micro-batch returned ``None`` (skipped): Lightning
                         still steps the optimizer and ``global_step``, so ``agent.end_step(None)``:
                         the agent's step stays ``global_step``, and no loss is made up for it.
                         The controller's ``stop`` sets ``trainer.should_stop``;
                         its ``checkpoint`` (and a stop) calls ``trainer.save_checkpoint`` into
                         ``checkpoint_dir`` (default: the ModelCheckpoint's folder, else
                         ``<default_root_dir>/checkpoints``) as ``trainguard-step=<step>.ckpt``.
                         Then ``pl_module.log_dict`` (``on_step=True``) of the LR the step
                         applied: ``trainguard/applied_lr`` (``trainguard/applied_lr_pg<i>`` for
                         further param groups) and its ``trainguard/lr_scale``, to every logger
                         (Lightning's ``LearningRateMonitor`` logs the scheduler's LR, not
                         multiplied by ``lr_scale``)
``on_fit_end``           ``agent.close()`` (also on an exception)
``state_dict``           every Lightning checkpoint carries ``agent.state_dict()``; ``fit(ckpt_path=...)``
                         restores it, so the agent's step count goes on from the checkpoint's
=======================  ============================================================================

Lightning calls ``optimizer.step(closure)``: with ``skip_nonfinite=True`` the closure (forward and
backward of the step's last micro-batch) runs first and the decision is on its gradients; a skipped
step still ran the closure once (``trainer_agent/measure/optim.py``).

Tokens per micro-batch: ``count_tokens(batch)`` when given, else the ``input_ids`` of a mapping or an
integer tensor (alone or first in a tuple/list); another batch has no token count. Keyword arguments
after ``run`` go to ``trainer_agent.attach`` (``config``, ``controller``, ``token``, ...). One
optimizer (automatic optimization, or manual with one optimizer; under manual optimization the
callback wraps the module instance's ``manual_backward`` from fit start to fit end, to add up the
losses it is given, before a GradScaler scales them).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from trainer_agent.integrations import StepSession, tokens_of
from trainer_agent.measure import bucket_views

__all__ = ["TrainguardCallback"]


class TrainguardCallback(Callback):
    """Attach trainguard to the Lightning ``Trainer`` this callback is given to; see the module
    docstring."""

    def __init__(self, *, job: str, run: str, checkpoint_dir: str | os.PathLike[str] | None = None,
                 count_tokens: Callable[[Any], int | None] | None = None, **attach_kwargs: Any) -> None:
        if count_tokens is not None and not callable(count_tokens):
            raise ValueError("count_tokens must be callable as count_tokens(batch) -> int | None")
        self._session = StepSession(job, run, attach_kwargs)
        self._checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self._count_tokens = count_tokens or tokens_of
        self._global_step = 0
        self._restored: dict[str, Any] | None = None
        self._backward_loss: Any = None  # manual optimization: this batch's losses given to manual_backward
        self._summed = False  # the step's loss is the sum of its micro-batches' (their backward losses)
        self._wrapped: tuple[LightningModule, bool, Any] | None = None

    @property
    def agent(self) -> Any:
        """The attached ``trainer_agent.Agent`` (None before ``fit`` starts)."""
        return self._session.agent

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"TrainguardCallback supports one optimizer, the module configured "
                             f"{len(trainer.optimizers)}")
        # Mixed precision with a GradScaler (precision="16-mixed" on a GPU): the plugin's scaler.
        agent = self._session.attach(pl_module, trainer.optimizers[0],
                                     scaler=getattr(trainer.precision_plugin, "scaler", None))
        # The strategy's DDP wrapper (set up before on_fit_start): with gradient_as_bucket_view an
        # ordinary step's gradient norm comes from its buckets (trainer_agent/measure/bucket_views.py).
        index, wrapper = agent.parts.params, getattr(trainer.strategy, "model", None)
        if index.bucket_views is None:
            index.bucket_views = bucket_views.for_model(wrapper, index)
        if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
            agent.parts.meter.backward_pass.ddp = wrapper  # the noise scale's incoming gradients (StepMeter._grads_stay)
        if self._restored is not None:  # fit(ckpt_path=...): the agent goes on from the checkpoint's step
            state, self._restored = self._restored, None
            agent.load_state_dict(state)
        self._backward_loss, self._summed = None, False
        if not pl_module.automatic_optimization:
            self._wrap_manual_backward(pl_module)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After fit(ckpt_path=...) restored the loops (after on_fit_start): the checkpoint's step.
        self._global_step = trainer.global_step

    def state_dict(self) -> dict[str, Any]:
        """Saved by Lightning in every checkpoint: the agent's counters and control state."""
        agent = self._session.agent
        return {} if agent is None else {"agent": agent.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Lightning restores callbacks before ``on_fit_start``: applied to the agent there."""
        self._restored = state_dict.get("agent")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        session = self._session
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        backward, self._backward_loss = self._backward_loss, None
        if not hasattr(loss, "detach") and backward is not None:  # manual optimization, no loss returned
            loss, self._summed = backward, True
        if loss is not None and hasattr(loss, "detach"):
            session.add_micro_batch(loss, self._count_tokens(batch))
        if trainer.global_step == self._global_step:
            return  # accumulating: no optimizer step yet
        self._global_step = trainer.global_step
        # Lightning divides each micro-batch's loss by accumulate_grad_batches (automatic optimization)
        normalised_by = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        count = session.micro_batches
        scale = 1.0 if self._summed or not count else normalised_by / count
        self._summed = False
        # Every micro-batch of the step skipped (training_step returned None): Lightning still took the
        # optimizer step and moved global_step; the agent's step moves with it, without a loss.
        session.end_step(scale, without_loss=True)  # may block while paused
        if session.take_checkpoint_request():
            trainer.save_checkpoint(os.path.join(self._dirpath(trainer), f"trainguard-step={trainer.global_step}.ckpt"))
        applied = session.applied_lrs()
        if applied:
            pl_module.log_dict(applied, on_step=True, on_epoch=False)
        if session.should_stop:
            trainer.should_stop = True

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._unwrap()
        self._session.close()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._unwrap()
        self._session.close()

    # ------------------------------------------------------------------ manual optimization's losses

    def _wrap_manual_backward(self, module: LightningModule) -> None:
        inner = module.manual_backward  # the bound method (or a user's own override)

        def manual_backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                detached = loss.detach()
                self._backward_loss = detached if self._backward_loss is None else self._backward_loss + detached
            except Exception as exc:  # noqa: BLE001 - never raise into the loop; Lightning reports its own
                if self._session.agent is not None:
                    self._session.agent._error("integration_loss", exc)
            return inner(loss, *args, **kwargs)

        self._unwrap()
        self._wrapped = (module, "manual_backward" in vars(module), inner)
        object.__setattr__(module, "manual_backward", manual_backward)

    def _unwrap(self) -> None:
        wrapped, self._wrapped = self._wrapped, None
        if wrapped is not None:
            module, had_own, inner = wrapped
            if had_own:
                object.__setattr__(module, "manual_backward", inner)
            else:
                vars(module).pop("manual_backward", None)

    def _dirpath(self, trainer: Trainer) -> str:
        if self._checkpoint_dir is not None:
            return self._checkpoint_dir
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        return os.fspath(dirpath) if dirpath else os.path.join(trainer.default_root_dir, "checkpoints")

"""trainguard for the Hugging Face ``transformers.Trainer``, in one line (extra ``trainguard[hf]``)::

    from trainer_agent.integrations.hf import TrainguardCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[TrainguardCallback(job="llm-7b", run="llm-7b-0001")])

=====================  ==============================================================================
``on_train_begin``     the model and the real optimizer exist (the Trainer built and prepared them):
                       ``trainer_agent.attach(model, optimizer, ...)``; the optimizer the Trainer
                       hands out is accelerate's ``AcceleratedOptimizer``, the agent hooks the torch
                       optimizer inside it, so lr_scale, pause and skip_nonfinite act on the run.
                       The Trainer's fp16 GradScaler, if any, is passed as ``scaler``.
each micro-batch       the loss the Trainer's ``training_step`` returned (the Trainer's own
                       normalisation: divided by the accumulation steps, or by the step's item count
                       when the model takes ``num_items_in_batch``) is added up on the device, and
                       the ``input_ids`` positions are counted (padding included)
``on_step_end``        ``agent.end_step(sum of those losses, tokens=...)``: the true loss of the
                       optimizer step, the value the Trainer logs as ``loss`` with
                       ``logging_steps=1``. The controller's ``stop`` sets
                       ``control.should_training_stop``; its ``checkpoint`` (and a stop) sets
                       ``control.should_save``: the Trainer saves ``checkpoint-<step>`` as usual
``on_save``            ``agent.state_dict()`` into the checkpoint folder (``trainguard_agent.pt``);
                       a ``train(resume_from_checkpoint=...)`` from ``<output_dir>/checkpoint-<step>``
                       restores it, so the agent's step count goes on from the checkpoint's
``Trainer.log``        each training log (the one with ``learning_rate``) gets the LR the last
                       optimizer step applied, before the Trainer records it: ``trainguard/applied_lr``
                       (``trainguard/applied_lr_pg<i>`` for further param groups) and that step's
                       ``trainguard/lr_scale``. The Trainer's ``learning_rate`` is its scheduler's LR,
                       not multiplied by ``lr_scale``; these keys reach ``state.log_history``, the
                       console and every ``report_to`` integration (W&B, TensorBoard, ...)
``on_train_end``       ``agent.close()``
=====================  ==============================================================================

The callback API does not carry the loss, so at ``on_train_begin`` the callback finds the Trainer
that called it (its caller's frame) and wraps that Trainer instance's ``training_step``; the
wrapper only adds up the returned loss, a device tensor (no host read). It wraps the instance's
``log`` too (``on_log`` would come after the reporting callbacks had sent the logs), and unwraps
both at ``on_train_end``. Keyword arguments after
``run`` go to ``trainer_agent.attach`` (``config``, ``controller``, ``token``, ...). When ``train()``
raises, the Trainer calls no end hook: close the agent in your ``finally`` (``callback.agent.close()``;
a second close does nothing); a later ``train()`` unwraps the Trainer and attaches a new agent all
the same.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from trainer_agent.integrations import StepSession, tokens_of

__all__ = ["TrainguardCallback"]

#: The agent's state in each checkpoint folder the Trainer writes.
_STATE_FILE = "trainguard_agent.pt"
#: Frames between this callback's hook and the Trainer method that called the callback handler.
_MAX_FRAMES = 8


class TrainguardCallback(TrainerCallback):
    """Attach trainguard to the ``Trainer`` this callback is given to; see the module docstring."""

    def __init__(self, *, job: str, run: str, **attach_kwargs: Any) -> None:
        self._session = StepSession(job, run, attach_kwargs)
        self._wrapped: list[tuple[Trainer, str, bool, Any]] = []

    @property
    def agent(self) -> Any:
        """The attached ``trainer_agent.Agent`` (None before training begins)."""
        return self._session.agent

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._unwrap()  # a train() that raised left the Trainer wrapped and its agent open
        self._session.close()
        trainer = self._find_trainer(inspect.currentframe())
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        agent = self._session.attach(kwargs["model"], kwargs["optimizer"], scaler=scaler,
                                     lr_scheduler=kwargs.get("lr_scheduler"))
        saved = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", _STATE_FILE)
        if state.global_step > 0 and os.path.exists(saved):  # resumed from that checkpoint
            agent.load_state_dict(torch.load(saved, weights_only=True))
        self._wrap_training_step(trainer)
        self._wrap_log(trainer)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer has just written ``checkpoint-<step>``: the agent's state goes beside it."""
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if self._session.agent is not None and os.path.isdir(folder) and state.is_world_process_zero:
            torch.save(self._session.agent.state_dict(), os.path.join(folder, _STATE_FILE))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self._session
        session.end_step()  # may block while the controller holds the run paused
        if session.take_checkpoint_request():
            control.should_save = True
        if session.should_stop:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._unwrap()
        self._session.close()

    # ------------------------------------------------------------------ the loss of each micro-batch

    def _find_trainer(self, frame: Any) -> Trainer:
        for _ in range(_MAX_FRAMES):
            if frame is None:
                break
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and self in candidate.callback_handler.callbacks:
                return candidate
            frame = frame.f_back
        raise ValueError("TrainguardCallback must be called by a transformers.Trainer it was given to "
                         "(Trainer(callbacks=[...]) or trainer.add_callback(...))")

    def _wrap_training_step(self, trainer: Trainer) -> None:
        inner = trainer.training_step  # the bound method (or a user's own override)
        session = self._session

        def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            tokens = tokens_of(inputs)  # before the step: it may consume the inputs
            loss = inner(model, inputs, *args, **kwargs)
            session.add_micro_batch(loss, tokens)
            return loss

        self._replace(trainer, "training_step", training_step)

    def _wrap_log(self, trainer: Trainer) -> None:
        inner = trainer.log
        session = self._session

        def log(logs: dict[str, float], *args: Any, **kwargs: Any) -> Any:
            if "learning_rate" in logs:  # a training log: the LR in use beside the scheduler's
                logs.update(session.applied_lrs())
            return inner(logs, *args, **kwargs)

        self._replace(trainer, "log", log)

    def _replace(self, trainer: Trainer, name: str, wrapper: Any) -> None:
        self._wrapped.append((trainer, name, name in vars(trainer), getattr(trainer, name)))
        setattr(trainer, name, wrapper)

    def _unwrap(self) -> None:
        wrapped, self._wrapped = self._wrapped, []
        for trainer, name, had_own, inner in reversed(wrapped):
            if had_own:
                setattr(trainer, name, inner)
            else:
                vars(trainer).pop(name, None)

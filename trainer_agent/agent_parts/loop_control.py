"""What the training loop reads from the agent between steps and saves with its checkpoint: the
controller's requests (``should_stop``, ``exit_code``, ``accumulation_steps``) and the agent's
``state_dict`` (``trainer_agent/agent.py`` is the facade that holds them)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

__all__ = ["LoopControl"]

log = logging.getLogger("trainer_agent.agent")

#: Reports after a change before the spike rules judge again (the default rules' largest ``min_history``).
RUN_CHANGE_REPORTS = 16


class LoopControl:
    """``Agent``'s answers to the loop, on what the agent holds: ``control`` (the control plane,
    or None), ``accumulation_base``, ``clock``, ``reports``, ``lr_scheduler``, ``scheduled_lr``,
    ``parts``, ``config`` and ``errors``."""

    @property
    def accumulation_steps(self) -> int | None:
        """Micro-batches per optimizer step the loop should run now: the run's own
        (``attach(accumulation_steps=...)``) until the controller's ``accumulation`` command
        changes it, at the same step on every rank (None when the run did not opt in)."""
        if self.control is not None and self.control.accumulation_steps is not None:
            return self.control.accumulation_steps
        return self.accumulation_base

    @property
    def should_stop(self) -> bool:
        """True once the controller has asked this run to stop."""
        if self.control is None:
            return False
        try:
            return bool(self.control.should_stop)
        except Exception as exc:
            self.errors.error("control_should_stop", exc)
            return False

    @property
    def exit_code(self) -> int:
        """The exit status the training script should end with once :attr:`should_stop`: 0, or
        ``EXIT_HARDWARE_FAULT`` (75) when the controller stopped the run because a node is faulty,
        so that torchrun, SLURM or Kubernetes restart it without that node (``sys.exit(agent.exit_code)``)."""
        try:
            return int(self.control.exit_code) if self.control is not None else 0
        except Exception as exc:
            self.errors.error("control_should_stop", exc)
            return 0

    def run_changed(self) -> None:
        """Mark a change the run makes on purpose, at the step in progress, after which its metrics
        may jump at once and that is no fault: a new loss weight or normalisation (a loss that
        doubles looks like a loss spike), another objective, another data mixture. Call it on
        every rank, at the same step. The spike guard takes the first spike after it and starts its
        baseline afresh; the controller's spike rules compare each metric only with the reports
        from the next one on (``trainguard_run_changes_total``). Freezing or unfreezing part of the
        model, switching optimizer and a steady loop changing its micro-batches per step are found
        without it. Marks fewer than
        ``RUN_CHANGE_REPORTS`` reports apart are warned about once: the spike rules judge nothing
        until they have a few reports after a change, so marking often leaves spikes unjudged."""
        step, last = self.clock.step, self.clock.run_changed_at
        if last is not None and step - last < RUN_CHANGE_REPORTS * self.config.report_every:
            self.errors.warn_once("run_changed", (
                f"trainguard: run_changed() at step {step}, {step - last} steps after the last: after each change "
                f"the spike rules wait for {RUN_CHANGE_REPORTS} reports before they judge a spike again, so marking "
                "changes this often leaves loss and gradient spikes unjudged. Mark only a change that moves the "
                "loss's scale (a new loss weight or normalisation, another objective or data mixture)."))
        self.clock.run_changed_at = step
        self.clock.run_changes += 1

    def state_dict(self) -> dict[str, Any]:
        """The agent's counters and control state, for the training checkpoint; with an
        ``lr_scheduler`` given to ``attach``, also its ``state_dict()`` (so that restoring the
        agent restores the schedule to the same step, e.g. when rolling back to a checkpoint)."""
        state = self.clock.counters(self.reports)
        if self.control is not None:
            state["control"] = self.control.state_dict()
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        state["scheduled_lr"] = self.scheduled_lr.state_dict() | {"optimizer": self.parts.optimizer_class[0]}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; ``ValueError`` for a foreign dict."""
        self.clock.load_counters(state, self.reports)
        if self.control is not None and "control" in state:
            self.control.load_state_dict(state["control"])
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        saved = state.get("scheduled_lr")  # (older checkpoints lack it: the envelope starts afresh)
        if saved is None:
            return
        if not isinstance(saved, Mapping):
            raise ValueError(f"malformed scheduled-LR state: {type(saved).__name__}, not a dict")
        now = self.parts.optimizer_class[0]
        if saved.get("optimizer", now) != now:
            # Another optimizer's LRs say nothing about this one's (SGD trains at 100x Adam's LR):
            # its envelope starts afresh, as on a run's first step.
            log.info("trainguard: the agent's state was saved with the optimizer %s, this one is %s: the "
                     "learning-rate envelope starts afresh", saved.get("optimizer"), now)
            return
        self.scheduled_lr.load_state_dict(saved)

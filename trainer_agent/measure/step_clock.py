"""The agent's step clock: the optimizer steps counted by ``end_step``, the wall time between
them, the host time spent inside the agent (``overhead_seconds_total``), the GradScaler's skipped
steps and the last step's loss and (loss, gradient norm) row (``trainer_agent/agent.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainer_agent.measure.accumulation_watch import AccumulationWatch

__all__ = ["StepClock"]


class StepClock:
    """``now`` is the agent's clock; the hooks add what they spend to ``overhead`` (this step's),
    which ``Agent.end_step`` moves into ``overhead_total``. The per-step work on these fields stays
    inline in the hooks and in ``end_step`` (the hot path: no call more per step)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now
        self.step = 0
        self.overhead_total = 0.0
        self.overhead = 0.0
        self.last_end = now()
        #: The next step ended is the first this agent times: its wall time runs from attach and
        #: holds the warm-up (torch.compile's compilation, first-call initialisation, a checkpoint's
        #: load), not a step's work, so its report leaves the step's times out.
        self.warm_up = True
        self.amp_skipped = 0
        #: Steps whose backward passes no optimizer step followed, no GradScaler's skip either (the
        #: loop's own skips, or ``end_step`` called per micro-batch: ``Agent.end_step`` tells them apart).
        self.unstepped = 0
        #: A fused optimizer under a GradScaler skips a non-finite step inside its own kernel
        #: (``optimizer.found_inf``, read in the pre-step hook): those steps, counted on the device.
        self.found_inf: torch.Tensor | None = None
        self.amp_fused: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        self.row: torch.Tensor | None = None
        #: Changes the user marked (``Agent.run_changed``): a jump of the metrics there is the run's own.
        self.run_changes = 0
        #: The step of the last mark (``Agent.run_changed``), None before one.
        self.run_changed_at: int | None = None
        #: The loop's micro-batches per optimizer step: a change of a steady count is marked too.
        self.accumulation = AccumulationWatch()

    def read_step(self) -> int:
        """The step reader the collaborators get."""
        return self.step

    def counters(self, reports: Any) -> dict[str, Any]:
        """The agent's checkpointed counters: its steps, the report pipeline's non-finite steps,
        the GradScaler's skipped steps (``Agent.state_dict``, version 1)."""
        return {
            "version": 1,
            "step": self.step,
            # SYNC: checkpoint time only; reads one device scalar.
            "nonfinite_steps_total": float((reports.nonfinite_steps + reports.interval_nonfinite()).item()),
            "amp_skipped_steps_total": self.amp_skipped + (int(self.amp_fused.item()) if self.amp_fused is not None else 0),
            "run_changes_total": self.run_changes,
        }

    def load_counters(self, state: Any, reports: Any) -> None:
        """Restore what ``counters`` returned; ``ValueError`` for a foreign or malformed dict."""
        if not isinstance(state, Mapping) or state.get("version") != 1:
            raise ValueError("not a trainguard agent state dict (version 1)")
        try:
            step = int(state["step"])
            nonfinite = float(state["nonfinite_steps_total"])
            skipped = int(state["amp_skipped_steps_total"])
            changes = int(state.get("run_changes_total", 0))  # (older checkpoints: none marked)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed trainguard agent state dict: {exc}") from None
        if step < 0 or skipped < 0 or changes < 0 or not nonfinite >= 0:
            raise ValueError("malformed trainguard agent state dict: negative counters")
        self.step, self.amp_skipped, self.amp_fused, self.run_changes = step, skipped, None, changes
        reports.nonfinite_steps.fill_(nonfinite)
        reports.rows.clear()  # steps before the restore are not part of the restored run

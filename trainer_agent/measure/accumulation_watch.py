"""A loop that changes how many micro-batches it accumulates per optimizer step, found from the
backward passes the agent counts, and taken as a change of the run.

Cutting gradient accumulation from 4 micro-batches to 1, or switching from averaged to summed
micro-batches, raises the gradient norm's level 1.8-2.6x at once on healthy runs: the spike guard's
median over its window then takes about 64 steps to catch up, and meanwhile ordinary batches at
3-4x the new level read as 5-9x the old one and are skipped. That is the run's own change, as a
new loss weight is (``Agent.run_changed``): a loop that held one count for :data:`HOLD_STEPS`
optimizer steps in a row or more and then runs another is marked as changed at that step, so the
spike guard takes the first spike after it and starts its baseline afresh, and the controller's
spike rules compare with the reports after it (``trainguard_run_changes_total``).

A loop whose count varies from step to step (token-budget batching) never holds one that long and
is never marked, so its guard keeps judging every step. A steady loop whose epoch ends with a
shorter step is marked once there; the steps after it, back at the old count, are not (the short
count held one step).
"""

from __future__ import annotations

__all__ = ["AccumulationWatch", "HOLD_STEPS"]

#: Optimizer steps a count must hold in a row before a change of it is the run's change.
HOLD_STEPS = 64


class AccumulationWatch:
    """The backward passes per optimizer step the loop held, and for how many steps."""

    __slots__ = ("count", "held")

    def __init__(self) -> None:
        #: The count of the last steps with a backward pass (None before the first).
        self.count: int | None = None
        #: Steps in a row that ran :attr:`count` backward passes.
        self.held = 0

    def changes(self, backwards: int) -> bool:
        """Whether a step of ``backwards`` backward passes changes a count held :data:`HOLD_STEPS`
        steps or more (read during the step, on a spike, and at its end)."""
        return bool(backwards) and self.count is not None and backwards != self.count and self.held >= HOLD_STEPS

    def step_ended(self, backwards: int) -> tuple[int, int] | None:
        """Count a finished step of ``backwards`` backward passes (0: none ran, e.g. a step the loop
        skipped: not counted); when it changed a held count (:meth:`changes`), that count and the
        steps it held, else None."""
        if not backwards:
            return None
        before = (self.count, self.held) if self.changes(backwards) else None
        if backwards == self.count:
            self.held += 1
        else:
            self.count, self.held = backwards, 1
        return before

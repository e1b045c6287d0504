"""A report step's host values, handed by the agent's end of step to the report pipeline
(``trainer_agent/report/pipeline.py``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["HostStep"]


@dataclass(frozen=True, slots=True)
class HostStep:
    """What the host knows about the step being reported (no device value)."""

    step: int
    duration: float
    tokens: float | None
    forward_seconds: float
    amp_skipped: int
    input_wait: float = math.nan
    """Mean wait per step for the batch since the last report (``trainer_agent/measure/inputs.py``)."""
    micro_batches: int = 0
    """Backward passes of the step on this rank (the batch size without ``tokens``)."""
    world_size: int = 1
    verify_mismatch: float = math.nan
    """Relative difference of the last gradient recompute check since the last report
    (``trainer_agent/diagnostics/verify.py``; NaN: none)."""
    verify_float32: float = math.nan
    """Relative difference of the last float32 recompute since the last report (NaN: none)."""
    gpu_xid: float = math.nan
    """Last critical XID code of this rank's GPU since the last report (0: none; NaN: not watched)."""
    scheduled_lr: Mapping[str, float] = field(default_factory=dict)
    """What the user's scheduler asked for in the interval (``ScheduledLr.take``: host floats)."""
    comm: Mapping[str, float] = field(default_factory=dict)
    """The interval's gradient communication times (``CommTiming.take``; empty without it)."""
    trainable_elements: float = math.nan
    """Elements of the measured parameters that require a gradient now (``ParamIndex.trainable_elements``)."""
    run_changes: float = math.nan
    """Changes the user marked (``Agent.run_changed``) so far."""
    optimizer_class: float = math.nan
    """A code of the optimizer's class (``measure.optim.optimizer_class``): changes when the run switches optimizer."""
    warm_up: bool = False
    """The first step the agent timed (``StepClock.warm_up``), or a step in which torch.compile
    compiled (``CompileWatch``): its duration, forward time and throughput are the warm-up's or the
    compiler's, left out of the report (absent, NaN in the rank's row)."""
    compile_steps: float = math.nan
    """Steps after the first in which torch.compile compiled (``CompileWatch.compile_steps``)."""

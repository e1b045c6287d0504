"""The ``recovery`` section of a rules file: the rungs of the escalation ladder, the ladders of
each cause of an incident and the policy of the ladder and the LR ramp (taken by
``service/incidents.py``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from trainguard.protocol.commands import REGISTRY
from trainguard.protocol.wire import LR_SCALE_MIN
from trainguard.service.rule_schema import MetricName, RuleName, RulesModel

__all__ = ["CauseLadders", "REMEDY_RUNGS", "RecoveryPolicy", "Rung"]

#: The rungs of the escalation ladder. ``skip`` is taken by the agent itself (its spike guard);
#: the controller takes the others. ``data_skip``: every rank skips the optimizer steps of the
#: batches while the data stays out of bounds (the LR untouched); ``checkpoint``: a checkpoint;
#: ``stop``: the run stops for a restart without the suspect node; ``experiment``: the bounded
#: troubleshooting experiment of an incident of unknown cause (``service/incidents.py``); and each
#: optimizer remedy of the registry (a command with ``remedy``: ``grad_clip`` to the healthy
#: gradient norm, ``reset_optimizer`` of every layer), which only an optimizer fault's ladder (or
#: an unknown one's) may name: none is in a default ladder.
REMEDY_RUNGS: tuple[str, ...] = tuple(c.name for c in REGISTRY if c.remedy)
Rung = Literal[("skip", "adaptive_lr", "rollback", "pause", "data_skip", "checkpoint", "stop", "experiment", *REMEDY_RUNGS)]  # type: ignore[valid-type]


class CauseLadders(RulesModel):
    """The rungs taken for each cause of an incident (``service/cause.py``). ``optimizer``, when
    given, is the ladder of an optimizer fault in place of the ``ladder`` of the ``recovery``
    section; it may name the optimizer remedies (:data:`REMEDY_RUNGS`), which data and hardware
    refuse."""

    data: tuple[Rung, ...] = ("skip", "data_skip", "rollback")
    hardware: tuple[Rung, ...] = ("checkpoint", "pause")
    unknown: tuple[Rung, ...] = ("skip", "experiment", "adaptive_lr", "rollback", "pause")
    optimizer: tuple[Rung, ...] | None = None

    @model_validator(mode="after")
    def _fits(self) -> "CauseLadders":
        remedies = set(REMEDY_RUNGS)
        for cause, rungs, refused in (("data", self.data, {"adaptive_lr", "pause", "experiment"} | remedies),
                                      ("hardware", self.hardware, {"adaptive_lr", "rollback", "experiment", "data_skip"} | remedies),
                                      ("unknown", self.unknown, {"data_skip"}),
                                      ("optimizer", self.optimizer or (), set())):
            if len(set(rungs)) != len(rungs):
                raise ValueError(f"ladders.{cause}: rungs must be distinct")
            bad = sorted(refused & set(rungs))
            if bad:
                raise ValueError(f"ladders.{cause}: {', '.join(bad)} does not fit a fault of that cause")
        if "pause" in self.hardware and "stop" in self.hardware:
            raise ValueError("ladders.hardware: either pause (and page a human) or stop (for a restart without the node)")
        return self


class RecoveryPolicy(RulesModel):
    """The ``recovery`` section of a rules file: the escalation ladder of an incident and the LR
    ramp (``service/incidents.py``)."""

    enabled: bool = True
    ladder: tuple[Rung, ...] = ("skip", "adaptive_lr", "rollback", "pause")
    window_reports: int = Field(default=3, ge=1, le=1000, description="Unhealthy reports a rung gets before the next one is taken.")
    window_steps: int = Field(default=15, ge=0, le=1_000_000, description="Steps a rung gets at least before the next one is taken (for runs that report often).")
    health_rules: tuple[RuleName, ...] = Field(default=("loss_spike",), max_length=256, description="Rules that only notify but whose alert makes a report unhealthy for the ladder (a loss far above its recent level: the weights were hurt).")
    recover_reports: int = Field(default=5, ge=1, le=1000, description="Healthy reports in a row that close an incident as recovered.")
    loss_recovered_ratio: float = Field(default=1.1, ge=1.0, allow_inf_nan=False, description="An optimizer incident whose signals are back is recovered only when its loss (the median of its last recover_reports reports) is at most this x the loss's healthy median before the onset, while the ladder's rollback is still ahead and a good snapshot exists: the faulty steps moved the weights, and the rollback restores them (without a snapshot, the run trains back on its own; no rung is taken for the loss alone). inf: never waits for the loss.")
    rollback_lr_factor: float = Field(default=0.5, ge=LR_SCALE_MIN, le=1.0, allow_inf_nan=False, description="lr_scale factor taken with the rollback rung.")
    skip_limit: int = Field(default=4, ge=1, description="Steps skipped in a row (at a report) that make the report unhealthy.")
    snapshot_confirm_reports: int = Field(default=2, ge=1, le=1000, description="Healthy reports after a snapshot that make it good.")
    metric: MetricName = Field(default="trainguard_update_ratio", description="The measurement adaptive LR and the ramp follow.")
    baseline_reports: int = Field(default=16, ge=1, le=4096, description="Healthy reports whose median is the metric's baseline.")
    degrade_ratio: float = Field(default=1.5, gt=1.0, allow_inf_nan=False, description="The metric above this x its baseline is unhealthy.")
    ramp_steps: int = Field(default=400, ge=1, description="Steps over which lr_scale climbs back to 1.0 once the run is stable.")
    stable_reports: int = Field(default=3, ge=1, le=1000, description="Healthy reports in a row before the ramp starts.")
    ladders: CauseLadders = Field(default_factory=CauseLadders, description="The rungs of an incident whose cause is data, hardware or unknown; an optimizer fault takes 'ladder', or 'ladders.optimizer' when given, which may also name the optimizer remedies grad_clip (the gradient norm clipped to its healthy median) and reset_optimizer (every layer's optimizer state dropped).")
    data_skip_steps: int = Field(default=8, ge=1, le=100_000, description="Steps a data_skip rung skips ahead; renewed while the window's data rules fire.")
    data_skip_max_steps: int = Field(default=512, ge=1, le=1_000_000, description="Most steps one incident skips for its data (a change that lasts longer is the data's new normal).")
    experiment_steps: int = Field(default=10, ge=2, le=10_000, description="Steps of the troubleshooting experiment of an incident of unknown cause.")
    float32_rel_tol: float = Field(default=0.1, gt=0, le=1e6, allow_inf_nan=False, description="The experiment's float32 recompute: a mixed-precision gradient further than this from the same step's in float32 (relative to the layer's norm, the largest over layers and ranks) makes the cause optimizer, its numerics. A healthy bfloat16 step differs by about 0.004-0.015, a float16 one by about 0.0005-0.003.")

    @field_validator("ladder")
    @classmethod
    def _ordered(cls, ladder: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(ladder)) != len(ladder):
            raise ValueError("ladder rungs must be distinct")
        return ladder

    @property
    def optimizer_ladder(self) -> tuple[str, ...]:
        """The rungs of an optimizer fault: ``ladders.optimizer`` when given (it replaces
        ``ladder``), else ``ladder``."""
        return self.ladders.optimizer if self.ladders.optimizer is not None else self.ladder

    def ladder_of(self, cause: str) -> tuple[str, ...]:
        """The rungs of a fault of ``cause``. The user's schedule moving the LR within its own range
        has none: it is no fault, so no incident opens on it (not even on the agent's skips of its
        steps) and nothing climbs; a later report that shows what the schedule cannot explain (a
        non-finite value, the data rules, the loss scaler) is judged afresh."""
        if cause == "schedule":
            return ()
        return tuple(getattr(self.ladders, cause)) if cause in ("data", "hardware", "unknown") else self.optimizer_ladder

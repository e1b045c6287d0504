"""The rules of a rules file, one model per kind (threshold, spike, nonfinite, trend, cross_rank,
desync, rate, oscillation, absence) and :data:`Rule`, the union the ``kind`` field selects from.
Their evaluation is :mod:`service.evaluate`."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, TypeAdapter, field_validator, model_validator

from trainguard.protocol.wire import Severity
from trainguard.service.diagnosis import DIAGNOSES
from trainguard.service.rule_actions import Action, NotifyAction
from trainguard.service.rule_schema import MetricName, RuleName, RulesModel, Vector
from trainguard.service.rules_bounds import MAX_ACTIONS

__all__ = [
    "AbsenceRule", "CrossRankRule", "DesyncRule", "NonFiniteRule", "OscillationRule", "RULE_ADAPTER", "RateRule", "Rule",
    "SpikeRule", "ThresholdRule", "TrendRule",
]


class _RuleBase(RulesModel):
    name: RuleName
    severity: Severity = "warning"
    actions: tuple[Action, ...] = Field(default=(NotifyAction(),), max_length=MAX_ACTIONS)
    cooldown_s: float = Field(default=300.0, ge=0, allow_inf_nan=False, description="After an alert, the rule cannot fire again for this long.")
    cap: int = Field(default=0, ge=0, description="At most this many alerts per cap_window_s (0: no cap).")
    cap_window_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    diagnosis: str = "generic"
    description: str = Field(default="", max_length=2000)
    enabled: bool = True

    @field_validator("actions", mode="before")
    @classmethod
    def _short_actions(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [{"type": a} if isinstance(a, str) else a for a in value]
        return value

    @field_validator("diagnosis")
    @classmethod
    def _known_diagnosis(cls, value: str) -> str:
        if value not in DIAGNOSES:
            raise ValueError(f"unknown diagnosis {value!r}; known: {', '.join(sorted(DIAGNOSES))}")
        return value


class ThresholdRule(_RuleBase):
    """``metric op value`` in each of the newest ``for_reports`` reports carrying the metric."""

    kind: Literal["threshold"]
    metric: MetricName
    op: Literal[">", ">=", "<", "<=", "==", "!="]
    value: float = Field(allow_inf_nan=False)
    for_reports: int = Field(default=1, ge=1, le=4096)
    crossing_window: int = Field(default=0, ge=0, le=65536, description=(
        "Fire only on a crossing: one of the crossing_window reports before the newest for_reports held a finite "
        "value within the limit (0: off). A metric beyond the limit since the run's first report is the run's own "
        "scale, not a change: a loss summed over thousands of tokens gives gradient norms in the thousands from "
        "step 1, and no LR caused those. A gradient norm of 0 is no such value (a report whose steps had no finite "
        "norm may carry it)."))
    crossing_rise: float = Field(default=1.0, ge=1.0, allow_inf_nan=False, description=(
        "With crossing_window: the crossing counts only when each of the newest for_reports values is at least "
        "this multiple of the metric's level before it (for < and <=: at most its level / crossing_rise), the "
        "level being the median of the window's finite values up to its last one within the limit (for a gradient "
        "norm, its positive ones). A metric whose own level is near the limit crosses it back and forth with its "
        "report-to-report noise (a loss summed over a thousand tokens gives gradient norms that wander between "
        "500 and 3,000); a rise from well below the limit, or far above the run's level, is a change. 1: off."))
    settle_steps: int = Field(default=0, ge=0, le=1_000_000, description=(
        "Over the first settle_steps steps of a fresh optimizer state, counted at the oldest of the for_reports "
        "reports, judge against settle_value instead (0: off). The state's age is the agent's "
        "trainguard_optimizer_state_steps (a state that starts afresh while the run's step goes on, on a job "
        "resumed without its optimizer's state, settles; a restored one does not); reports without it (older "
        "agents, optimizers without a step count) count from the run's first step (trainguard_step) and from its "
        "last change of optimizer or of the parameters it trains (trainguard_optimizer_class, "
        "trainguard_trainable_elements). An optimizer state that starts afresh moves the weights by rules of its "
        "own: Adam's bias correction makes its first updates about the LR in every element whatever the "
        "gradient, for about 1 / (1 - beta1) steps."))
    settle_value: float | None = Field(default=None, allow_inf_nan=False, description=(
        "The limit over the first settle_steps steps (none: those reports are not judged)."))

    @model_validator(mode="after")
    def _rise(self) -> "ThresholdRule":
        if self.crossing_rise != 1.0 and (not self.crossing_window or self.op in ("==", "!=")):
            raise ValueError("crossing_rise needs crossing_window and an op of >, >=, < or <=")
        return self


class SpikeRule(_RuleBase):
    """The newest value against a baseline of the previous ``window`` finite values.

    ``mode: ratio`` fires when value / baseline >= ratio (``direction: up``; ``down``: baseline /
    value >= ratio); baselines <= 0 give no verdict. ``mode: zscore`` fires when
    |value - baseline| / scale >= z in the given direction, where for ``baseline: median`` the scale
    is 1.482602 * MAD of the window (1 / Phi^-1(3/4)) and for ``baseline: ema`` the exponentially weighted standard
    deviation (alpha = 2 / (window + 1)). The window holds only the reports since the run last changed
    the elements that train (``trainguard_trainable_elements``: part of the model frozen or unfrozen)
    or its optimizer (``trainguard_optimizer_class``: Adam to SGD), or marked a change
    (``trainguard_run_changes_total``: a new loss weight): before it the metric was another run's.
    """

    kind: Literal["spike"]
    metric: MetricName
    baseline: Literal["median", "ema"] = "median"
    mode: Literal["ratio", "zscore"] = "ratio"
    window: int = Field(default=32, ge=2, le=65536)
    min_history: int = Field(default=8, ge=2)
    ratio: float = Field(default=5.0, gt=1.0, allow_inf_nan=False)
    z: float = Field(default=6.0, gt=0, allow_inf_nan=False)
    direction: Literal["up", "down", "both"] = "up"
    recurring: int = Field(default=0, ge=0, le=1024, description=(
        "Let a value pass (no finding) when the window's metric rose at least half-way to it and came back to "
        "its baseline this many separate times or more: a level the metric keeps visiting and leaving is part "
        "of the run (batches drawn one at a time from sources of different loss), not a spike. A rise that has "
        "not come back (a burst in progress, the start of training) does not count. 0: off."))
    trend_with: MetricName | None = Field(default=None, description=(
        "Ratio mode, upwards, from the median: while this metric (the loss) is at or below its median over the "
        "same reports, and the window and the value climbed report by report (none more than 2x the largest of "
        "the 3 before it), judge the value against where the window's own rising trend puts it (a robust line "
        "through the logarithms of its values, Theil-Sen) when that is above the median: a gradient norm that "
        "climbs while the loss falls (a diffusion model's first hundred steps) is the run's, not a spike. A "
        "jump, a level that jumped within the window, or a rise with the loss rising too is judged against "
        "the median. Ignored in other modes (a job's override of the mode keeps the rule valid)."))
    schedule_discount: bool = Field(default=False, description=(
        "Divide the spike's score by how far the user's scheduled LR rose over the same window (its newest value "
        "/ its median there) while the schedule stays within its range: a warm restart or a re-warm moves the "
        "gradient norm and the loss with the LR it planned. No discount when the scheduled LR is above the highest "
        "LR the schedule had set before the window (a jump, not a plan)."))

    @model_validator(mode="after")
    def _history(self) -> "SpikeRule":
        if self.min_history > self.window:
            raise ValueError("min_history must be <= window")
        return self


class NonFiniteRule(_RuleBase):
    """NaN or ±Inf in the newest value of ``metric`` or in any rank of the newest ``vectors``."""

    kind: Literal["nonfinite"]
    metric: MetricName | None = None
    vectors: tuple[Vector, ...] = ()
    scaler_halvings: int = Field(default=0, ge=0, le=64, description=(
        "Let non-finite values pass in a report whose steps the mixed-precision loss scaler skipped "
        "(trainguard_amp_skipped_steps_total rose since the report before: the weights did not move) while its "
        "loss scale (trainguard_loss_scale) is at most this many halvings below its median over the newest "
        "scaler_window reports since it took its first step, and before that step (the scaler halves its scale "
        "step after step until the gradients fit). A GradScaler doubles its scale after growth_interval steps "
        "without an overflow and halves it back at the next one, a skipped step each time, so its scale stays "
        "around its level; gradients that overflow more often than that push it below. Reports without a loss scale (no GradScaler: "
        "bfloat16, float32, a scaler of another library) are judged as before. 0: off."))
    scaler_window: int = Field(default=64, ge=1, le=65536)

    @model_validator(mode="after")
    def _something(self) -> "NonFiniteRule":
        if self.metric is None and not self.vectors:
            raise ValueError("nonfinite rule needs 'metric' and/or 'vectors'")
        return self


class TrendRule(_RuleBase):
    """Over the newest ``window`` finite values: ``not_decreasing`` fires when the least-squares
    line falls by less than ``min_rel_change`` x |mean| over the window; ``increasing`` fires when
    the values never decrease and the last exceeds the first by at least ``min_rel_change`` x
    |first| (and is larger)."""

    kind: Literal["trend"]
    metric: MetricName
    direction: Literal["not_decreasing", "increasing"]
    window: int = Field(default=64, ge=3, le=65536)
    min_rel_change: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    min_run_fraction: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False, description=(
        "not_decreasing only: judge the window only while it covers at least this fraction of the run's optimizer "
        "steps so far (the trainguard_step of its oldest report at most 1 - min_run_fraction times the newest's; "
        "reports without trainguard_step are always judged). A loss that stopped falling over the latter part of "
        "the run is stuck; late in a long run the window is a short stretch of it, over which a loss converging "
        "to its plateau falls by less than the noise of one batch's loss. 0: always."))


class CrossRankRule(_RuleBase):
    """Across the ranks of one report, for each of the newest ``for_reports`` reports.

    ``check: spread`` judges a rank slow in a report when its value / the median of the other
    ranks' finite values >= ratio and its value is at least ``min_value`` (a straggler for
    ``step_time_s``; for ``input_wait_s`` a rank that waits for its data while the others do not;
    a median of 0 then counts as an infinite ratio), and fires when the same rank is slow in more
    than half of the reports judged (its median ratio reaches ``ratio``): the newest report back to
    the newest one at least ``for_steps`` steps before it, ``for_reports`` reports at least (none
    that far back yet: no finding). A burst of a few slow steps on one rank, or scheduling noise
    that lands on a different rank each time, is not one rank that stays slow; a span in steps
    judges alike whatever the reporting interval. It names every such rank: up to half of the
    ranks slow together (``service/slow_ranks.py``).
    ``check: mismatch`` fires when some rank is non-finite or differs from the median by more than
    rel_tol x max(|median|, 1e-30) (desync of fingerprints; the stability guide, 5.3: < 1e-5).
    ``check: above`` fires when some rank's finite value is >= ``value`` and names those ranks
    (``data_overlap``: ranks that see the same data).
    """

    kind: Literal["cross_rank"]
    vector: Vector
    check: Literal["spread", "mismatch", "above"]
    ratio: float = Field(default=1.5, gt=1.0, allow_inf_nan=False)
    rel_tol: float = Field(default=1e-5, ge=0, allow_inf_nan=False)
    min_value: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    value: float | None = Field(default=None, allow_inf_nan=False)
    for_reports: int = Field(default=1, ge=1, le=1024)
    for_steps: int = Field(default=0, ge=0, le=1023, description=(
        "check: spread only: the reports judged reach back at least this many steps (the per-rank history kept "
        "must hold for_steps + 1 reports: one a step). 0: the newest for_reports reports."))

    @model_validator(mode="after")
    def _limit(self) -> "CrossRankRule":
        if (self.check == "above") != (self.value is not None):
            raise ValueError("'value' is required by check: above, and only by it")
        if self.for_steps and self.check != "spread":
            raise ValueError("'for_steps' is read by check: spread only")
        return self


class DesyncRule(_RuleBase):
    """Any rank whose ``vector`` (``grad_desync`` or ``param_desync``: its largest relative
    difference from the other ranks over the layers' element-wise fingerprints) exceeds
    ``rel_tol`` (the stability guide, 5.3: 1e-5). Names the ranks and, from the report's
    ``desync`` list, the layers. NaN (a rank whose report failed, or one rank) is no verdict."""

    kind: Literal["desync"]
    vector: Literal["grad_desync", "param_desync"]
    rel_tol: float = Field(default=1e-5, ge=0, allow_inf_nan=False)


class RateRule(_RuleBase):
    """A counter's increase per unit of ``per``, ``(metric[-1] - metric[0]) / (per[-1] - per[0]) >
    value`` (e.g. the share of steps whose update the mixed-precision loss scaler skipped), from
    the newest report back to the oldest of the ``window`` reports before it, or with
    ``min_steps`` to the newest of them that lies at least ``min_steps`` of ``per`` back (none: no
    verdict), so that the rate is measured over the same span of steps whatever the reporting
    interval. ``leave_out_startup``: the reports in which the counter still equals ``per`` (every
    step so far counted: a loss scaler skips each step until it finds its scale) are left out, the
    rate measured from the first report after them."""

    kind: Literal["rate"]
    metric: MetricName
    per: MetricName = "trainguard_step"
    window: int = Field(default=10, ge=1, le=65536)
    value: float = Field(ge=0, allow_inf_nan=False)
    min_steps: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    leave_out_startup: bool = False


class OscillationRule(_RuleBase):
    """A periodic swing of ``metric`` over the newest ``window`` reports: after removing the
    least-squares line, the strongest frequency (with its two neighbours) holds at least
    ``min_power`` of the variance, its period lies between ``min_period`` reports and half the
    window, the residual repeats itself one period later (its autocorrelation at that lag is at
    least ``min_autocorrelation``: a single bump, e.g. the loss of a burst of bad batches, puts its
    power at a long period too, but does not recur), and the swing's amplitude (sqrt(2) x the
    residual's standard deviation) is at least ``min_rel_amplitude`` of the metric's mean."""

    kind: Literal["oscillation"]
    metric: MetricName
    window: int = Field(default=64, ge=8, le=65536)
    min_power: float = Field(default=0.5, gt=0, le=1, allow_inf_nan=False)
    min_period: float = Field(default=2.0, ge=2, allow_inf_nan=False)
    min_autocorrelation: float = Field(default=0.2, ge=-1, le=1, allow_inf_nan=False)
    min_rel_amplitude: float = Field(default=0.01, ge=0, allow_inf_nan=False)


class AbsenceRule(_RuleBase):
    """No report for ``seconds``, counted from the later of the last report and the moment the
    run last became live (registered, re-registered or unpaused: a paused run sends nothing)."""

    kind: Literal["absence"]
    seconds: float = Field(default=300.0, gt=0, allow_inf_nan=False)


Rule = Annotated[
    Union[ThresholdRule, SpikeRule, NonFiniteRule, TrendRule, CrossRankRule, DesyncRule, RateRule,
          OscillationRule, AbsenceRule],
    Field(discriminator="kind"),
]

#: Validates one rule (a job's override merged into the rule it names).
RULE_ADAPTER = TypeAdapter(Rule)

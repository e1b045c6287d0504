"""Rules: a YAML file validated by pydantic (their evaluation, pure functions of a
:class:`~service.window.RuleWindow`, is :mod:`service.evaluate`).

A rules file::

    version: 1
    rules:
      - name: grad_norm_high
        kind: threshold
        metric: trainguard_grad_norm
        op: ">"
        value: 1000
        severity: warning
        actions: [notify, {type: lr_scale, factor: 0.5}]
        cooldown_s: 300
        cap: 3              # at most 3 alerts of this rule per cap_window_s
        diagnosis: grad_explosion
    jobs:                   # per-job overrides, by job name
      llm-7b:
        - {name: grad_norm_high, value: 5000}    # fields merged into the rule of that name
        - {name: data_duplicate_ratio, enabled: false}

Kinds: ``threshold`` (metric op value for N consecutive reports), ``spike`` (newest value against
the rolling median or EMA of the previous window: ratio or z-score), ``nonfinite`` (NaN/Inf in a
value or in any rank's vector), ``trend`` (not decreasing over a window, or growing monotonically),
``cross_rank`` (``spread``: max/median across ranks, names the straggler; ``mismatch``: ranks whose
fingerprint differs from the median by more than a relative tolerance; ``above``: ranks whose value
reaches a limit, e.g. ranks that see the same data), ``desync`` (ranks whose per-layer element-wise
fingerprints differ from the others', naming the ranks and the layers), ``rate`` (a counter's
increase per step), ``oscillation`` (a periodic swing; both evaluated in :mod:`service.rate_and_oscillation`)
and ``absence`` (no report for T seconds).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError, field_validator, model_validator

from trainguard.service.diagnosis import DIAGNOSES
from pydantic import AfterValidator

from trainguard.service.rule_names import CHECK_NAMES, known_metric, known_vector
from trainguard.service.window import RuleWindow
from trainguard.protocol.commands import (  # the commands' rule actions, re-exported here
    REGISTRY, RULE_ACTIONS, CheckpointAction, GradClipAction, LrScaleAction, MemoryTraceAction, MomentumAction,
    PauseAction, ResetOptimizerAction, RollbackAction, StopAction, VerifyAction, WeightDecayScaleAction,
)
from trainguard.protocol.wire import LR_SCALE_MAX, LR_SCALE_MIN, Name, Severity

__all__ = [
    "Action", "ADAPTIVE_FALLBACK_FACTOR", "AdaptiveLrAction", "NotifyAction", "PauseAction", "CheckpointAction", "StopAction",
    "LrScaleAction", "RollbackAction", "MemoryTraceAction", "VerifyAction", "GradClipAction", "ResetOptimizerAction",
    "MomentumAction", "WeightDecayScaleAction", "Rung", "REMEDY_RUNGS", "RecoveryPolicy", "CauseLadders", "Rule", "RulesFile", "RuleSet", "RulesError", "load_rules", "default_rules_text",
    "ThresholdRule", "SpikeRule", "NonFiniteRule", "TrendRule", "CrossRankRule", "DesyncRule", "RateRule",
    "OscillationRule", "AbsenceRule", "MAX_RULES", "MAX_ACTIONS", "MAX_JOBS", "MAX_OVERRIDES", "MAX_NODES",
    "REMOVE_ALL_PARAM", "require_rules",
]

#: Limits of a rules file. Validation takes time in proportion to these, so a file within them is
#: validated in well under a second; beyond them it is refused with the limit named. They bound
#: the file *after* YAML aliases are expanded (``&anchor`` / ``*alias``): a 16 KB file whose
#: aliases multiply through jobs, overrides and actions is refused before it is validated.
MAX_RULES = 1000
MAX_ACTIONS = 16  # per rule
MAX_JOBS = 1000  # jobs with overrides
MAX_OVERRIDES = 10_000  # overrides over all jobs
MAX_NODES = 200_000  # YAML nodes (mappings, lists, scalars, keys included) with every alias expanded

#: A report value a rule reads; with ``check_names`` one no report carries is refused (``service/rule_names.py``).
MetricName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"), AfterValidator(known_metric)]
RuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
#: A per-rank vector a rule reads (``trainguard.protocol.rank_values.RULE_VECTORS``; any other is refused).
Vector = Annotated[str, AfterValidator(known_vector)]


class RulesError(ValueError):
    """A rules file that does not validate; ``reasons`` lists every problem."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("invalid rules: " + "; ".join(reasons))
        self.reasons = reasons


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- actions ---------------------------------------------------------------------------------
class NotifyAction(_Model):
    """Send the alert to every webhook whose min_severity it reaches."""

    type: Literal["notify"] = "notify"


#: What ``adaptive_lr`` multiplies the scale by when it has no measurement to compute from (and
#: the factor Prometheus-side alerts, which cannot measure, ask Alertmanager for).
ADAPTIVE_FALLBACK_FACTOR = 0.5


class AdaptiveLrAction(_Model):
    """Set ``lr_scale`` from the measurement (``service/adaptive_lr.py``): current scale x the
    healthy baseline of ``metric`` (median of the last healthy reports before the onset) / its
    value now, clamped to [min, max]. Without a baseline yet it halves the scale. Once the run is
    stable the controller ramps the scale back towards 1.0 (the ``recovery`` section)."""

    type: Literal["adaptive_lr"] = "adaptive_lr"
    metric: MetricName = "trainguard_update_ratio"
    min: float = Field(default=LR_SCALE_MIN, ge=LR_SCALE_MIN, le=LR_SCALE_MAX, allow_inf_nan=False)
    max: float = Field(default=1.0, ge=LR_SCALE_MIN, le=LR_SCALE_MAX, allow_inf_nan=False)

    @model_validator(mode="after")
    def _bounds(self) -> "AdaptiveLrAction":
        if self.min > self.max:
            raise ValueError("adaptive_lr: min must be <= max")
        return self


#: A rules file's actions: ``notify`` and ``adaptive_lr`` (the service's own) and every command of
#: the registry with a rule action (``trainguard.protocol.commands.REGISTRY``).
Action = Annotated[Union[(NotifyAction, AdaptiveLrAction, *RULE_ACTIONS)], Field(discriminator="type")]  # type: ignore[valid-type]

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


class CauseLadders(_Model):
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


class RecoveryPolicy(_Model):
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


# -- rules -----------------------------------------------------------------------------------
class _RuleBase(_Model):
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


class SpikeRule(_RuleBase):
    """The newest value against a baseline of the previous ``window`` finite values.

    ``mode: ratio`` fires when value / baseline >= ratio (``direction: up``; ``down``: baseline /
    value >= ratio); baselines <= 0 give no verdict. ``mode: zscore`` fires when
    |value - baseline| / scale >= z in the given direction, where for ``baseline: median`` the scale
    is 1.482602 * MAD of the window (1 / Phi^-1(3/4)) and for ``baseline: ema`` the exponentially weighted standard
    deviation (alpha = 2 / (window + 1)).
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


class CrossRankRule(_RuleBase):
    """Across the ranks of one report, for each of the newest ``for_reports`` reports.

    ``check: spread`` fires when max / median of the finite values >= ratio and the max is at least
    ``min_value`` (a straggler for ``step_time_s``; for ``input_wait_s`` a rank that waits for its
    data while the others do not; a median of 0 then counts as an infinite ratio), with the same
    rank the slowest in each of the ``for_reports`` reports (one rank that stays slow, not
    scheduling noise that lands on a different rank each time).
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

    @model_validator(mode="after")
    def _limit(self) -> "CrossRankRule":
        if (self.check == "above") != (self.value is not None):
            raise ValueError("'value' is required by check: above, and only by it")
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
    """A counter's increase per unit of ``per`` over the newest ``window`` + 1 reports:
    ``(metric[-1] - metric[0]) / (per[-1] - per[0]) > value`` (e.g. the share of steps whose
    update the mixed-precision loss scaler skipped)."""

    kind: Literal["rate"]
    metric: MetricName
    per: MetricName = "trainguard_step"
    window: int = Field(default=10, ge=1, le=65536)
    value: float = Field(ge=0, allow_inf_nan=False)


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
_RULE = TypeAdapter(Rule)


class RulesFile(_Model):
    """The rules file as written."""

    version: Literal[1] = 1
    recovery: RecoveryPolicy = Field(default_factory=RecoveryPolicy)
    rules: tuple[Rule, ...] = Field(default=(), max_length=MAX_RULES)
    jobs: dict[Name, tuple[dict[str, Any], ...]] = Field(default_factory=dict, max_length=MAX_JOBS)

    @field_validator("rules")
    @classmethod
    def _unique(cls, rules: tuple[Any, ...]) -> tuple[Any, ...]:
        dup = sorted(name for name, n in Counter(r.name for r in rules).items() if n > 1)
        if dup:
            raise ValueError(f"duplicate rule names: {', '.join(dup)}")
        return rules


@dataclass(frozen=True, slots=True)
class RuleSet:
    """Validated rules with every job's overrides resolved."""

    file: RulesFile
    text: str
    by_job: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    base: tuple[Any, ...] = ()
    absence_by_job: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    absence_base: tuple[Any, ...] = ()

    def for_job(self, job: str) -> tuple[Any, ...]:
        """The enabled rules that apply to ``job``."""
        return self.by_job.get(job, self.base)

    def absence_for_job(self, job: str) -> tuple[Any, ...]:
        """The enabled absence rules that apply to ``job`` (what the controller's clock evaluates;
        the same tuple each time, so the evaluation's plan for it is made once)."""
        return self.absence_by_job.get(job, self.absence_base)

    def capacity_needed(self) -> tuple[int, int]:
        """(reports, per-rank reports) the largest rule window needs."""
        reports, ranks = 1, 1
        for rules in (self.base, *self.by_job.values()):
            for r in rules:
                if isinstance(r, (SpikeRule, TrendRule)):
                    reports = max(reports, r.window + 1)
                elif isinstance(r, ThresholdRule):
                    reports = max(reports, r.for_reports)
                elif isinstance(r, CrossRankRule):
                    ranks = max(ranks, r.for_reports)
                elif isinstance(r, (RateRule, OscillationRule)):
                    reports = max(reports, r.window + 1)
        return reports, ranks


def _resolve_job(base: tuple[Any, ...], job: str, patches: tuple[dict[str, Any], ...], reasons: list[str],
                 context: dict[str, Any]) -> tuple[Any, ...]:
    rules = {r.name: r for r in base}
    for i, patch in enumerate(patches):
        name = patch.get("name")
        if not isinstance(name, str):
            reasons.append(f"jobs.{job}[{i}]: an override needs a 'name'")
            continue
        merged = {**rules[name].model_dump(), **patch} if name in rules else dict(patch)
        try:
            rules[name] = _RULE.validate_python(merged, context=context)
        except ValidationError as e:
            reasons.extend(f"jobs.{job}[{i}] ({name}): {_fmt(err)}" for err in e.errors())
    return tuple(r for r in rules.values() if r.enabled)


def _fmt(err: Any) -> str:
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return f"{loc}: {err['msg']}" if loc else err["msg"]


def _parse(text: str | bytes) -> Any:
    """The YAML (or JSON) document, refused when it holds more than :data:`MAX_NODES` nodes with
    its aliases expanded (counted on the composed node graph, before any object is built)."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded = _expanded_nodes(node)
        if expanded > MAX_NODES:
            raise RulesError([f"the rules file holds more than {MAX_NODES:,} YAML nodes once its aliases are expanded "
                              f"(the limit of a rules file); write the rules out without multiplying aliases"])
        return loader.construct_document(node)
    finally:
        loader.dispose()


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _expanded_nodes(root: yaml.Node) -> int:
    """How many nodes ``root`` has when every alias is written out, counting stops past
    :data:`MAX_NODES` (iterative and memoised: linear in the distinct nodes; a node that holds
    itself counts as too many)."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    todo: list[tuple[yaml.Node, bool]] = [(root, False)]
    while todo:
        node, done = todo.pop()
        key = id(node)
        if done:
            children = _children(node)
            sizes[key] = min(1 + sum(sizes[id(c)] for c in children), MAX_NODES + 1)
            open_.discard(key)
            continue
        if key in sizes:
            continue
        if key in open_:
            return MAX_NODES + 1  # an alias to one of its own ancestors: infinitely large
        open_.add(key)
        todo.append((node, True))
        todo.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def load_rules(text: str | bytes, *, max_reports: int | None = None, max_rank_reports: int | None = None,
               check_names: bool = False) -> RuleSet:
    """Parse and validate a rules file (YAML or JSON). ``RulesError`` lists every problem; the
    capacity limits, when given, are those of the controller's windows. The file must stay within
    :data:`MAX_NODES`, :data:`MAX_RULES`, :data:`MAX_ACTIONS`, :data:`MAX_JOBS` and
    :data:`MAX_OVERRIDES`. ``check_names``: refuse a metric no report carries, naming the closest
    known ones (``service/rule_names.py``; per-rank vectors are always checked)."""
    context = {CHECK_NAMES: check_names}
    try:
        data = _parse(text) if text else {}
    except yaml.YAMLError as e:
        if "maximum nesting depth" in str(e):  # libyaml's own limit
            raise RulesError(["the rules file is nested too deeply to be a rules file"]) from None
        raise RulesError([f"not valid YAML: {e}"]) from None
    except RecursionError:
        raise RulesError(["the rules file is nested too deeply to be a rules file"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RulesError(["the rules file must be a mapping with a 'rules' list"])
    _check_counts(data)
    try:
        file = RulesFile.model_validate(data, context=context)
    except RecursionError:
        raise RulesError(["the rules file is nested too deeply to be a rules file"]) from None
    except ValidationError as e:
        raise RulesError([_fmt(err) for err in e.errors()]) from None
    reasons: list[str] = []
    base = tuple(r for r in file.rules if r.enabled)
    by_job = {job: _resolve_job(file.rules, job, patches, reasons, context) for job, patches in file.jobs.items()}
    def absence(rules: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(r for r in rules if isinstance(r, AbsenceRule))

    rs = RuleSet(file=file, text=text.decode() if isinstance(text, bytes) else text, by_job=by_job, base=base,
                 absence_by_job={job: absence(rules) for job, rules in by_job.items()}, absence_base=absence(base))
    reports, rank_reports = rs.capacity_needed()
    if max_reports is not None and reports > max_reports:
        reasons.append(f"a rule needs {reports} reports of history; the controller keeps {max_reports} (TRAINGUARD_WINDOW_REPORTS)")
    if max_rank_reports is not None and rank_reports > max_rank_reports:
        reasons.append(f"a cross_rank rule needs {rank_reports} reports of per-rank history; the controller keeps {max_rank_reports} (TRAINGUARD_RANK_WINDOW_REPORTS)")
    if reasons:
        raise RulesError(reasons)
    return rs


def _check_counts(data: dict[str, Any]) -> None:
    """Refuse more rules, jobs or overrides than the limits before any of them is validated."""
    reasons = []
    rules, jobs = data.get("rules"), data.get("jobs")
    if isinstance(rules, list) and len(rules) > MAX_RULES:
        reasons.append(f"rules: {len(rules):,} rules; a rules file holds at most {MAX_RULES:,}")
    if isinstance(jobs, dict):
        if len(jobs) > MAX_JOBS:
            reasons.append(f"jobs: overrides for {len(jobs):,} jobs; a rules file holds at most {MAX_JOBS:,}")
        overrides = sum(len(p) for p in jobs.values() if isinstance(p, list))
        if overrides > MAX_OVERRIDES:
            reasons.append(f"jobs: {overrides:,} overrides in all; a rules file holds at most {MAX_OVERRIDES:,}")
    if reasons:
        raise RulesError(reasons)


#: The query parameter of ``PUT /v1/rules`` that confirms a file with ``rules: []``.
REMOVE_ALL_PARAM = "remove_all_rules"


def require_rules(rules: RuleSet, *, remove_all: bool) -> None:
    """Refuse replacing the rules by a file without any (an empty body, or one without a
    ``rules`` list, would remove every rule, the built-in safety rules included), unless the file
    says ``rules: []`` explicitly and ``remove_all`` confirms it."""
    if rules.file.rules:
        return
    explicit = "rules" in rules.file.model_fields_set
    if explicit and remove_all:
        return
    said = "says 'rules: []'" if explicit else "has no 'rules' list"
    raise RulesError([
        f"the file {said}: it would remove every rule, loss_nonfinite and the other safety rules included. "
        "To turn one rule off, set 'enabled: false' on it; to really remove every rule, send 'rules: []' "
        f"with ?{REMOVE_ALL_PARAM}=true"])


def default_rules_text() -> str:
    """The shipped default rules (``service/default_rules.yaml``)."""
    return (resources.files("trainguard.service") / "default_rules.yaml").read_text(encoding="utf-8")


# -- evaluation ------------------------------------------------------------------------------

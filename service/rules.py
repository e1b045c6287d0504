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
``cross_rank`` (``spread``: each rank against the median of the other ranks, names the stragglers; ``mismatch``: ranks whose
fingerprint differs from the median by more than a relative tolerance; ``above``: ranks whose value
reaches a limit, e.g. ranks that see the same data), ``desync`` (ranks whose per-layer element-wise
fingerprints differ from the others', naming the ranks and the layers), ``rate`` (a counter's
increase per step), ``oscillation`` (a periodic swing; both evaluated in :mod:`service.rate_and_oscillation`)
and ``absence`` (no report for T seconds).

This module is the rules' public face, re-exporting each part from where it lives: the rule kinds
(:mod:`service.rule_kinds`), their actions (:mod:`service.rule_actions`), the ``recovery`` section
(:mod:`service.recovery_policy`), the file and the rules in force (:mod:`service.rule_set`), the
file's limits (:mod:`service.rules_bounds`) and its loading (:mod:`service.rules_loading`).
"""

from __future__ import annotations

from trainguard.service.recovery_policy import REMEDY_RUNGS, CauseLadders, RecoveryPolicy, Rung
from trainguard.service.rule_actions import (
    ADAPTIVE_FALLBACK_FACTOR, Action, AdaptiveLrAction, CheckpointAction, GradClipAction, LrScaleAction, MemoryTraceAction,
    MomentumAction, NotifyAction, PauseAction, ResetOptimizerAction, RollbackAction, StopAction, VerifyAction,
    WeightDecayScaleAction,
)
from trainguard.service.rule_kinds import (
    AbsenceRule, CrossRankRule, DesyncRule, NonFiniteRule, OscillationRule, RateRule, Rule, SpikeRule, ThresholdRule,
    TrendRule,
)
from trainguard.service.rule_schema import RulesError
from trainguard.service.rule_set import REMOVE_ALL_PARAM, RuleSet, RulesFile, require_rules
from trainguard.service.rules_bounds import MAX_ACTIONS, MAX_JOBS, MAX_NODES, MAX_OVERRIDES, MAX_RULES
from trainguard.service.rules_loading import default_rules_text, load_rules

__all__ = [
    "Action", "ADAPTIVE_FALLBACK_FACTOR", "AdaptiveLrAction", "NotifyAction", "PauseAction", "CheckpointAction", "StopAction",
    "LrScaleAction", "RollbackAction", "MemoryTraceAction", "VerifyAction", "GradClipAction", "ResetOptimizerAction",
    "MomentumAction", "WeightDecayScaleAction", "Rung", "REMEDY_RUNGS", "RecoveryPolicy", "CauseLadders", "Rule", "RulesFile", "RuleSet", "RulesError", "load_rules", "default_rules_text",
    "ThresholdRule", "SpikeRule", "NonFiniteRule", "TrendRule", "CrossRankRule", "DesyncRule", "RateRule",
    "OscillationRule", "AbsenceRule", "MAX_RULES", "MAX_ACTIONS", "MAX_JOBS", "MAX_OVERRIDES", "MAX_NODES",
    "REMOVE_ALL_PARAM", "require_rules",
]

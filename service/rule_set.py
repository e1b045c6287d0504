"""A validated rules file (:class:`RulesFile`, as written) and the rules in force
(:class:`RuleSet`: every job's overrides resolved), and the confirmation a file without rules needs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, field_validator

from trainguard.protocol.wire import Name
from trainguard.service.recovery_policy import RecoveryPolicy
from trainguard.service.rule_kinds import (
    CrossRankRule, NonFiniteRule, OscillationRule, RateRule, Rule, SpikeRule, ThresholdRule, TrendRule,
)
from trainguard.service.rule_schema import RulesError, RulesModel
from trainguard.service.rules_bounds import MAX_JOBS, MAX_RULES

__all__ = ["REMOVE_ALL_PARAM", "RuleSet", "RulesFile", "require_rules"]


class RulesFile(RulesModel):
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
                    reports = max(reports, r.for_reports + r.crossing_window)
                elif isinstance(r, CrossRankRule):
                    ranks = max(ranks, r.for_reports, r.for_steps + 1)
                elif isinstance(r, (RateRule, OscillationRule)):
                    reports = max(reports, r.window + 1)
                elif isinstance(r, NonFiniteRule) and r.scaler_halvings:
                    reports = max(reports, r.scaler_window + 1)
        return reports, ranks


#: The query parameter of ``PUT /v1/rules`` that confirms a file with ``rules: []``.
REMOVE_ALL_PARAM = "remove_all_rules"


def require_rules(rules: RuleSet, *, remove_all: bool, source: str = "api") -> None:
    """Refuse replacing the rules by a file without any (an empty body or file, or one without a
    ``rules`` list, would remove every rule, the built-in safety rules included), unless the file
    says ``rules: []`` explicitly and ``remove_all`` confirms it (``PUT /v1/rules`` with
    ``?remove_all_rules=true``; a ``--rules`` file's own ``rules: []`` confirms itself).
    ``source``: ``"api"`` or ``"file"``, for how the message says to confirm."""
    if rules.file.rules:
        return
    explicit = "rules" in rules.file.model_fields_set
    if explicit and remove_all:
        return
    said = "says 'rules: []'" if explicit else "has no 'rules' list"
    confirm = (f"send 'rules: []' with ?{REMOVE_ALL_PARAM}=true" if source == "api"
               else "write 'rules: []' in the file")
    raise RulesError([
        f"the file {said}: it would remove every rule, loss_nonfinite and the other safety rules included. "
        f"To turn one rule off, set 'enabled: false' on it; to really remove every rule, {confirm}"])

"""Loading a rules file: the YAML (or JSON) parsed within its bounds (:mod:`service.rules_bounds`),
validated, and every job's overrides merged into the rules they name (a :class:`RuleSet`)."""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml
from pydantic import ValidationError

from trainguard.service.rule_kinds import RULE_ADAPTER, AbsenceRule
from trainguard.service.rule_names import CHECK_NAMES
from trainguard.service.rule_schema import RulesError
from trainguard.service.rule_set import RuleSet, RulesFile
from trainguard.service.rules_bounds import check_counts, parse_bounded

__all__ = ["default_rules_text", "load_rules"]


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
            rules[name] = RULE_ADAPTER.validate_python(merged, context=context)
        except ValidationError as e:
            reasons.extend(f"jobs.{job}[{i}] ({name}): {_fmt(err)}" for err in e.errors())
    return tuple(r for r in rules.values() if r.enabled)


def _fmt(err: Any) -> str:
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return f"{loc}: {err['msg']}" if loc else err["msg"]


def load_rules(text: str | bytes, *, max_reports: int | None = None, max_rank_reports: int | None = None,
               check_names: bool = False) -> RuleSet:
    """Parse and validate a rules file (YAML or JSON). ``RulesError`` lists every problem; the
    capacity limits, when given, are those of the controller's windows. The file must stay within
    :data:`MAX_NODES`, :data:`MAX_RULES`, :data:`MAX_ACTIONS`, :data:`MAX_JOBS` and
    :data:`MAX_OVERRIDES`. ``check_names``: refuse a metric no report carries, naming the closest
    known ones (``service/rule_names.py``; per-rank vectors are always checked)."""
    context = {CHECK_NAMES: check_names}
    try:
        data = parse_bounded(text) if text else {}
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
    check_counts(data)
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


def default_rules_text() -> str:
    """The shipped default rules (``service/default_rules.yaml``)."""
    return (resources.files("trainguard.service") / "default_rules.yaml").read_text(encoding="utf-8")

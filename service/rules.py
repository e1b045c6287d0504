"""Rules: a YAML file validated by pydantic, and their evaluation as pure functions of a
:class:`~service.window.RuleWindow` (and, for absence rules, the time).

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
reaches a limit, e.g. ranks that see the same data) and ``absence`` (no report for T seconds).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, field
from importlib import resources
from typing import Annotated, Any, Callable, Literal, Union

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError, field_validator, model_validator

from trainguard.service.diagnosis import DIAGNOSES
from trainguard.service.window import VECTORS, RuleWindow
from trainguard.protocol.wire import Name, Severity

__all__ = [
    "Action", "Rule", "RulesFile", "RuleSet", "Finding", "RulesError",
    "load_rules", "default_rules_text", "evaluate",
]

MetricName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")]
RuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
Vector = Literal["step_time_s", "loss", "grad_norm", "grad_fingerprint", "param_fingerprint", "input_wait_s", "data_overlap"]
assert set(Vector.__args__) == set(VECTORS)  # type: ignore[attr-defined]


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


class PauseAction(_Model):
    type: Literal["pause"] = "pause"


class CheckpointAction(_Model):
    type: Literal["checkpoint"] = "checkpoint"


class StopAction(_Model):
    type: Literal["stop"] = "stop"


class LrScaleAction(_Model):
    """Set ``lr_scale`` to ``value``, or multiply the current one by ``factor``, clamped to
    [min, max]."""

    type: Literal["lr_scale"] = "lr_scale"
    value: float | None = Field(default=None, gt=0, le=1e6, allow_inf_nan=False)
    factor: float | None = Field(default=None, gt=0, le=1e6, allow_inf_nan=False)
    min: float = Field(default=1e-4, gt=0, allow_inf_nan=False)
    max: float = Field(default=1e6, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_of(self) -> "LrScaleAction":
        if (self.value is None) == (self.factor is None):
            raise ValueError("lr_scale needs exactly one of 'value' (absolute) or 'factor'")
        if self.min > self.max:
            raise ValueError("lr_scale: min must be <= max")
        return self

    def apply(self, current: float) -> float:
        new = self.value if self.value is not None else current * self.factor  # type: ignore[operator]
        return min(max(new, self.min), self.max)


Action = Annotated[
    Union[NotifyAction, PauseAction, CheckpointAction, StopAction, LrScaleAction],
    Field(discriminator="type"),
]


# -- rules -----------------------------------------------------------------------------------
class _RuleBase(_Model):
    name: RuleName
    severity: Severity = "warning"
    actions: tuple[Action, ...] = (NotifyAction(),)
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


_OPS: dict[str, Callable[[Any, Any], Any]] = {
    ">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
}


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
    data while the others do not; a median of 0 then counts as an infinite ratio).
    ``check: mismatch`` fires when some rank is non-finite or differs from the median by more than
    rel_tol x max(|median|, 1e-30) (desync of fingerprints; seed 5.3: < 1e-5). ``check: above``
    fires when some rank's finite value is >= ``value`` and names those ranks (``data_overlap``:
    ranks that see the same data).
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


class AbsenceRule(_RuleBase):
    """No report for ``seconds``, counted from the later of the last report and the moment the
    run last became live (registered, re-registered or unpaused: a paused run sends nothing)."""

    kind: Literal["absence"]
    seconds: float = Field(default=300.0, gt=0, allow_inf_nan=False)


Rule = Annotated[
    Union[ThresholdRule, SpikeRule, NonFiniteRule, TrendRule, CrossRankRule, AbsenceRule],
    Field(discriminator="kind"),
]
_RULE = TypeAdapter(Rule)


class RulesFile(_Model):
    """The rules file as written."""

    version: Literal[1] = 1
    rules: tuple[Rule, ...] = ()
    jobs: dict[Name, tuple[dict[str, Any], ...]] = Field(default_factory=dict)

    @field_validator("rules")
    @classmethod
    def _unique(cls, rules: tuple[Any, ...]) -> tuple[Any, ...]:
        names = [r.name for r in rules]
        dup = sorted({n for n in names if names.count(n) > 1})
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

    def for_job(self, job: str) -> tuple[Any, ...]:
        """The enabled rules that apply to ``job``."""
        return self.by_job.get(job, self.base)

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
        return reports, ranks


def _resolve_job(base: tuple[Any, ...], job: str, patches: tuple[dict[str, Any], ...], reasons: list[str]) -> tuple[Any, ...]:
    rules = {r.name: r for r in base}
    for i, patch in enumerate(patches):
        name = patch.get("name")
        if not isinstance(name, str):
            reasons.append(f"jobs.{job}[{i}]: an override needs a 'name'")
            continue
        merged = {**rules[name].model_dump(), **patch} if name in rules else dict(patch)
        try:
            rules[name] = _RULE.validate_python(merged)
        except ValidationError as e:
            reasons.extend(f"jobs.{job}[{i}] ({name}): {_fmt(err)}" for err in e.errors())
    return tuple(r for r in rules.values() if r.enabled)


def _fmt(err: Any) -> str:
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return f"{loc}: {err['msg']}" if loc else err["msg"]


def load_rules(text: str | bytes, *, max_reports: int | None = None, max_rank_reports: int | None = None) -> RuleSet:
    """Parse and validate a rules file (YAML or JSON). ``RulesError`` lists every problem; the
    capacity limits, when given, are those of the controller's windows."""
    try:
        data = yaml.safe_load(text) if text else {}
    except yaml.YAMLError as e:
        raise RulesError([f"not valid YAML: {e}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RulesError(["the rules file must be a mapping with a 'rules' list"])
    try:
        file = RulesFile.model_validate(data)
    except ValidationError as e:
        raise RulesError([_fmt(err) for err in e.errors()]) from None
    reasons: list[str] = []
    base = tuple(r for r in file.rules if r.enabled)
    by_job = {job: _resolve_job(file.rules, job, patches, reasons) for job, patches in file.jobs.items()}
    rs = RuleSet(file=file, text=text.decode() if isinstance(text, bytes) else text, by_job=by_job, base=base)
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


# -- evaluation ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Finding:
    """A rule's verdict on a window: ``active`` True (condition holds), False (it does not), or
    None (no data to judge: the firing state stays as it is)."""

    rule: Any
    active: bool | None
    summary: str = ""
    values: dict[str, Any] = field(default_factory=dict)


def _num(x: float) -> float | str:
    """A float for JSON-friendly alert values (NaN/Inf as the wire's strings)."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return float(x)


def _threshold(rule: ThresholdRule, w: RuleWindow, now: float) -> Finding:
    latest = w.latest(rule.metric)
    if latest is None:
        return Finding(rule, None)
    if rule.for_reports == 1 and not _OPS[rule.op](latest, rule.value):
        return Finding(rule, False)  # the common case, without building the series
    vals = w.series(rule.metric, rule.for_reports)
    if len(vals) < rule.for_reports:
        return Finding(rule, False)
    cmp = _OPS[rule.op]
    if not all(cmp(v, rule.value) for v in vals.tolist()):
        return Finding(rule, False)
    last = float(vals[-1])
    return Finding(
        rule, True,
        f"{rule.metric} = {last:.6g} {rule.op} {rule.value:g}" + (f" for {rule.for_reports} reports" if rule.for_reports > 1 else ""),
        {"metric": rule.metric, "value": _num(last), "threshold": rule.value, "op": rule.op, "values": [_num(v) for v in vals.tolist()]},
    )


#: 1 / Phi^-1(3/4): turns a median absolute deviation into a normal standard deviation.
_MAD_TO_SIGMA = 1.482602218505602


def _median(x: np.ndarray) -> float:
    """Median of a small 1-D array (np.median costs ~30 us of overhead per call; this ~3 us)."""
    s = np.sort(x)
    n = len(s)
    return float(s[n // 2]) if n % 2 else 0.5 * (float(s[n // 2 - 1]) + float(s[n // 2]))


@functools.lru_cache(maxsize=64)
def _centred_steps(n: int) -> tuple[np.ndarray, float]:
    """Report indices 0..n-1 minus their mean, and their sum of squares (least-squares slope)."""
    t = np.arange(n, dtype=np.float64)
    tc = t - t.mean()
    tc.flags.writeable = False
    return tc, float(np.dot(tc, tc))


def _ema(x: np.ndarray, alpha: float) -> tuple[float, float]:
    mean, var = float(x[0]), 0.0
    for v in x[1:].tolist():
        d = v - mean
        incr = alpha * d
        mean += incr
        var = (1 - alpha) * (var + d * incr)
    return mean, math.sqrt(var)


def _spike(rule: SpikeRule, w: RuleWindow, now: float) -> Finding:
    latest = w.latest(rule.metric)
    if latest is None or not math.isfinite(latest):
        return Finding(rule, None if latest is None else False)
    hist = w.series(rule.metric, rule.window + 1)[:-1]
    finite = np.isfinite(hist)
    if not finite.all():
        hist = hist[finite]
    if len(hist) < rule.min_history:
        return Finding(rule, None)
    if rule.baseline == "median":
        base = _median(hist)
        # The MAD is only needed for z-scores (an alert's values never show it in ratio mode).
        scale = _MAD_TO_SIGMA * _median(np.abs(hist - base)) if rule.mode == "zscore" else math.nan
    else:
        base, scale = _ema(hist, 2.0 / (rule.window + 1))
    if rule.mode == "ratio":
        if base <= 0 or latest <= 0:
            return Finding(rule, None)
        up, down = latest / base, base / latest
        score = up if rule.direction == "up" else down if rule.direction == "down" else max(up, down)
        if not score >= rule.ratio:
            return Finding(rule, False)
        extra: dict[str, Any] = {"ratio": score, "limit": rule.ratio}
        summary = f"{rule.metric} = {latest:.6g} is {score:.3g}x its rolling {rule.baseline} {base:.6g} (limit {rule.ratio:g}x)"
    else:
        scale = max(scale, 1e-12 * max(abs(base), 1.0))
        z = (latest - base) / scale
        score = z if rule.direction == "up" else -z if rule.direction == "down" else abs(z)
        if not score >= rule.z:
            return Finding(rule, False)
        extra = {"zscore": z, "scale": scale, "limit": rule.z}
        summary = f"{rule.metric} = {latest:.6g} is {z:+.3g} sigma from its rolling {rule.baseline} {base:.6g} (limit {rule.z:g})"
    values = {"metric": rule.metric, "value": latest, "baseline": base, "baseline_kind": rule.baseline, "history": len(hist), **extra}
    return Finding(rule, True, summary, values)


def _nonfinite(rule: NonFiniteRule, w: RuleWindow, now: float) -> Finding:
    seen = False
    bad: dict[str, Any] = {}
    if rule.metric is not None:
        v = w.latest(rule.metric)
        if v is not None:
            seen = True
            if not math.isfinite(v):
                bad[rule.metric] = _num(v)
    for vec in rule.vectors:
        hist = w.rank_history(vec, 1)
        if len(hist):
            seen = True
            finite = np.isfinite(hist[-1])
            if finite.all():
                continue
            ranks = np.flatnonzero(~finite)
            if len(ranks):
                bad[f"ranks.{vec}"] = {int(r): _num(float(hist[-1][r])) for r in ranks[:16].tolist()}
    if not seen:
        return Finding(rule, None)
    if not bad:
        return Finding(rule, False)
    return Finding(rule, True, "non-finite " + ", ".join(bad), {"nonfinite": bad})


def _trend(rule: TrendRule, w: RuleWindow, now: float) -> Finding:
    if w.latest(rule.metric) is None:
        return Finding(rule, None)
    vals = w.series(rule.metric, rule.window)
    if len(vals) < rule.window or not np.isfinite(vals).all():
        return Finding(rule, None)
    n = len(vals)
    if rule.direction == "not_decreasing":
        tc, tt = _centred_steps(n)
        mean = vals.mean()
        slope = float(np.dot(tc, vals - mean) / tt)
        fitted_drop = -slope * (n - 1)
        need = rule.min_rel_change * abs(float(mean))
        if not fitted_drop <= need:
            return Finding(rule, False)
        return Finding(
            rule, True,
            f"{rule.metric} fell by {fitted_drop:.6g} over {n} reports (least squares; needs > {need:.6g})",
            {"metric": rule.metric, "slope_per_report": slope, "fitted_drop": fitted_drop, "required_drop": need, "window": n, "first": float(vals[0]), "last": float(vals[-1])},
        )
    first, last = float(vals[0]), float(vals[-1])
    growth = last - first
    if not (growth > 0 and growth >= rule.min_rel_change * abs(first)):
        return Finding(rule, False)
    monotonic = bool((vals[1:] >= vals[:-1]).all())
    if not monotonic:
        return Finding(rule, False)
    return Finding(
        rule, True,
        f"{rule.metric} grew monotonically from {first:.6g} to {last:.6g} over {n} reports",
        {"metric": rule.metric, "first": first, "last": last, "growth": growth, "monotonic": monotonic, "window": n},
    )


def _spread(rule: CrossRankRule, row: np.ndarray) -> tuple[bool | None, dict[str, Any]]:
    finite = np.isfinite(row)
    if finite.sum() < 2:
        return None, {}
    vals = np.where(finite, row, -np.inf)
    med = _median(row[finite])
    top = int(np.argmax(vals))
    if med <= 0:
        if not (rule.min_value > 0 and row[top] > 0):
            return None, {}
        ratio = math.inf
    else:
        ratio = float(row[top]) / med
    hit = ratio >= rule.ratio and float(row[top]) >= rule.min_value
    return hit, {"max": float(row[top]), "median": med, "ratio": ratio, "limit": rule.ratio, "rank": top}


def _above(rule: CrossRankRule, row: np.ndarray) -> tuple[bool | None, dict[str, Any]]:
    finite = np.isfinite(row)
    if not finite.any():
        return None, {}
    assert rule.value is not None
    with np.errstate(invalid="ignore"):
        ranks = np.flatnonzero(finite & (row >= rule.value))
    return bool(len(ranks)), {
        "limit": rule.value, "ranks": ranks[:16].tolist(), "count": int(len(ranks)),
        "values": {int(r): _num(float(row[r])) for r in ranks[:16].tolist()},
    }



def _mismatch(rule: CrossRankRule, row: np.ndarray) -> tuple[bool | None, dict[str, Any]]:
    finite = np.isfinite(row)
    if not finite.any() or len(row) < 2:
        return None, {}
    ref = _median(row[finite])
    tol = rule.rel_tol * max(abs(ref), 1e-30)
    with np.errstate(invalid="ignore"):
        off = ~finite | (np.abs(row - ref) > tol)
    ranks = np.flatnonzero(off)
    return bool(len(ranks)), {
        "reference": ref, "rel_tol": rule.rel_tol, "ranks": ranks[:16].tolist(), "differing": int(len(ranks)),
        "values": {int(r): _num(float(row[r])) for r in ranks[:16].tolist()},
    }


_CHECKS = {"spread": _spread, "mismatch": _mismatch, "above": _above}


def _row_verdicts(rule: CrossRankRule, hist: np.ndarray) -> list[bool | None]:
    """Each row's verdict, as :func:`_spread` / :func:`_mismatch` give it; all rows at once when
    every value is finite (the usual case), row by row otherwise."""
    k, n = hist.shape
    if n >= 2 and np.isfinite(hist).all() and rule.check != "above":
        if rule.check == "mismatch" and hist.min() == hist.max():
            return [False] * k  # every rank agrees exactly (data-parallel fingerprints): nothing differs
        s = np.sort(hist, axis=1)
        med = s[:, n // 2] if n % 2 else 0.5 * (s[:, n // 2 - 1] + s[:, n // 2])
        if rule.check == "spread":
            if rule.min_value > 0 and not (med > 0).all():
                return [_spread(rule, row)[0] for row in hist]
            judged = med > 0
            hit = (s[:, -1] / np.where(judged, med, 1.0) >= rule.ratio) & (s[:, -1] >= rule.min_value)
            return [bool(h) if j else None for h, j in zip(hit.tolist(), judged.tolist())]
        tol = rule.rel_tol * np.maximum(np.abs(med), 1e-30)
        return (np.abs(hist - med[:, None]) > tol[:, None]).any(axis=1).tolist()
    check = _CHECKS[rule.check]
    return [check(rule, row)[0] for row in hist]


def _cross_rank(rule: CrossRankRule, w: RuleWindow, now: float) -> Finding:
    hist = w.rank_history(rule.vector, rule.for_reports)
    if not len(hist):
        return Finding(rule, None)
    verdicts = _row_verdicts(rule, hist)
    if verdicts[-1] is None:
        return Finding(rule, None)
    if not (len(hist) >= rule.for_reports and all(v is True for v in verdicts)):
        return Finding(rule, False)
    values = {"vector": rule.vector, "check": rule.check, **_CHECKS[rule.check](rule, hist[-1])[1]}
    if rule.check == "spread":
        summary = f"rank {values['rank']} {rule.vector} = {values['max']:.6g} is {values['ratio']:.3g}x the median {values['median']:.6g} (limit {rule.ratio:g}x)"
    elif rule.check == "above":
        summary = f"rank(s) {values['ranks'][:8]} have {rule.vector} >= {rule.value:g} ({values['count']} in all)"
    else:
        summary = f"{values['differing']} rank(s) disagree on {rule.vector} (first: {values['ranks'][:8]}; rel. tolerance {rule.rel_tol:g})"
    return Finding(rule, True, summary, values)


def _absence(rule: AbsenceRule, w: RuleWindow, now: float, live_since: float = -math.inf) -> Finding:
    since = max(w.last_received, live_since)
    silent = now - since
    return Finding(
        rule, silent >= rule.seconds,
        f"no report for {silent:.0f} s (limit {rule.seconds:g} s)",
        {"silent_s": silent, "limit_s": rule.seconds, "last_report_at": w.last_received, "silent_since": since},
    )


_EVAL: dict[type, Callable[[Any, RuleWindow, float], Finding]] = {
    ThresholdRule: _threshold, SpikeRule: _spike, NonFiniteRule: _nonfinite,
    TrendRule: _trend, CrossRankRule: _cross_rank, AbsenceRule: _absence,
}


def evaluate(rules: tuple[Any, ...], window: RuleWindow, now: float, *, live_since: float | None = None) -> list[Finding]:
    """Every rule's verdict on ``window`` at time ``now``. Pure: no I/O, no mutation.

    ``live_since``: when the run last became live (registered, re-registered, unpaused); absence
    rules count silence from the later of it and the last report. The controller's ticker passes
    it; a report's own evaluation need not (its arrival is the newest sign of life)."""
    if live_since is None:
        return [_EVAL[type(r)](r, window, now) for r in rules]
    return [_absence(r, window, now, live_since) if type(r) is AbsenceRule else _EVAL[type(r)](r, window, now) for r in rules]

"""Request and answer models of the operator API (the agent's live in :mod:`trainguard.protocol.wire`)."""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainguard.protocol.wire import DesiredState, Report, Severity
from trainguard.service.rules import Rung
from trainguard.service.runstate import valid_host
from trainguard.service.webhook_destinations import refused_host

__all__ = ["Evidence", "Verdict", "IncidentRung", "Incident", "IncidentList", "CommandResult", "WebhookCreate", "Webhook", "WebhookCreated", "RulesTestRequest", "AlertmanagerAlert", "AlertmanagerPayload", "AckResult", "FinishResult", "RunDeleted", "nan_safe", "validation_summary", "SECRET_FIELDS", "NOT_REPEATED"]


class Evidence(BaseModel):
    """One piece of evidence a verdict read (``service/cause.py``)."""

    signal: str = Field(description="What was read: a metric, a per-rank vector (ranks.NAME) or an alert (rule:NAME).")
    value: Any = Field(description="Its value (NaN/Inf as strings; a rank -> value map for per-rank values).")
    reference: Any = Field(description="What it was compared with (a limit, a healthy level), or null.")
    points_to: Literal["schedule", "optimizer", "data", "hardware", "unknown", "none"] = Field(
        description="The cause it points at; 'none': a check that found nothing (e.g. a recompute that reproduced the gradient).")
    detail: str


class Verdict(BaseModel):
    summary: str
    evidence: list[Evidence]
    ranks: list[int] = Field(description="A hardware fault's suspect ranks.")
    hosts: list[str] = Field(description="The nodes of those ranks (a rank registered without its node: its /metrics host), from the run's registration.")
    revised: dict[str, Any] | None = Field(default=None, description="Later evidence that changed the cause (to hardware; a data verdict made on one batch to unknown once more batches stood out): from, step, summary.")


class IncidentRung(BaseModel):
    rung: str = Field(description=f"A rung of a ladder: {', '.join(get_args(Rung))}.")
    step: int
    time: float
    actor: str
    reason: str
    generation: int | None = Field(description="The desired state's generation it set (null: the agent's own skip).")


class Incident(BaseModel):
    """One anomaly of a run, from its onset to its outcome (``service/incidents.py``)."""

    id: int
    onset_step: int
    onset_time: float
    trigger: str
    cause: Literal["schedule", "optimizer", "data", "hardware", "unknown"] = Field(
        description="Decided before the incident's first action; it chooses the rungs (recovery.ladders).")
    verdict: Verdict
    rungs: list[IncidentRung]
    outcome: Literal["open", "recovered", "escalated"]
    closed_step: int | None
    closed_time: float | None
    experiment: dict[str, Any] | None = Field(description="Unknown cause: the LR-10x experiment (from_step, until_step, outcome, conclusion).")
    data_skipped: list[int] | None = Field(description="Data cause: [first, last] step whose optimizer steps every rank skipped.")
    replay: dict[str, Any] | None = Field(
        default=None, description="An LR jump of the schedule, rolled back: the reduced lr_scale around the step where the "
        "restored schedule asks for the jump again (kind, ratio, from_step, guard_from, guarding, until_step, lr_scale, "
        "lr_scale_after, released).")
    quarantined: dict[str, list[int]] | None = Field(
        default=None, description="Data cause: the samples of the skipped batches, every rank's, by shard: "
        "{shard base path: [index of the sequence in the shard]}, as the run's TokenLoader reported them.")


class IncidentList(BaseModel):
    """``GET /v1/runs/{run}/incidents``."""

    run: str
    incidents: list[Incident] = Field(description="Newest first.")
    snapshots: list[dict[str, Any]] = Field(description="The snapshots the controller holds for the run: step, good.")


class CommandResult(BaseModel):
    run: str
    command: str
    changed: bool = Field(description="False when the run was already in that state (no new generation).")
    desired: DesiredState
    applies: Literal["now", "when_registered_again"] = Field(
        default="now", description="'now': the run's ranks apply it at their next step; 'when_registered_again': the "
        "run finished (sent with on_restart=true), and it applies when a job registers the run's name again.")


class AckResult(BaseModel):
    applied_generation: int
    applied_step: int
    recorded: bool = Field(description="False for an ack older than the one already recorded.")


class FinishResult(BaseModel):
    run: str
    status: str = Field(description="'finished' (a later re-registration makes the run live again).")
    finished_at: float = Field(description="Controller time of the first finish.")
    finished_step: int
    finish_reason: str
    changed: bool = Field(description="False for a repeat: the first finish is kept.")


class RunDeleted(BaseModel):
    run: str
    job: str
    status: str = Field(description="The run's status when it was deleted.")
    deleted: bool = Field(description="True: the run is gone; its name may be registered again, as a new run.")


class WebhookCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(min_length=8, max_length=2000, description="http:// or https:// URL receiving POSTs.")
    format: Literal["alertmanager", "slack"] = "alertmanager"
    secret: str | None = Field(default=None, min_length=16, max_length=256, description="HMAC secret; generated when absent.")
    min_severity: Severity = "warning"
    send_resolved: bool = True

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("url must start with http:// or https://")
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as e:
            raise ValueError(f"url is not a valid URL: {e}") from None
        if not parsed.host:
            raise ValueError("url has no host")
        host = parsed.raw_host.decode("ascii", "replace")  # (an international name as its ASCII form)
        if not valid_host(host):
            raise ValueError(f"url's host {host[:80]!r} is not a host name or an IP address")
        refused = refused_host(host)
        if refused is not None:
            raise ValueError(f"url's host is refused: {refused}; webhooks are never sent there")
        if parsed.port is not None and not 1 <= parsed.port <= 65535:
            raise ValueError(f"url's port {parsed.port} is not a port (1-65535)")
        return url


class Webhook(BaseModel):
    id: int
    url: str
    format: str
    min_severity: str
    send_resolved: bool
    created_at: float


class WebhookCreated(Webhook):
    secret: str = Field(description="Shown once: verify X-Trainguard-Signature with it.")


class RulesTestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: str | None = Field(default=None, max_length=1_000_000, description="Rules YAML to test; default: the active rules.")
    job: str = Field(default="test", min_length=1, max_length=128, description="Job whose overrides apply.")
    world_size: int = Field(default=1, ge=1, le=1_000_000)
    desired: DesiredState | None = None
    reports: list[Report] = Field(max_length=10_000, description="Replayed in order; each report's time is the clock.")

    @model_validator(mode="after")
    def _vectors_fit(self) -> "RulesTestRequest":
        for i, report in enumerate(self.reports):
            for name in type(report.ranks).model_fields:
                vec = getattr(report.ranks, name)
                if vec and len(vec) != self.world_size:  # (an empty vector is an absent one)
                    raise ValueError(f"reports[{i}].ranks.{name} has {len(vec)} values; world_size is {self.world_size}")
        return self


class AlertmanagerAlert(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: str
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: str = ""
    endsAt: str = ""
    fingerprint: str = ""


class AlertmanagerPayload(BaseModel):
    """Alertmanager's webhook body (version 4)."""

    model_config = ConfigDict(extra="allow")

    version: str
    status: str = ""
    alerts: list[AlertmanagerAlert] = Field(max_length=10_000)

    @field_validator("version")
    @classmethod
    def _v4(cls, v: str) -> str:
        if v != "4":
            raise ValueError("only Alertmanager webhook payload version 4 is understood")
        return v


def nan_safe(value: Any) -> Any:
    """Replace NaN/±Inf floats by the wire's strings (for JSON answers built from stored values)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: nan_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_safe(v) for v in value]
    return value


#: Fields whose refused value a 422 never repeats (a webhook's signing secret, a token), and what it
#: shows instead.
SECRET_FIELDS = frozenset({"secret", "token"})
NOT_REPEATED = "(a secret: not repeated)"


def validation_summary(errors: list[dict[str, Any]], shown: int = 3, total: int | None = None) -> str:
    """The ``detail`` sentence of a 422 for a request that does not validate (its ``errors`` list
    each field, the first of ``total``): the first ``shown`` problems, then how many more."""
    total = len(errors) if total is None else total
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in errors[:shown]]
    more = f" (and {total - shown} more)" if total > shown else ""
    return "the request does not validate: " + "; ".join(parts) + more

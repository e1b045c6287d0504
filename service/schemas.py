"""Request and answer models of the operator API (the agent's live in :mod:`trainguard.protocol.wire`)."""

from __future__ import annotations

import math
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainguard.protocol.wire import DesiredState, Report, Severity

__all__ = ["CommandResult", "WebhookCreate", "Webhook", "WebhookCreated", "RulesTestRequest", "AlertmanagerAlert", "AlertmanagerPayload", "AckResult", "FinishResult", "nan_safe", "validation_summary"]


class CommandResult(BaseModel):
    run: str
    command: str
    changed: bool = Field(description="False when the run was already in that state (no new generation).")
    desired: DesiredState


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
            host = httpx.URL(url).host
        except httpx.InvalidURL as e:
            raise ValueError(f"url is not a valid URL: {e}") from None
        if not host:
            raise ValueError("url has no host")
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


def validation_summary(errors: list[dict[str, Any]], shown: int = 3) -> str:
    """The ``detail`` sentence of a 422 for a request that does not validate (its ``errors`` list
    each field): the first ``shown`` problems, then how many more."""
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in errors[:shown]]
    more = f" (and {len(errors) - shown} more)" if len(errors) > shown else ""
    return "the request does not validate: " + "; ".join(parts) + more

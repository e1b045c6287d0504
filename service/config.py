"""Controller settings: one pydantic-settings class, read from ``TRAINGUARD_*`` environment
variables (and overridden by ``trainguard serve`` flags).

Token lists are comma-separated (``TRAINGUARD_OPERATOR_TOKENS=tok1,tok2:read``); see
:mod:`service.auth` for the entry syntax. Without any token the controller refuses to bind to
anything but a loopback address: an open controller on a network could pause or stop every job.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["Settings", "is_loopback"]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_tokens(value: object) -> object:
    if isinstance(value, str):
        return tuple(t.strip() for t in value.split(",") if t.strip())
    return value


class Settings(BaseSettings):
    """Everything the controller reads from its environment."""

    model_config = SettingsConfigDict(env_prefix="TRAINGUARD_", extra="ignore", frozen=True)

    host: str = Field(default="127.0.0.1", description="Address to bind (TRAINGUARD_HOST).")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to bind; 0 picks a free one.")
    db: Path | str = Field(
        default=Path("trainguard.db"),
        description="SQLite database file (WAL mode), or a PostgreSQL URL (postgresql://user@host/dbname; extra 'postgres').")
    rules: Path | None = Field(
        default=None,
        description="Rules YAML file. When set it is loaded at start-up and wins over rules stored "
        "by PUT /v1/rules; when unset the last stored rules (or the built-in defaults) apply.",
    )
    operator_tokens: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(), description="Operator tokens, comma-separated: 'TOKEN' or 'TOKEN:scope+scope'."
    )
    agent_tokens: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(), description="Agent tokens, comma-separated: 'TOKEN' or 'TOKEN:RUN' (bound to RUN)."
    )
    max_body_bytes: int = Field(
        default=4 << 20, ge=1024,
        description="Largest request body accepted; a report may be as large as the largest report of its run's "
        "world size (of max_world_size ranks for a run not registered), if that is more.")
    window_reports: int = Field(default=128, ge=8, le=65536, description="Reports kept per run for rules.")
    rank_window_reports: int = Field(
        default=12, ge=1, le=1024, description="Reports whose per-rank vectors are kept per run (the built-in straggler "
        "rules judge each rank over 12 reports when a report comes every step).",
    )
    max_series_per_run: int = Field(
        default=1024, ge=16, le=65536,
        description="Distinct metric names one run may report; a report adding names beyond it is refused (422).",
    )
    startup_wait_runs: int = Field(
        default=100, ge=0,
        description="A database of at most this many runs is read back before the first request is answered (requests "
        "wait a moment in the listen backlog); a larger one while the controller answers: /readyz 503 with the "
        "progress, and each request that needs the runs 503 with Retry-After until they are read.")
    max_runs: int = Field(default=10_000, ge=1, description="Registered runs the controller holds; more are refused (429).")
    max_runs_per_token: int = Field(
        default=1000, ge=1, description="Runs one agent token may register; more are refused (429).")
    max_world_size: int = Field(
        default=32_768, ge=1, le=1_000_000,
        description="Largest world_size (ranks per run) a registration may declare; the largest report body accepted follows from it.")
    header_timeout_s: float = Field(default=10.0, gt=0, le=600, description="A request's line and headers must arrive within this.")
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600, description="A request's whole body must arrive within this (else 408).")
    keepalive_timeout_s: float = Field(default=5.0, ge=1, le=600, description="An idle keep-alive connection is closed after this.")
    max_connections: int = Field(default=4096, ge=8, description="Open connections beyond this are closed at once.")
    shutdown_timeout_s: float = Field(
        default=10.0, ge=1, le=600, description="On SIGTERM, requests still running after this are cancelled.")
    longpoll_max_s: float = Field(default=60.0, gt=0, le=3600, description="Longest long-poll wait.")
    tick_s: float = Field(default=1.0, gt=0, le=60, description="Period of the absence-rule ticker.")
    webhook_timeout_s: float = Field(default=5.0, gt=0, le=120, description="Timeout of one delivery.")
    webhook_max_attempts: int = Field(default=10, ge=1, le=100, description="Attempts before giving up.")
    webhook_backoff_s: float = Field(default=1.0, gt=0, description="First retry delay; doubles each time.")
    webhook_backoff_max_s: float = Field(default=600.0, gt=0, description="Largest retry delay.")
    report_retention_s: float = Field(
        default=7 * 24 * 3600.0, gt=0, description="Reports older than this are pruned from the database."
    )
    audit_retention_s: float = Field(
        default=90 * 24 * 3600.0, gt=0,
        description="Audit events, resolved alerts, webhook messages and their delivery attempts, revoked or expired "
        "tokens and the names of deleted runs older than this are pruned from the database (at least "
        "report_retention_s: they are the evidence of what happened to the runs).")
    min_free_bytes: int = Field(
        default=64 << 20, ge=0,
        description="/readyz answers 503 while the file system of a SQLite database has less room than this (0: not "
        "checked); a PostgreSQL server's room is found by its writes.")
    rules_versions_kept: int = Field(
        default=100, ge=1, description="Stored versions of the rules kept: the newest this many, and the active one.")
    external_url: str = Field(default="", description="Public URL of the controller, for links in alerts.")

    @field_validator("db", mode="before")
    @classmethod
    def _file_or_url(cls, value: object) -> object:
        # a URL stays text (a Path would fold its "//"); anything else names a SQLite file
        if isinstance(value, str) and not value.startswith(("postgresql://", "postgres://")):
            return Path(value)
        return value

    @field_validator("operator_tokens", "agent_tokens", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        return _split_tokens(value)

    @model_validator(mode="after")
    def _refuse_open_network_bind(self) -> "Settings":
        if not self.operator_tokens and not self.agent_tokens and not is_loopback(self.host):
            raise ValueError(
                f"refusing to bind to {self.host!r} without tokens: anyone who can reach it could "
                "pause or stop training runs. Set TRAINGUARD_OPERATOR_TOKENS and "
                "TRAINGUARD_AGENT_TOKENS, or bind to 127.0.0.1."
            )
        if self.webhook_backoff_max_s < self.webhook_backoff_s:
            raise ValueError("webhook_backoff_max_s must be >= webhook_backoff_s")
        if self.audit_retention_s < self.report_retention_s:
            raise ValueError(f"audit_retention_s ({self.audit_retention_s:g}) must be at least report_retention_s "
                             f"({self.report_retention_s:g}): audit events and alerts are kept at least as long as "
                             "the reports")
        return self

    @property
    def auth_enabled(self) -> bool:
        """Tokens are checked on every /v1 request once any token is configured."""
        return bool(self.operator_tokens or self.agent_tokens)

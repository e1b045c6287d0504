"""Dashboard 4, the controller: is the decision side healthy? Reports ingested, rule evaluations,
alerts by rule and severity, actions taken, incidents of the automatic recovery (outcomes, rungs,
open ones), webhook deliveries and failures, and the ingest latency (quantiles of the histogram).
"""

from __future__ import annotations

from grafanalib.core import Dashboard

from trainguard.dashboards.common import Section, dashboard, query, timeseries
from trainguard.dashboards.stack import CONTROLLER_JOB

UID = "trainguard-controller"
TITLE = "trainguard / Controller"

#: The controller's own series are scraped by the controller job (they carry no training job).
C = f'job="{CONTROLLER_JOB}"'
RATE = "[$__rate_interval]"


def _rate(metric: str, by: str = "", fn: str = "rate") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} ({fn}({metric}{{{C}}}{RATE}))"


def _or_zero(expr: str) -> str:
    """``expr`` (one label-less series), or 0 while the controller is scraped and ``expr`` has no
    series (the incident gauges list only the runs in that state)."""
    return f"{expr} or (sum(trainguard_controller_runs{{{C}}}) * 0)"


def _ingest() -> Section:
    return Section("Ingest", [
        timeseries(
            "Reports ingested and rejected",
            "Reports persisted and evaluated per second, and reports refused per second by "
            "reason (invalid, unknown_run, conflict).",
            [
                query(_rate("trainguard_controller_reports_total"), "ingested"),
                query(_rate("trainguard_controller_reports_rejected_total", "reason"),
                      "rejected: {{reason}}"),
            ],
            unit="reqps",
        ),
        timeseries(
            "Ingest latency",
            "Quantiles of the time from a report's arrival to its answer: rule evaluation, "
            "decision and the database commit (from the controller's histogram).",
            [
                query(f"histogram_quantile({q}, "
                      f"{_rate('trainguard_controller_ingest_latency_seconds_bucket', 'le')})",
                      f"p{round(q * 100)}")
                for q in (0.5, 0.9, 0.99)
            ],
            unit="s",
        ),
        timeseries(
            "Rule evaluations",
            "Rule evaluations per second (one per rule per report, plus absence checks).",
            [query(_rate("trainguard_controller_rule_evaluations_total"), "evaluations")],
            unit="ops",
        ),
        timeseries(
            "Runs by status and waiting long-polls",
            "Registered runs by status (running, paused, stopped, silent, registered, finished) and the "
            "agents' long-polls of desired state currently waiting.",
            [
                query(f"sum by (status) (trainguard_controller_runs{{{C}}})", "{{status}}"),
                query(f"trainguard_controller_longpoll_waiters{{{C}}}", "long-polls waiting"),
            ],
        ),
    ])


def _decisions() -> Section:
    return Section("Alerts and actions", [
        timeseries(
            "Alerts by rule and severity",
            "Alerts fired per interval, by rule and severity.",
            [query(_rate("trainguard_controller_alerts_total", "rule, severity", "increase"),
                   "{{rule}} ({{severity}})")],
            draw="bars",
        ),
        timeseries(
            "Alerts firing and suppressed",
            "Alerts currently firing by severity, and alerts a rule's cooldown or cap held "
            "back per interval.",
            [
                query(f"sum by (severity) (trainguard_controller_alerts_firing{{{C}}})",
                      "firing: {{severity}}"),
                query(_rate("trainguard_controller_alerts_suppressed_total", "rule, reason",
                            "increase"), "suppressed: {{rule}} ({{reason}})"),
            ],
        ),
        timeseries(
            "Actions",
            "Changes of desired state per interval, by action (pause, resume, lr_scale, "
            "checkpoint, stop) and source (rule, operator, alertmanager).",
            [query(_rate("trainguard_controller_actions_total", "action, source", "increase"),
                   "{{action}} ({{source}})")],
            draw="bars", width=24,
        ),
    ])


def _incidents() -> Section:
    return Section("Incidents", [
        timeseries(
            "Incidents by outcome and rungs taken",
            "Incidents of the automatic recovery per interval: opened, recovered without a human, "
            "escalated to a human (the run paused); and the rungs of the escalation ladder taken "
            "(skip, adaptive_lr, rollback, pause).",
            [
                query(_rate("trainguard_controller_incidents_total", "outcome", "increase"), "{{outcome}}"),
                query(_rate("trainguard_controller_incident_rungs_total", "rung", "increase"), "rung: {{rung}}"),
            ],
            draw="bars",
        ),
        timeseries(
            "Open incidents and runs waiting for a human",
            "Runs with an open incident (the recovery ladder is working on them), and runs paused "
            "after an escalated incident until someone resumes or stops them. Per run: the "
            "Incident panel of the training-stability dashboard.",
            [
                query(_or_zero(f"sum(trainguard_controller_incidents_open{{{C}}})"), "open incidents"),
                query(_or_zero(f"sum(trainguard_controller_incidents_awaiting_human{{{C}}})"),
                      "runs waiting for a human"),
            ],
            interpolation="stepAfter",
        ),
    ])


def _webhooks() -> Section:
    return Section("Webhooks", [
        timeseries(
            "Webhook deliveries",
            "Webhook delivery attempts per second by outcome (delivered, retry, failed), and "
            "the messages waiting in the outbox.",
            [
                query(_rate("trainguard_controller_webhook_deliveries_total", "outcome"),
                      "{{outcome}}"),
                query(f"trainguard_controller_webhook_outbox_pending{{{C}}}", "outbox pending"),
            ],
        ),
        timeseries(
            "Webhook failures",
            "Failed delivery attempts per interval by reason (5xx, 4xx, timeout, error), "
            "retried or not.",
            [query(_rate("trainguard_controller_webhook_failures_total", "reason", "increase"),
                   "{{reason}}")],
            draw="bars",
        ),
    ])


def build() -> Dashboard:
    return dashboard(
        uid=UID,
        title=TITLE,
        description=" ".join(__doc__.split()),
        tags=["controller"],
        sections=[_ingest(), _decisions(), _incidents(), _webhooks()],
    )

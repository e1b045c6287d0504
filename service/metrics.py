"""The controller's own metrics (``GET /metrics``): the catalogue and the collectors.

:data:`CONTROLLER_METRICS` documents every name, the way ``trainguard.protocol.catalog`` does for the
agent; dashboards and tests read names from here. A histogram ``X`` exposes ``X_bucket``,
``X_sum`` and ``X_count``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from trainguard.protocol.catalog import MetricSpec
from trainguard.protocol.commands import REGISTRY
from trainguard.service.rules import Rung

if TYPE_CHECKING:
    from trainguard.service.webhooks import IncidentUpdate

#: A function giving the controller's state for the scrape-time gauges (``Controller.metrics_snapshot``),
#: or ``None`` before the controller exists.
Snapshot = Callable[[], "dict[str, Any] | None"]

__all__ = ["ControllerMetric", "CONTROLLER_METRICS", "ControllerMetrics", "INCIDENT_OUTCOMES"]


class ControllerMetric(MetricSpec):
    """One metric the controller exports: a :class:`~trainguard.protocol.catalog.MetricSpec` whose name
    starts with ``trainguard_controller_``."""

    __slots__ = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.name.startswith("trainguard_controller_"):
            raise ValueError(f"controller metric {self.name!r} must start with 'trainguard_controller_'")


CONTROLLER_METRICS: tuple[ControllerMetric, ...] = (
    ControllerMetric("trainguard_controller_reports_total", "counter", "reports", "Reports ingested (persisted and evaluated)."),
    ControllerMetric("trainguard_controller_reports_resent_total", "counter", "reports", "Reports received again, equal to the run's last stored one (its agent sent it again after a lost answer, e.g. across a failover): answered with the desired state, stored and evaluated once."),
    ControllerMetric("trainguard_controller_reports_rejected_total", "counter", "reports", "Reports refused, by reason (invalid, unknown_run, conflict, finished, series_limit).", ("reason",)),
    ControllerMetric("trainguard_controller_registrations_rejected_total", "counter", "registrations", "Run registrations refused by a limit, by reason (runs_limit, token_runs_limit, world_size_limit).", ("reason",)),
    ControllerMetric("trainguard_controller_rule_evaluations_total", "counter", "evaluations", "Rule evaluations (one per rule per report, plus absence checks)."),
    ControllerMetric("trainguard_controller_alerts_total", "counter", "alerts", "Alerts fired, by rule and severity.", ("rule", "severity")),
    ControllerMetric("trainguard_controller_alerts_suppressed_total", "counter", "alerts", "Alerts held back by a rule's cooldown or cap.", ("rule", "reason")),
    ControllerMetric("trainguard_controller_alerts_firing", "gauge", "alerts", "Alerts currently firing, by severity.", ("severity",)),
    ControllerMetric("trainguard_controller_actions_total", "counter", "actions", "Changes of desired state, by action and source (rule, operator, alertmanager).", ("action", "source")),
    ControllerMetric("trainguard_controller_webhook_deliveries_total", "counter", "deliveries", "Webhook delivery attempts, by outcome (delivered, retry, failed).", ("outcome",)),
    ControllerMetric("trainguard_controller_webhook_failures_total", "counter", "deliveries", "Webhook delivery attempts that failed (5xx, 4xx, timeout, error), whether retried or not.", ("reason",)),
    ControllerMetric("trainguard_controller_webhook_outbox_pending", "gauge", "messages", "Webhook messages waiting for delivery."),
    ControllerMetric("trainguard_controller_ingest_latency_seconds", "histogram", "seconds", "Time from a report's arrival (parsed) to its answer: rules, decision and the database commit."),
    ControllerMetric("trainguard_controller_runs", "gauge", "runs", "Registered runs, by status (running, paused, stopped, silent, registered, finished).", ("status",)),
    ControllerMetric("trainguard_controller_longpoll_waiters", "gauge", "requests", "Long-polls of desired state currently waiting."),
    ControllerMetric("trainguard_controller_store_commits_total", "counter", "transactions", "Database transactions committed by the writer (group commits)."),
    ControllerMetric("trainguard_controller_incidents_total", "counter", "incidents", "Incidents of the automatic recovery, by outcome: opened, recovered (without a human), escalated (the run was paused and a human paged).", ("outcome",)),
    ControllerMetric("trainguard_controller_incident_rungs_total", "counter", "rungs", "Rungs of the escalation ladder taken in incidents, by rung (skip, adaptive_lr, rollback, pause; data_skip, checkpoint, stop, experiment for the other causes; grad_clip, reset_optimizer where ladders.optimizer names them).", ("rung",)),
    ControllerMetric("trainguard_controller_incidents_open", "gauge", "incidents", "1 for each run with an open incident (the recovery ladder is working on it); only such runs are listed.", ("run",)),
    ControllerMetric("trainguard_controller_incidents_awaiting_human", "gauge", "runs", "1 for each run paused by an escalated incident, until someone resumes, stops or otherwise commands it; only such runs are listed.", ("run",)),
)
#: Outcomes counted by ``trainguard_controller_incidents_total`` (each label is exported from the start, at 0).
INCIDENT_OUTCOMES = ("opened", "recovered", "escalated")

BY_NAME: dict[str, ControllerMetric] = {m.name: m for m in CONTROLLER_METRICS}
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _help(name: str) -> str:
    return BY_NAME[name].help


class _StateCollector(Collector):
    """Gauges computed at scrape time from what the controller already holds."""

    def __init__(self, state: Snapshot) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self._state()
        if snap is None:
            return
        g = GaugeMetricFamily("trainguard_controller_runs", _help("trainguard_controller_runs"), labels=["status"])
        for status, n in sorted(snap["runs"].items()):
            g.add_metric([status], n)
        yield g
        g = GaugeMetricFamily("trainguard_controller_alerts_firing", _help("trainguard_controller_alerts_firing"), labels=["severity"])
        for sev, n in sorted(snap["firing"].items()):
            g.add_metric([sev], n)
        yield g
        yield GaugeMetricFamily("trainguard_controller_webhook_outbox_pending", _help("trainguard_controller_webhook_outbox_pending"), value=snap["outbox_pending"])
        yield GaugeMetricFamily("trainguard_controller_longpoll_waiters", _help("trainguard_controller_longpoll_waiters"), value=snap["waiters"])
        yield CounterMetricFamily("trainguard_controller_store_commits", _help("trainguard_controller_store_commits_total"), value=snap["commits"])
        # one series per run in that state, never one per registered run (at most TRAINGUARD_MAX_RUNS)
        for name, key in (("trainguard_controller_incidents_open", "incidents_open"),
                          ("trainguard_controller_incidents_awaiting_human", "awaiting_human")):
            g = GaugeMetricFamily(name, _help(name), labels=["run"])
            for run in sorted(snap[key]):
                g.add_metric([run], 1)
            yield g


class ControllerMetrics:
    """The controller's counters and histograms on an injected registry."""

    def __init__(self, registry: CollectorRegistry, state: Snapshot) -> None:
        self.registry = registry
        h = _help
        self.reports = Counter("trainguard_controller_reports", h("trainguard_controller_reports_total"), registry=registry)
        self.resent = Counter("trainguard_controller_reports_resent", h("trainguard_controller_reports_resent_total"), registry=registry)
        self.rejected = Counter("trainguard_controller_reports_rejected", h("trainguard_controller_reports_rejected_total"), ["reason"], registry=registry)
        self.registrations_rejected = Counter("trainguard_controller_registrations_rejected", h("trainguard_controller_registrations_rejected_total"), ["reason"], registry=registry)
        self.evaluations = Counter("trainguard_controller_rule_evaluations", h("trainguard_controller_rule_evaluations_total"), registry=registry)
        self.alerts = Counter("trainguard_controller_alerts", h("trainguard_controller_alerts_total"), ["rule", "severity"], registry=registry)
        self.suppressed = Counter("trainguard_controller_alerts_suppressed", h("trainguard_controller_alerts_suppressed_total"), ["rule", "reason"], registry=registry)
        self.actions = Counter("trainguard_controller_actions", h("trainguard_controller_actions_total"), ["action", "source"], registry=registry)
        self.deliveries = Counter("trainguard_controller_webhook_deliveries", h("trainguard_controller_webhook_deliveries_total"), ["outcome"], registry=registry)
        self.failures = Counter("trainguard_controller_webhook_failures", h("trainguard_controller_webhook_failures_total"), ["reason"], registry=registry)
        self.incidents = Counter("trainguard_controller_incidents", h("trainguard_controller_incidents_total"), ["outcome"], registry=registry)
        self.incident_rungs = Counter("trainguard_controller_incident_rungs", h("trainguard_controller_incident_rungs_total"), ["rung"], registry=registry)
        for outcome in INCIDENT_OUTCOMES:  # known label values start at 0: a rate over them has data
            self.incidents.labels(outcome)
        for rung in get_args(Rung):
            self.incident_rungs.labels(rung)
        for spec in REGISTRY:  # every command, from each source that can give it
            for source, gives in (("operator", spec.operator), ("alertmanager", spec.alertmanager),
                                  ("rule", spec.rule_action is not None), ("recovery", True)):
                if gives:
                    self.actions.labels(spec.name, source)
        self.ingest_latency = Histogram("trainguard_controller_ingest_latency_seconds", h("trainguard_controller_ingest_latency_seconds"), buckets=_LATENCY_BUCKETS, registry=registry)
        registry.register(_StateCollector(state))

    def count_incident(self, change: IncidentUpdate) -> None:
        """Count one committed change of an incident: its opening, its rungs, its outcome."""
        if change.opened:
            self.incidents.labels("opened").inc()
        for rung in change.rungs:
            self.incident_rungs.labels(rung).inc()
        if change.closed is not None:
            self.incidents.labels(change.closed).inc()

"""Configuration of the monitoring stack around the controller: Prometheus (scrape the controller,
discover every rank through the controller's ``http_sd`` endpoint, evaluate the rules), Alertmanager
(route alerts to the controller's ``/v1/alertmanager`` and to a webhook sink) and Grafana's
provisioning (datasource and dashboards).

The functions return plain dicts; ``dashboards.build`` writes them as YAML for the compose file, and
tests and the demo call :func:`prometheus_config` with loopback addresses.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainguard.dashboards.rules import CONTROLLER_ACTIONS

__all__ = [
    "PROMETHEUS_IMAGE",
    "ALERTMANAGER_IMAGE",
    "CONTROLLER_JOB",
    "RANKS_JOB",
    "PROMETHEUS_TOKEN_SECRET",
    "ALERTMANAGER_TOKEN_SECRET",
    "prometheus_config",
    "alertmanager_config",
    "grafana_datasources",
    "grafana_dashboard_provider",
]

PROMETHEUS_IMAGE = "prom/prometheus:v3.5.0"
ALERTMANAGER_IMAGE = "prom/alertmanager:v0.28.1"

#: Prometheus scrape job of the controller's own /metrics.
CONTROLLER_JOB = "trainguard-controller"
#: Prometheus scrape job of the ranks; the targets' own ``job`` label (the training job's name,
#: from the controller's http_sd answer) replaces it, so ``job`` means the training job everywhere.
RANKS_JOB = "trainguard-ranks"
#: Each gets a token with only the scope it needs (compose secrets): Prometheus reads (http_sd
#: targets), Alertmanager commands (POST /v1/alertmanager).
PROMETHEUS_TOKEN_SECRET = "/run/secrets/trainguard_prometheus_token"
ALERTMANAGER_TOKEN_SECRET = "/run/secrets/trainguard_alertmanager_token"


def _auth(token_file: str | None) -> dict:
    return {"authorization": {"type": "Bearer", "credentials_file": token_file}} if token_file else {}


def prometheus_config(
    *,
    controller: str,
    token_file: str | None,
    rule_files: Sequence[str] = ("rules.yml",),
    alertmanager: str | None = None,
    scrape_interval: str = "5s",
    sd_refresh_interval: str = "10s",
) -> dict:
    """Prometheus configuration.

    ``controller`` is ``host:port`` of the controller (scheme http); ``token_file`` a file holding a
    token the controller accepts for ``/metrics`` and ``/v1/sd/targets`` (``None``: no auth);
    ``alertmanager`` is ``host:port`` of an Alertmanager, or ``None`` for none.
    """
    if not controller or "/" in controller:
        raise ValueError(f"controller must be host:port, got {controller!r}")
    config: dict = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "rule_files": list(rule_files),
        "scrape_configs": [
            {
                "job_name": CONTROLLER_JOB,
                "metrics_path": "/metrics",
                **_auth(token_file),
                "static_configs": [{"targets": [controller]}],
            },
            {
                "job_name": RANKS_JOB,
                "metrics_path": "/metrics",
                # The labels naming a target (job, run, rank, instance) come from discovery (the
                # controller's answer), never from what the target serves: an exporter serving
                # trainguard_loss{run="another-run"} must not make an alert about another run.
                # Labels the ranks also export lose the conflict (Prometheus renames them
                # exported_*) and are dropped.
                "honor_labels": False,
                "metric_relabel_configs": [{"action": "labeldrop", "regex": "exported_(job|run|rank|instance)"}],
                "http_sd_configs": [{
                    "url": f"http://{controller}/v1/sd/targets",
                    "refresh_interval": sd_refresh_interval,
                    **_auth(token_file),
                }],
            },
        ],
    }
    if alertmanager is not None:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    return config


def alertmanager_config(*, controller: str, sink: str, token_file: str | None) -> dict:
    """Alertmanager configuration: every alert goes to the webhook sink; alerts whose
    ``trainguard_action`` is one the controller carries out (pause, lr_scale, checkpoint, stop)
    also go to the controller. Grouping is per alert and run, with short waits: the controller
    de-duplicates repeats itself (fingerprint and start time)."""
    controller_receiver = {
        "name": "trainguard-controller",
        "webhook_configs": [{
            "url": f"http://{controller}/v1/alertmanager",
            "send_resolved": True,
            "http_config": _auth(token_file),
        }],
    }
    sink_receiver = {
        "name": "webhook-sink",
        "webhook_configs": [{"url": f"http://{sink}/alerts", "send_resolved": True}],
    }
    return {
        "route": {
            "receiver": "webhook-sink",
            "group_by": ["alertname", "job", "run"],
            "group_wait": "5s",
            "group_interval": "30s",
            "repeat_interval": "1h",
            "routes": [
                {"receiver": "trainguard-controller", "matchers": [f'trainguard_action=~"{"|".join(CONTROLLER_ACTIONS)}"'],
                 "group_wait": "0s", "continue": True},
                {"receiver": "webhook-sink"},
            ],
        },
        "receivers": [sink_receiver, controller_receiver],
    }


def grafana_datasources(*, prometheus_url: str, uid: str, name: str,
                        scrape_interval: str = "5s") -> dict:
    """Grafana datasource provisioning: the stack's Prometheus as the default datasource."""
    return {
        "apiVersion": 1,
        "datasources": [{
            "name": name,
            "uid": uid,
            "type": "prometheus",
            "access": "proxy",
            "url": prometheus_url,
            "isDefault": True,
            "editable": False,
            "jsonData": {"timeInterval": scrape_interval, "httpMethod": "POST"},
        }],
    }


def grafana_dashboard_provider(*, path: str) -> dict:
    """Grafana dashboard provisioning: load the generated dashboards from ``path``, read-only."""
    return {
        "apiVersion": 1,
        "providers": [{
            "name": "trainguard",
            "folder": "trainguard",
            "type": "file",
            "disableDeletion": True,
            "allowUiUpdates": False,
            "updateIntervalSeconds": 30,
            "options": {"path": path, "foldersFromFilesStructure": False},
        }],
    }

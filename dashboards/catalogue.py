"""The metric names the dashboards and rules may use: the agent's catalogue
(``trainguard.protocol.catalog``), the controller's (``service.metrics``), and the few series Prometheus
itself creates. Histograms are looked up by their base name (``_bucket``, ``_sum``, ``_count``).
"""

from __future__ import annotations

from collections.abc import Iterable

from trainguard.service.metrics import CONTROLLER_METRICS
from trainguard.protocol.catalog import AGENT_METRICS

__all__ = ["PROMETHEUS_SERIES", "exported_metrics", "unknown_metrics"]

#: Series Prometheus creates itself: the scrape health of every target and the firing alerts.
PROMETHEUS_SERIES = frozenset({"up", "ALERTS"})
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def exported_metrics() -> dict[str, str]:
    """Metric name -> Prometheus type, for every metric the agent or the controller exports."""
    return {m.name: m.kind for m in (*AGENT_METRICS, *CONTROLLER_METRICS)}


def unknown_metrics(names: Iterable[str]) -> set[str]:
    """The names in ``names`` that no exporter defines (a histogram's series count as its own)."""
    exported = exported_metrics()
    unknown = set()
    for name in names:
        if name in exported or name in PROMETHEUS_SERIES:
            continue
        base = next((name.removesuffix(s) for s in _HISTOGRAM_SUFFIXES if name.endswith(s)), None)
        if base is not None and exported.get(base) == "histogram":
            continue
        unknown.add(name)
    return unknown

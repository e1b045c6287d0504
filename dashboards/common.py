"""Shared building blocks of the trainguard dashboards: the datasource, the ``job``/``run``/``rank``
template variables, the annotations for the controller's alerts and actions, panel helpers and an
automatic grid layout.

Every dashboard targets the Grafana version the compose file pins (:data:`GRAFANA_IMAGE`); the
JSON carries that version's ``schemaVersion`` so Grafana does not migrate it on load.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import attr
from grafanalib.core import (
    Annotations,
    Dashboard,
    GridPos,
    Panel,
    RowPanel,
    Stat,
    StateTimeline,
    Target,
    Template,
    Templating,
    Time,
    TimeSeries,
)

__all__ = [
    "GRAFANA_IMAGE",
    "SCHEMA_VERSION",
    "DATASOURCE_UID",
    "DATASOURCE_NAME",
    "DATASOURCE",
    "SEL",
    "JOB_RUN",
    "Band",
    "job_level",
    "query",
    "with_ref_ids",
    "timeseries",
    "right_axis",
    "state_timeline",
    "stat",
    "RankHeatmap",
    "Section",
    "dashboard",
]

#: The Grafana image the compose file runs; the dashboards' JSON targets it.
GRAFANA_IMAGE = "grafana/grafana:12.1.1"
#: Dashboard JSON schema version of Grafana 12.x (Grafana migrates older versions on load, never
#: newer ones, so this must not exceed the pinned release's).
SCHEMA_VERSION = 41
#: Uid of the Prometheus datasource the provisioning file creates; the dashboards' ``datasource``
#: variable defaults to it and can point at any other Prometheus.
DATASOURCE_UID = "trainguard-prometheus"
DATASOURCE_NAME = "Prometheus"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

#: Label matchers every per-rank query carries (the three template variables).
SEL = 'job=~"$job", run=~"$run", rank=~"$rank"'
#: Label matchers of job-level queries (aggregated over ranks).
JOB_RUN = 'job=~"$job", run=~"$run"'



def job_level(metric: str, *, by: str = "", matchers: str = "", fn: str = "") -> str:
    """A job-level metric (catalogue scope ``job``: the global gradient norm, the LR ...; or
    ``layer``: the per-layer series) per run of the selected jobs: ``max by (job, run[, by])`` of
    the series that serve it. By default that is the leader's series alone (the other ranks do not
    export it); with ``AgentConfig(job_metrics="all")`` every rank serves an identical copy, and
    the value is the same. ``matchers``: more label matchers; ``fn``: ``rate`` or ``increase``
    of each series over ``$__rate_interval`` first."""
    selector = f"{metric}{{{JOB_RUN}{', ' + matchers if matchers else ''}}}"
    if fn:
        if fn not in ("rate", "increase"):
            raise ValueError(f"fn must be 'rate' or 'increase', got {fn!r}")
        selector = f"{fn}({selector}[$__rate_interval])"
    return f"max by (job, run{', ' + by if by else ''}) ({selector})"


_ROW_HEIGHT = 8
_GRID_WIDTH = 24


@dataclass(frozen=True, slots=True)
class Band:
    """A threshold drawn on a time-series panel: colour steps from ``steps`` ((value, colour)
    pairs in increasing value; the first applies below the first value), shown as ``style``."""

    steps: tuple[tuple[float, str], ...]
    """(lower bound, colour) pairs, increasing; the base colour is ``base``."""
    base: str = "transparent"
    """Colour below the first step."""
    style: str = "line"
    """Grafana's thresholdsStyle mode: ``line``, ``area``, ``line+area`` or ``dashed``."""

    def __post_init__(self) -> None:
        values = [v for v, _ in self.steps]
        if not values or values != sorted(values):
            raise ValueError(f"threshold steps must be non-empty and increasing, got {values}")
        if self.style not in ("line", "area", "line+area", "dashed", "dashed+area"):
            raise ValueError(f"unknown thresholds style {self.style!r}")

    def json_steps(self) -> list[dict]:
        return [{"color": self.base, "value": None}] + [
            {"color": colour, "value": value} for value, colour in self.steps
        ]


def query(expr: str, legend: str = "", *, instant: bool = False) -> Target:
    """One PromQL query of a panel (refIds are assigned in panel order by :func:`with_ref_ids`)."""
    return Target(
        expr=expr,
        legendFormat=legend,
        datasource=DATASOURCE,
        instant=instant,
        intervalFactor=1,
        step=None,
    )


def with_ref_ids(targets: Sequence[Target]) -> list[Target]:
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    if len(targets) > len(letters):
        raise ValueError("a panel holds at most 26 queries")
    return [attr.evolve(t, refId=letters[i]) for i, t in enumerate(targets)]


def timeseries(
    title: str,
    description: str,
    targets: Sequence[Target],
    *,
    unit: str = "short",
    log: bool = False,
    band: Band | None = None,
    overrides: Sequence[dict] = (),
    draw: str = "line",
    interpolation: str = "linear",
    width: int = 12,
) -> TimeSeries:
    """A time-series panel; ``log`` uses a log10 axis (ratios spanning decades)."""
    panel = TimeSeries(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=with_ref_ids(targets),
        unit=unit,
        scaleDistributionType="log" if log else "linear",
        scaleDistributionLog=10,
        thresholdsStyleMode=band.style if band else "off",
        thresholds=band.json_steps() if band else [{"color": "green", "value": None}],
        overrides=list(overrides),
        drawStyle=draw,
        lineInterpolation=interpolation,
        tooltipMode="multi",
        legendDisplayMode="list",
        showPoints="never",
        maxDataPoints=1000,
        span=width,
    )
    return panel


def state_timeline(
    title: str,
    description: str,
    targets: Sequence[Target],
    *,
    states: dict[int, tuple[str, str]],
    width: int = 12,
) -> StateTimeline:
    """A state timeline of a 0/1 gauge; ``states`` maps a value to (text, colour)."""
    mappings = [
        {
            "type": "value",
            "options": {str(v): {"text": text, "color": colour, "index": i}
                        for i, (v, (text, colour)) in enumerate(sorted(states.items()))},
        }
    ]
    return StateTimeline(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=with_ref_ids(targets),
        mappings=mappings,
        maxDataPoints=1000,
        span=width,
    )


def stat(title: str, description: str, targets: Sequence[Target], *, unit: str = "none",
         width: int = 6) -> Stat:
    """A single-value panel showing the last value of each series."""
    return Stat(
        title=title,
        description=description,
        dataSource=DATASOURCE,
        targets=with_ref_ids(targets),
        format=unit,
        reduceCalc="lastNotNull",
        graphMode="none",
        noValue="no data",
        thresholds=[{"color": "text", "value": None}],
        span=width,
    )


@attr.s
class RankHeatmap(Panel):
    """Grafana's current heatmap panel with one row per series (no bucketing by Grafana): the
    series' display names (``legendFormat``) label the rows, the colour is the value."""

    unit = attr.ib(default="s")
    colorScheme = attr.ib(default="Oranges")

    def to_json_data(self):
        return self.panel_json(
            {
                "type": "heatmap",
                "fieldConfig": {"defaults": {"unit": self.unit, "custom": {}}, "overrides": []},
                "options": {
                    "calculate": False,
                    "cellGap": 1,
                    "color": {
                        "mode": "scheme",
                        "scheme": self.colorScheme,
                        "scale": "exponential",
                        "exponent": 0.5,
                        "fill": "dark-orange",
                        "reverse": False,
                        "steps": 64,
                    },
                    "rowsFrame": {"layout": "auto"},
                    "yAxis": {"axisPlacement": "left", "reverse": False},
                    "cellValues": {"unit": self.unit},
                    "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
                    "legend": {"show": True},
                    "showValue": "never",
                },
            }
        )


@dataclass(slots=True)
class Section:
    """A collapsible row of panels; panels flow left to right by their ``span`` (width)."""

    title: str
    panels: list[Panel] = field(default_factory=list)


def _layout(sections: Iterable[Section]) -> list[Panel]:
    laid_out: list[Panel] = []
    y = 0
    for section in sections:
        laid_out.append(RowPanel(title=section.title, gridPos=GridPos(h=1, w=_GRID_WIDTH, x=0, y=y)))
        y += 1
        x = 0
        for panel in section.panels:
            w = panel.span or 12
            if not 1 <= w <= _GRID_WIDTH:
                raise ValueError(f"panel {panel.title!r}: width {w} outside 1..{_GRID_WIDTH}")
            if x + w > _GRID_WIDTH:
                x, y = 0, y + _ROW_HEIGHT
            laid_out.append(attr.evolve(panel, span=None,
                                        gridPos=GridPos(h=_ROW_HEIGHT, w=w, x=x, y=y)))
            x += w
        y += _ROW_HEIGHT
    return laid_out


def _variables() -> list[Template]:
    metric = "trainguard_step"
    common = dict(dataSource=DATASOURCE, refresh=2, sort=1, includeAll=True, multi=True,
                  allValue=".*", default="$__all")
    return [
        Template(name="datasource", label="Prometheus", query="prometheus", type="datasource",
                 default=DATASOURCE_UID, dataSource=None, refresh=1),
        Template(name="job", label="Job", query=f"label_values({metric}, job)", **common),
        Template(name="run", label="Run",
                 query=f'label_values({metric}{{job=~"$job"}}, run)', **common),
        # Ranks in numeric order (Grafana's sort 3; alphabetical would put 10 before 2).
        Template(name="rank", label="Rank",
                 query=f'label_values({metric}{{job=~"$job", run=~"$run"}}, rank)', **{**common, "sort": 3}),
    ]


def _query_annotation(name: str, colour: str, expr: str, title: str, text: str,
                      tags: str) -> dict:
    """An annotation drawn from a Prometheus query: one mark per series the query returns."""
    return {
        "datasource": DATASOURCE,
        "enable": True,
        "iconColor": colour,
        "name": name,
        "expr": expr,
        "step": "15s",
        "titleFormat": title,
        "textFormat": text,
        "tagKeys": tags,
        "useValueForTime": False,
    }


def _annotations() -> Annotations:
    """Grafana's own annotations, the Prometheus alerts of the generated rules (``ALERTS``),
    every controller action applied by the run (a change of the applied generation), and the
    controller's own alerts (its counter carries rule and severity, not the run)."""
    builtin = {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    }
    alerts = _query_annotation(
        "Prometheus alerts", "red", f'ALERTS{{alertstate="firing", {JOB_RUN}}}',
        "{{alertname}}", "{{severity}}: action {{trainguard_action}} on run {{run}}",
        "severity,trainguard_action")
    actions = _query_annotation(
        "Controller actions applied", "purple",
        f'max by (job, run) (changes(trainguard_applied_generation{{{JOB_RUN}}}[1m])) > 0',
        "desired-state generation applied",
        "run {{run}}: new controller generation applied (pause, lr_scale, checkpoint or stop)",
        "run")
    controller_alerts = _query_annotation(
        "Controller alerts", "orange",
        # increase() cannot see a counter series' first increment (the series appears at 1), so
        # a rule's first alert is caught as a series that did not exist a minute earlier.
        "sum by (rule, severity) (increase(trainguard_controller_alerts_total[1m])) > 0 "
        "or sum by (rule, severity) (trainguard_controller_alerts_total "
        "unless trainguard_controller_alerts_total offset 1m)",
        "controller alert {{rule}}", "{{severity}}: the controller's rule {{rule}} fired (all runs)",
        "rule,severity")
    return Annotations(list=[builtin, alerts, actions, controller_alerts])


def dashboard(*, uid: str, title: str, description: str, tags: Sequence[str],
              sections: Sequence[Section]) -> Dashboard:
    """A dashboard with the shared variables, annotations, time range and refresh."""
    return Dashboard(
        uid=uid,
        title=title,
        description=description,
        tags=["trainguard", *tags],
        panels=_layout(sections),
        templating=Templating(list=_variables()),
        annotations=_annotations(),
        time=Time("now-30m", "now"),
        refresh="10s",
        schemaVersion=SCHEMA_VERSION,
        graphTooltip=1,
        timezone="browser",
        editable=True,
    ).auto_panel_ids()


def right_axis(series_regex: str, *, draw: str = "line") -> dict:
    """A field override moving the series whose display name matches to the right axis."""
    return {
        "matcher": {"id": "byRegexp", "options": series_regex},
        "properties": [
            {"id": "custom.axisPlacement", "value": "right"},
            {"id": "custom.drawStyle", "value": draw},
        ],
    }

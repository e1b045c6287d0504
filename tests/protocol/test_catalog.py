"""The metric catalogue's scopes (which ranks serve a metric) and its series counts, against
small cases counted by hand, the code that produces the labelled values, and the figures the
README states. What real exporters serve: tests/agent/test_agent_exporter.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.protocol.catalog import (
    AGENT_METRICS,
    BY_NAME,
    JOB,
    LABEL_VALUES,
    LAYER,
    ONE_AT_A_TIME,
    RANK,
    MetricSpec,
    exported_scopes,
    series_per_job,
    series_per_rank,
)

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_metric_has_a_scope_and_the_per_layer_ones_theirs() -> None:
    assert {m.scope for m in AGENT_METRICS} == {RANK, JOB, LAYER}
    assert {m.name for m in AGENT_METRICS if m.scope == LAYER} == {m.name for m in AGENT_METRICS if "layer" in m.labels}
    # What differs per rank is served by every rank; the job's values by the leader.
    for name in ("trainguard_loss", "trainguard_step_duration_seconds", "trainguard_forward_seconds",
                 "trainguard_input_wait_seconds", "trainguard_memory_peak_bytes", "trainguard_tokens_per_second",
                 "trainguard_gpu_temperature_celsius", "trainguard_comm_exposed_seconds",
                 "trainguard_data_duplicate_ratio", "trainguard_agent_errors_total"):
        assert BY_NAME[name].scope == RANK, name
    for name in ("trainguard_grad_norm", "trainguard_learning_rate", "trainguard_update_ratio",
                 "trainguard_grad_noise_scale", "trainguard_param_norm", "trainguard_lr_scale", "trainguard_paused",
                 "trainguard_global_batch_size", "trainguard_agent_controller_up"):
        assert BY_NAME[name].scope == JOB, name
    with pytest.raises(ValueError, match="scope"):
        MetricSpec("trainguard_x", "gauge", "1", "x", (), "leader")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per-layer"):
        MetricSpec("trainguard_x", "gauge", "1", "x", ("layer",), RANK)
    with pytest.raises(ValueError, match="per-layer"):
        MetricSpec("trainguard_x", "gauge", "1", "x", (), LAYER)


def test_exported_scopes() -> None:
    assert exported_scopes(0) == {RANK, JOB, LAYER}
    assert exported_scopes(5) == {RANK}
    assert exported_scopes(5, job_metrics="all") == {RANK, JOB}
    assert exported_scopes(5, per_layer="all") == {RANK, LAYER}
    assert exported_scopes(0, per_layer="off") == {RANK, JOB}
    for bad in ({"job_metrics": "leader"}, {"per_layer": "some"}):
        with pytest.raises(ValueError):
            exported_scopes(0, **bad)
    for rank in (-1, True, 1.0):
        with pytest.raises(ValueError, match="rank"):
            exported_scopes(rank)  # type: ignore[arg-type]


def test_series_counts_of_a_small_case_counted_by_hand() -> None:
    names = ["trainguard_loss", "trainguard_learning_rate", "trainguard_layer_grad_norm", "trainguard_skipped_steps_total"]
    kw = dict(layers=3, param_groups=2, names=names)
    # leader: loss 1 + LR 2 groups + 3 layers + 3 skip reasons
    assert series_per_rank(0, **kw) == 9
    assert series_per_rank(1, **kw) == 1
    assert series_per_rank(1, per_layer="all", **kw) == 4
    assert series_per_rank(1, job_metrics="all", **kw) == 6
    assert series_per_rank(0, per_layer="off", **kw) == 6
    assert series_per_job(4, **kw) == 9 + 3 * 1
    assert series_per_job(1, **kw) == 9
    assert series_per_job(4, job_metrics="all", per_layer="all", **kw) == 4 * 9
    with pytest.raises(ValueError, match="unknown"):
        series_per_rank(0, layers=1, names=["trainguard_no_such_metric"])
    with pytest.raises(ValueError):
        series_per_rank(0, layers=-1)
    with pytest.raises(ValueError):
        series_per_job(0, layers=1)


def test_the_fixed_label_values_are_the_ones_the_agent_produces() -> None:
    from trainer_agent.control.actuators import SKIP_REASONS
    from trainer_agent.data import QualityFilter

    assert set(LABEL_VALUES["reason"]) == {*SKIP_REASONS.values(), "data"}
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    QualityFilter(iter(()), registry=registry, labels={"job": "j", "run": "r", "rank": "0"})
    decisions = {s.labels["decision"] for fam in registry.collect() for s in fam.samples}
    assert decisions == set(LABEL_VALUES["decision"])
    # Every labelled metric's labels have a count: fixed values, or the run's groups and layers.
    assert {label for m in AGENT_METRICS for label in m.labels} == {*LABEL_VALUES, "group", "layer", *ONE_AT_A_TIME}


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def test_the_readme_states_the_catalogues_series_counts() -> None:
    text = README.read_text(encoding="utf-8")
    own = series_per_rank(1, layers=0)
    job = series_per_rank(0, layers=0) - own
    per_layer = series_per_rank(0, layers=1) - own - job
    flat = " ".join(text.split())
    assert f"W × {own} + {job} + {per_layer} × L" in flat and f"W × ({own} + {per_layer} × L) + {job}" in flat
    assert f"at most {own} series" in flat and f"{job}, one more per extra param group" in flat
    assert f"({per_layer} per layer)" in flat
    header = '| ranks | 15 layers | 131 layers | 15 layers, `per_layer="all"` | 131 layers, `per_layer="all"` |'
    lines = text.splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    assert [_number(r[0]) for r in rows] == [8, 512, 4096]
    for world, *cells in rows:
        expected = [series_per_job(_number(world), layers=layers, per_layer=per_layer)
                    for per_layer in ("rank0", "all") for layers in (15, 131)]
        assert [_number(c) for c in cells] == expected, world
    assert "a few million active series" in flat

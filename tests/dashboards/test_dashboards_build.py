"""The generated dashboards and configs: no drift from the sources, the structure Grafana needs,
and every metric an expression uses defined by an exporter."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trainguard.dashboards import build
from trainguard.dashboards.catalogue import exported_metrics, unknown_metrics
from trainguard.dashboards.common import DATASOURCE_UID, GRAFANA_IMAGE, SCHEMA_VERSION
from trainguard.dashboards.promql import metric_names, variable_query_metric
from trainguard.dashboards.rules import ALERT_RULES, RECORDING_RULES
from trainguard.protocol.catalog import BY_NAME, RANK

GENERATED = build.GENERATED
EXPECTED_UIDS = {
    "training-stability.json": "trainguard-stability",
    "data-quality.json": "trainguard-data-quality",
    "ranks.json": "trainguard-ranks",
    "controller.json": "trainguard-controller",
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return build.render()


@pytest.fixture(scope="module")
def dashboards(rendered) -> dict[str, dict]:
    return {name: json.loads(rendered[f"grafana/dashboards/{name}"]) for name in build.DASHBOARDS}


def test_checked_in_files_match_the_sources(rendered):
    stale = build.stale_files(GENERATED, rendered)
    assert stale == [], f"run `trainguard dashboards build` and commit: stale {stale}"
    # The compose file mounts these folders whole: nothing there but what the build writes.
    present = {p.relative_to(GENERATED).as_posix() for p in GENERATED.rglob("*") if p.is_file()}
    assert present == set(rendered) | {build.MANIFEST}


def test_check_mode_reports_drift_and_build_repairs_it(tmp_path, capsys):
    assert build.main(["--out", str(tmp_path)]) == 0
    assert build.main(["--out", str(tmp_path), "--check"]) == 0
    target = tmp_path / "grafana/dashboards/ranks.json"
    target.write_text(target.read_text().replace("Step time per rank", "edited by hand"))
    # A file an earlier build wrote that this one no longer writes (a dashboard since removed).
    (tmp_path / "prometheus/leftover.yml").write_text("groups: []\n")
    manifest = tmp_path / build.MANIFEST
    manifest.write_text(manifest.read_text() + "prometheus/leftover.yml\n")
    assert build.main(["--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "ranks.json" in err and "leftover.yml" in err
    assert build.main(["--out", str(tmp_path)]) == 0
    assert not (tmp_path / "prometheus/leftover.yml").exists()
    assert build.main(["--out", str(tmp_path), "--check"]) == 0


def test_build_deletes_nothing_it_did_not_write(tmp_path, capsys):
    """A folder a user points --out at (Prometheus's own configuration folder, say) keeps every
    file of theirs, under the build's subfolders too; a manifest naming a path outside the
    folder deletes nothing there."""
    theirs = {"prometheus/their-rules.yml": "groups: []\n", "notes.txt": "mine\n", "grafana/x/y.json": "{}"}
    for rel, text in theirs.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("keep\n")
    (tmp_path / build.MANIFEST).write_text(f"../{outside.name}\n{outside}\n")
    assert build.main(["--out", str(tmp_path)]) == 0
    assert build.main(["--out", str(tmp_path), "--check"]) == 0
    assert {rel: (tmp_path / rel).read_text() for rel in theirs} == theirs
    assert outside.read_text() == "keep\n"
    assert (tmp_path / "prometheus/rules.yml").is_file()


def test_default_folder_is_the_checkout_or_the_current_directory(tmp_path, monkeypatch):
    assert build.default_out() == build.GENERATED  # this source checkout
    monkeypatch.setattr(build, "GENERATED", tmp_path / "site-packages/trainguard/dashboards/generated")
    monkeypatch.chdir(tmp_path)
    assert build.main([]) == 0
    assert (tmp_path / "trainguard-generated/prometheus/rules.yml").is_file()
    assert not (tmp_path / "site-packages").exists()


def test_dashboards_have_stable_uids_and_the_pinned_schema(dashboards):
    assert {name: d["uid"] for name, d in dashboards.items()} == EXPECTED_UIDS
    assert GRAFANA_IMAGE.startswith("grafana/grafana:12.")
    for d in dashboards.values():
        assert d["schemaVersion"] == SCHEMA_VERSION == 41
        assert d["id"] is None  # provisioning assigns ids; a fixed id would clash across orgs


def test_every_dashboard_has_job_run_rank_variables_and_action_annotations(dashboards):
    for name, d in dashboards.items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert {"datasource", "job", "run", "rank"} <= variables.keys(), name
        assert variables["datasource"]["current"]["value"] == DATASOURCE_UID
        assert variables["run"]["query"] == 'label_values(trainguard_step{job=~"$job"}, run)'
        exprs = {a["name"]: a.get("expr", "") for a in d["annotations"]["list"]}
        assert exprs["Prometheus alerts"].startswith("ALERTS{")
        assert "trainguard_applied_generation" in exprs["Controller actions applied"]


def test_ranks_are_listed_in_numeric_order(dashboards):
    """Grafana's variable sort 3 is numerical ascending (1 alphabetical: rank 10 before rank 2)."""
    for name, d in dashboards.items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert variables["rank"]["sort"] == 3, name
        assert variables["job"]["sort"] == variables["run"]["sort"] == 1, name


def _panels(d: dict) -> list[dict]:
    return [p for p in d["panels"] if p["type"] != "row"]


def test_panels_use_the_datasource_variable_and_do_not_overlap(dashboards):
    for name, d in dashboards.items():
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), name
        cells: set[tuple[int, int]] = set()
        for p in d["panels"]:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24, (name, p["title"])
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, (name, p["title"])
                    cells.add((x, y))
        for p in _panels(d):
            assert p["targets"], (name, p["title"])
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert [t["refId"] for t in p["targets"]] == list("ABCDEFGH"[: len(p["targets"])])


def test_panel_titles_are_unique_per_dashboard(dashboards):
    for name, d in dashboards.items():
        titles = [p["title"] for p in _panels(d)]
        assert len(titles) == len(set(titles)), name


def test_panels_carry_the_required_content(dashboards):
    titles = {name: {p["title"] for p in _panels(d)} for name, d in dashboards.items()}
    exprs = {name: " ".join(e for _, e in build.dashboard_queries(d)) for name, d in dashboards.items()}
    stability = exprs["training-stability.json"]
    for metric in ("trainguard_loss", "trainguard_grad_norm", "trainguard_layer_grad_norm",
                   "trainguard_update_ratio", "trainguard_param_norm", "trainguard_param_scale",
                   "trainguard_learning_rate", "trainguard_effective_lr", "trainguard_lr_scale",
                   "trainguard_loss_scale", "trainguard_amp_skipped_steps_total",
                   "trainguard_nonfinite_grads", "trainguard_grad_noise_scale", "trainguard_paused"):
        assert metric in stability, metric
    assert "topk by (job, run) (5, max by (job, run, layer) (trainguard_layer_grad_norm" in stability
    data = exprs["data-quality.json"]
    for metric in ("trainguard_data_duplicate_ratio", "trainguard_data_token_kl_divergence",
                   "trainguard_data_special_token_ratio", "trainguard_data_length_shift_pvalue",
                   "trainguard_tokens_per_second", "trainguard_data_filtered_total"):
        assert metric in data, metric
    ranks = {p["title"]: p for p in _panels(dashboards["ranks.json"])}
    heatmap = ranks["Step time per rank (heatmap)"]
    assert heatmap["type"] == "heatmap" and heatmap["options"]["calculate"] is False
    assert heatmap["targets"][0]["legendFormat"] == "rank {{rank}} ({{run}})"
    assert "Controller reachable" in titles["ranks.json"]
    assert "trainguard_controller_" in exprs["controller.json"]


def _thresholds(d: dict, title: str) -> tuple[list, str]:
    panel = next(p for p in _panels(d) if p["title"] == title)
    defaults = panel["fieldConfig"]["defaults"]
    return defaults["thresholds"]["steps"], defaults["custom"]["thresholdsStyle"]["mode"]


def _job_level(names: set[str]) -> set[str]:
    """The names of ``names`` that rank 0 alone serves by default (catalogue scope job or layer)."""
    return {n for n in names if n in BY_NAME and BY_NAME[n].scope != RANK}


def test_job_level_metrics_are_read_per_run_never_per_rank(dashboards):
    """Only rank 0 serves the job's values (the others served copies): a panel or rule reading one
    aggregates it per run, and neither selects nor names a rank. Per-rank metrics keep theirs."""
    per_run = re.compile(r"max by \(job, run(?:, \w+)?\) \(")
    job_panels = 0
    for name, d in dashboards.items():
        for p in _panels(d):
            for t in p["targets"]:
                job = _job_level(metric_names(t["expr"]))
                if not job:
                    continue
                job_panels += 1
                where = (name, p["title"], t["expr"])
                assert "$rank" not in t["expr"] and "rank=" not in t["expr"] and "rank" not in t["legendFormat"], where
                for metric in job:
                    assert re.search(per_run.pattern + r"(?:(?:rate|increase|changes)\()?" + metric + r"\{", t["expr"]), (metric, where)
        for a in d["annotations"]["list"]:
            if _job_level(metric_names(a.get("expr", "") or "up")):
                assert "rank" not in a["expr"] and per_run.search(a["expr"]), (name, a["name"])
    assert job_panels >= 15
    for where, expr in build.rule_queries():
        if _job_level(metric_names(expr)):
            assert "rank" not in expr and per_run.search(expr), (where, expr)
    # The per-rank panels still show every rank.
    ranks = {p["title"]: p for p in _panels(dashboards["ranks.json"])}
    assert ranks["Step time per rank"]["targets"][0]["legendFormat"] == "rank {{rank}} ({{run}})"


def test_every_series_of_the_training_dashboards_names_its_run(dashboards):
    """The Run variable selects every run by default: a legend without the run names the series of
    two runs alike (rank 0 of each, one heatmap row for both)."""
    for name in ("training-stability.json", "data-quality.json", "ranks.json"):
        for p in _panels(dashboards[name]):
            for t in p["targets"]:
                assert "{{run}}" in t["legendFormat"], (name, p["title"], t["legendFormat"])


def test_update_ratio_band_and_alert_thresholds_are_drawn(dashboards):
    steps, mode = _thresholds(dashboards["training-stability.json"], "Update ratio ||ΔW|| / ||W||")
    assert mode == "line+area"
    assert [(s["value"], s["color"]) for s in steps] == [
        (None, "transparent"), (1e-4, "green"), (1e-2, "transparent")]
    limits = {"Duplicate ratio": 0.05, "Token distribution KL divergence": 0.1,
            "Special / control token ratio": 1e-4, "Length distribution shift (KS p-value)": 0.05}
    for title, value in limits.items():
        steps, mode = _thresholds(dashboards["data-quality.json"], title)
        assert mode == "line" and steps[1]["value"] == value, title


def test_the_replicas_agreement_is_drawn_against_the_desync_tolerance(dashboards):
    title = "Replica agreement: largest difference across ranks"
    steps, mode = _thresholds(dashboards["ranks.json"], title)
    assert mode == "line" and steps[1] == {"color": "red", "value": 1e-5}  # the desync rules' rel_tol
    panel = next(p for p in _panels(dashboards["ranks.json"]) if p["title"] == title)
    assert [metric_names(t["expr"]) for t in panel["targets"]] == [
        {"trainguard_grad_desync_rel_diff"}, {"trainguard_param_desync_rel_diff"}]
    assert "1e-5" in panel["description"] and "silent" in panel["description"]


def test_metric_extraction_on_hand_written_expressions():
    cases = {
        'sum by (job, run) (rate(trainguard_data_filtered_total{job=~"$job", decision="dropped"}[$__rate_interval]))':
            {"trainguard_data_filtered_total"},
        "histogram_quantile(0.99, sum by (le) (rate(x_seconds_bucket[5m])))": {"x_seconds_bucket"},
        "a / on (job) group_left (rank) b offset 5m > bool 1e3": {"a", "b"},
        "topk(5, m{l=\"a{b}[c]\"}) unless ignoring (x) max without (y) (n:rec:max)": {"m", "n:rec:max"},
        "max_over_time(deriv(g[5m])[30m:1m]) or vector(0) and Inf < NaN": {"g"},
        "count_values(\"v\", c) + 0x1F - 2.5e-3 * quantile(0.5, q)": {"c", "q"},
    }
    for expr, names in cases.items():
        assert metric_names(expr) == names, expr
    assert variable_query_metric('label_values(trainguard_step{job=~"$job"}, run)') == {"trainguard_step"}
    with pytest.raises(ValueError, match="unbalanced"):
        metric_names("rate(x[5m]")


def test_every_expression_uses_catalogued_metrics(dashboards):
    exported = exported_metrics()
    assert {"trainguard_grad_norm", "trainguard_paused"} <= exported.keys()
    assert any(n.startswith("trainguard_controller_") for n in exported)
    recorded = {r.record for r in RECORDING_RULES}
    seen: set[str] = set()
    queries = [q for d in dashboards.values() for q in build.dashboard_queries(d)] + build.rule_queries()
    for where, expr in queries:
        names = metric_names(expr)
        assert names, where
        assert unknown_metrics(names - recorded) == set(), (where, expr)
        seen |= names
    # Recording rules read only exporters' metrics or rules recorded before them.
    assert recorded <= seen
    for alert in ALERT_RULES:
        assert metric_names(alert.expr) & (recorded | {"up"}), alert.name


def test_unknown_metrics_are_refused(monkeypatch):
    assert unknown_metrics({"trainguard_grad_norm", "up", "ALERTS", "trainguard_gradnorm"}) == {
        "trainguard_gradnorm"}
    assert unknown_metrics({"trainguard_grad_norm_bucket"}) == {"trainguard_grad_norm_bucket"}
    bad = build.dashboard_json(build.DASHBOARDS["ranks.json"])
    bad["panels"][1]["targets"][0]["expr"] = "rate(trainguard_no_such_metric_total[1m])"
    with pytest.raises(ValueError, match="trainguard_no_such_metric_total"):
        build.check_metric_names({"ranks.json": bad})


def test_generated_stack_files_wire_the_services_together(rendered):
    import yaml

    prom = yaml.safe_load(rendered["prometheus/prometheus.yml"])
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    ranks = jobs["trainguard-ranks"]
    assert ranks["honor_labels"] is False  # target labels come from discovery (see test_prometheus_labels.py)
    sd = ranks["http_sd_configs"][0]
    assert sd["url"] == "http://controller:8000/v1/sd/targets"
    assert sd["authorization"]["credentials_file"] == "/run/secrets/trainguard_prometheus_token"
    assert jobs["trainguard-controller"]["static_configs"] == [{"targets": ["controller:8000"]}]
    am = yaml.safe_load(rendered["alertmanager/alertmanager.yml"])
    urls = {r["name"]: r["webhook_configs"][0]["url"] for r in am["receivers"]}
    assert urls == {"trainguard-controller": "http://controller:8000/v1/alertmanager",
                    "webhook-sink": "http://webhook-sink:9000/alerts"}
    ds = yaml.safe_load(rendered["grafana/provisioning/datasources/prometheus.yml"])
    assert ds["datasources"][0]["uid"] == DATASOURCE_UID
    provider = yaml.safe_load(rendered["grafana/provisioning/dashboards/trainguard.yml"])
    assert provider["providers"][0]["options"]["path"] == build.GRAFANA_DASHBOARDS_PATH
    rules = yaml.safe_load(rendered["prometheus/rules.yml"])
    [group] = rules["groups"]
    kinds = ["record" if "record" in r else "alert" for r in group["rules"]]
    assert kinds == sorted(kinds, reverse=True), "recording rules must precede the alerts reading them"
    for rule in group["rules"]:
        if "alert" in rule:
            assert rule["labels"]["trainguard_action"] in ("notify", "pause", "lr_scale"), rule["alert"]


def test_builders_refuse_bad_arguments():
    from trainguard.dashboards.common import Band
    from trainguard.dashboards.rules import AlertRule, Recording
    from trainguard.dashboards.stack import prometheus_config

    with pytest.raises(ValueError, match="increasing"):
        Band(((0.1, "red"), (0.01, "green")))
    with pytest.raises(ValueError, match="style"):
        Band(((0.1, "red"),), style="zigzag")
    with pytest.raises(ValueError, match="trainguard:<metric>:<ops>"):
        Recording(record="grad_norm_max", expr="max(trainguard_grad_norm)")
    with pytest.raises(ValueError, match="action"):
        AlertRule(name="TrainguardX", expr="up == 0", action="reboot", severity="warning", summary="x")
    with pytest.raises(ValueError, match="severity"):
        AlertRule(name="TrainguardX", expr="up == 0", action="notify", severity="loud", summary="x")
    with pytest.raises(ValueError, match="host:port"):
        prometheus_config(controller="http://controller:8000", token_file=None)
    config = prometheus_config(controller="127.0.0.1:8000", token_file=None, alertmanager="127.0.0.1:9093")
    assert all("authorization" not in job for job in config["scrape_configs"])
    assert config["alerting"]["alertmanagers"][0]["static_configs"] == [{"targets": ["127.0.0.1:9093"]}]

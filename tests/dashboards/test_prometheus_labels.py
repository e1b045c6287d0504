"""A real Prometheus with the shipped scrape configuration: a rank's exporter that serves
``trainguard_loss{run="run-b"} NaN`` cannot make Prometheus (or the alerts it fires) speak for
run-b. The labels naming a target come from the controller's discovery answer."""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml

from tests.service.conftest import serve, wait_until  # noqa: F401 - (serve is a fixture)
from trainguard.dashboards.rules import rule_groups
from trainguard.dashboards.stack import prometheus_config

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed")

EVIL = (b'# TYPE trainguard_loss gauge\n'
        b'trainguard_loss{job="job-b",run="run-b",rank="0"} NaN\n'
        b'# TYPE trainguard_optimizer_state_nonfinite gauge\n'
        b'trainguard_optimizer_state_nonfinite{job="job-b",run="run-b",rank="0"} 7\n'
        b'# TYPE trainguard_loss_nonfinite_total counter\n'
        b'trainguard_loss_nonfinite_total{job="job-b",run="run-b",rank="0"} 5\n')


class _Exporter(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(EVIL)))
        self.end_headers()
        self.wfile.write(EVIL)

    def log_message(self, *args: object) -> None:
        pass


def _ready(prom: str) -> bool:
    try:
        with urllib.request.urlopen(f"{prom}/-/ready", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _query(prom: str, q: str) -> list[dict]:
    with urllib.request.urlopen(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q}), timeout=10) as r:
        return json.load(r)["data"]["result"]


def test_target_labels_come_from_discovery_not_from_the_target(tmp_path: Path, serve) -> None:
    exporter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    threading.Thread(target=exporter.serve_forever, daemon=True).start()
    srv = serve(tmp_path / "tg.db")
    port_a = exporter.server_address[1]
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for run, job, port in (("run-a", "job-a", port_a), ("run-b", "job-b", 1)):
            reg = {"job": job, "run": run, "world_size": 1, "ranks": [{"rank": 0, "local_rank": 0, "host": "127.0.0.1", "port": port}]}
            assert c.post("/v1/runs", json=reg).status_code == 200
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule_groups()))
    controller = srv.url.removeprefix("http://")
    config = prometheus_config(controller=controller, token_file=None, scrape_interval="1s", sd_refresh_interval="1s")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    assert subprocess.run([shutil.which("promtool") or "promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True).returncode == 0
    with socket.socket() as s:  # (Prometheus cannot report a port it picked itself)
        s.bind(("127.0.0.1", 0))
        prom_port = s.getsockname()[1]
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"], stdout=log, stderr=log)
    prom = f"http://127.0.0.1:{prom_port}"
    try:
        wait_until(lambda: _ready(prom) or proc.poll() is not None, timeout=60, every=0.2)
        assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
        wait_until(lambda: _query(prom, 'trainguard_loss'), timeout=60, every=0.5)
        series = _query(prom, 'trainguard_loss')
        assert [s["metric"].get("run") for s in series] == ["run-a"]
        assert series[0]["metric"]["job"] == "job-a" and series[0]["metric"]["instance"] == f"127.0.0.1:{port_a}"
        assert not any(k.startswith("exported_") for k in series[0]["metric"])
        assert _query(prom, 'trainguard_loss{run="run-b"}') == []
        # the alerts name the run whose target served the bad values: the one that pauses and the
        # one that notifies
        for alert in ("TrainguardOptimizerStateNonFinite", "TrainguardLossNonFinite"):
            wait_until(lambda: _query(prom, f'ALERTS{{alertname="{alert}"}}'), timeout=60, every=0.5)
            found = _query(prom, f'ALERTS{{alertname="{alert}"}}')
            assert {a["metric"]["run"] for a in found} == {"run-a"}, alert
        assert {a["metric"]["trainguard_action"] for a in _query(prom, 'ALERTS{alertname="TrainguardOptimizerStateNonFinite"}')} == {"pause"}
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        exporter.shutdown()
        time.sleep(0)

"""A real Alertmanager (Debian's package) delivering to the controller's /v1/alertmanager."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from datetime import datetime, timezone

import httpx
import pytest

from tests.service.conftest import wait_until

pytestmark = pytest.mark.integration

ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
OP, AG = "op-token-am-000001", "agent-token-am-0001"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not shutil.which(ALERTMANAGER), reason="prometheus-alertmanager is not installed (scripts/setup.sh installs it)")
def test_real_alertmanager_drives_a_pause(tmp_path, serve):
    srv = serve(tmp_path / "tg.db", {"TRAINGUARD_OPERATOR_TOKENS": OP, "TRAINGUARD_AGENT_TOKENS": AG})
    op = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {OP}"}, timeout=10)
    ag = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {AG}"}, timeout=10)
    assert ag.post("/v1/runs", json={"job": "job-am", "run": "run-am", "world_size": 1}).status_code == 200

    config = tmp_path / "alertmanager.yml"
    config.write_text(f"""
route:
  receiver: trainguard
  group_by: [alertname, run]
  group_wait: 100ms
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: trainguard
    webhook_configs:
      - url: {srv.url}/v1/alertmanager
        send_resolved: false
        http_config:
          authorization:
            credentials: {OP}
""")
    port = free_port()
    am = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        am_url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            try:
                return httpx.get(f"{am_url}/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                assert am.poll() is None, am.stderr.read().decode()
                return False

        wait_until(ready, timeout=30, every=0.1)
        now = datetime.now(timezone.utc).isoformat()
        alert = {"labels": {"alertname": "GradNormHigh", "run": "run-am", "trainguard_action": "pause", "severity": "critical"},
                 "annotations": {"summary": "grad norm above 1e3 for 5m"}, "startsAt": now}
        assert httpx.post(f"{am_url}/api/v2/alerts", json=[alert], timeout=5).status_code == 200
        state = wait_until(lambda: (d := op.get("/v1/runs/run-am").json()["desired"])["paused"] and d, timeout=30, every=0.1)
        assert state["generation"] == 1 and "grad norm above 1e3" in state["reason"]
        # Alertmanager sends the same group again (same fingerprint + startsAt): it acts once.
        assert httpx.post(f"{am_url}/api/v2/alerts", json=[alert], timeout=5).status_code == 200
        time.sleep(1.5)
        events = [e for e in op.get("/v1/runs/run-am/events").json() if e["kind"] == "desired"]
        assert len(events) == 1 and events[0]["actor"] == "alertmanager:GradNormHigh"
        assert op.get("/v1/runs/run-am/desired").json()["generation"] == 1
    finally:
        am.terminate()
        try:
            am.wait(10)
        except subprocess.TimeoutExpired:
            am.kill()
            am.wait(10)

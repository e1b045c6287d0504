"""A real Alertmanager (Debian's package) delivering to the controller's /v1/alertmanager.

Alertmanager is set to send the same notification again every second, so "acts once" is tested
by something that would show a second action: the alert, one a team wrote itself, carries
``trainguard_lr_factor`` (the run's lr_scale times 0.5), so a repeat would halve the scale again.
The controller is then killed and restarted on its database (same port, Alertmanager keeps
sending): the alerts it already acted on, and an operator's Idempotency-Key, are remembered.
"""

from __future__ import annotations

import re
import shutil
from datetime import datetime, timezone

import httpx
import pytest

from tests.service.conftest import wait_until
from tests.tools.listening import start_listening, stop

pytestmark = pytest.mark.integration

ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
OP, AG = "op-token-am-000001", "agent-token-am-0001"
ENV = {"TRAINGUARD_OPERATOR_TOKENS": OP, "TRAINGUARD_AGENT_TOKENS": AG}


def _sent(am_url: str) -> int:
    """Webhook notifications Alertmanager delivered successfully (attempts minus failures)."""
    text = httpx.get(f"{am_url}/metrics", timeout=5).text

    def total(name: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(name + r'\{[^}]*integration="webhook"[^}]*\} (\S+)', text))

    return int(total("alertmanager_notifications_total") - total("alertmanager_notifications_failed_total"))


def _alert(name: str, starts: str) -> dict:
    # an alert of the team's own rules that asks for an LR cut (the generated gradient alerts notify
    # only: the controller's gradient rules decide that cut by cause)
    return {"labels": {"alertname": name, "job": "job-am", "run": "run-am", "severity": "warning",
                       "trainguard_action": "lr_scale", "trainguard_lr_factor": "0.5"},
            "annotations": {"summary": "grad norm above 1e3"}, "startsAt": starts}


@pytest.mark.skipif(not shutil.which(ALERTMANAGER), reason="prometheus-alertmanager is not installed (scripts/setup.sh installs it)")
def test_real_alertmanager_lr_factor_acts_once_across_resends_and_a_restart(tmp_path, serve):
    srv = serve(tmp_path / "tg.db", ENV)
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
  repeat_interval: 1s
receivers:
  - name: trainguard
    webhook_configs:
      - url: {srv.url}/v1/alertmanager
        send_resolved: false
        http_config:
          authorization:
            credentials: {OP}
""")
    am, port = start_listening([ALERTMANAGER, f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
                                "--web.listen-address=127.0.0.1:0", "--cluster.listen-address=", "--log.level=info"],
                               tmp_path / "alertmanager.log")
    am_url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{am_url}/-/ready", timeout=1).status_code == 200, timeout=30, every=0.1)
        starts = datetime.now(timezone.utc).isoformat()
        assert httpx.post(f"{am_url}/api/v2/alerts", json=[_alert("TeamGradNormHigh", starts)], timeout=5).status_code == 200
        state = wait_until(lambda: (d := op.get("/v1/runs/run-am").json()["desired"])["generation"] and d, timeout=30, every=0.1)
        assert (state["generation"], state["lr_scale"]) == (1, 0.5) and "grad norm above 1e3" in state["reason"]
        # Alertmanager sends the same alert again every second: each repeat would halve the scale.
        first = _sent(am_url)
        wait_until(lambda: _sent(am_url) >= first + 2, timeout=30, every=0.2)
        assert op.get("/v1/runs/run-am/desired").json()["lr_scale"] == 0.5

        key = {"Idempotency-Key": "ckpt-before-restart"}
        before = op.post("/v1/runs/run-am/checkpoint", json={"reason": "keep"}, headers=key)
        assert before.status_code == 200 and before.json()["desired"]["generation"] == 2

        srv.kill()  # and back on the same database and port; Alertmanager keeps sending meanwhile
        srv = serve(tmp_path / "tg.db", ENV, port=srv.port)
        restarted = _sent(am_url)
        wait_until(lambda: _sent(am_url) >= restarted + 2, timeout=60, every=0.2)
        desired = op.get("/v1/runs/run-am/desired").json()
        assert (desired["generation"], desired["lr_scale"]) == (2, 0.5)  # no repeat acted after the restart
        again = op.post("/v1/runs/run-am/checkpoint", json={"reason": "keep"}, headers=key)
        assert again.status_code == 200 and again.json() == before.json()  # the stored answer, no new generation
        assert op.post("/v1/runs/run-am/checkpoint", json={"reason": "other"}, headers=key).status_code == 409
        assert op.get("/v1/runs/run-am/desired").json()["generation"] == 2

        # Another alert (its own fingerprint) acts: the factor multiplies the current scale.
        assert httpx.post(f"{am_url}/api/v2/alerts", json=[_alert("TeamGradNormSpike", starts)], timeout=5).status_code == 200
        desired = wait_until(lambda: (d := op.get("/v1/runs/run-am/desired").json())["generation"] == 3 and d, timeout=30, every=0.1)
        assert desired["lr_scale"] == 0.25
        events = [e for e in op.get("/v1/runs/run-am/events").json() if e["kind"] == "desired"]
        assert [e["generation"] for e in events] == [1, 2, 3]
        assert [events[0]["actor"], events[2]["actor"]] == ["alertmanager:TeamGradNormHigh", "alertmanager:TeamGradNormSpike"]
    finally:
        stop(am)

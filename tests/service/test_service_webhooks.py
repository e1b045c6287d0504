"""Webhooks out against a real local HTTP receiver: signature, retries on 5xx, none on 4xx.
Signatures are checked by code that does not share the controller's: rebuilt here from the
README's recipe, and by the demo webhook sink (what a user copies)."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import threading

from trainguard.demo.webhook_sink import make_server
from tests.service.conftest import register, wait_until

SECRET = "s3cret-s3cret-s3cret"


def _documented_signature(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """The README's recipe: X-Trainguard-Signature = sha256=HMAC_SHA256(secret, "{X-Trainguard-Timestamp}." + body)."""
    mac = hmac.new(secret.encode(), headers["x-trainguard-timestamp"].encode() + b"." + body, hashlib.sha256)
    return hmac.compare_digest("sha256=" + mac.hexdigest(), headers["x-trainguard-signature"])


def _report(values):
    return {"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0, "values": values}


def test_500_then_200_is_retried_signed_and_recorded(app_factory, receiver_factory):
    rx = receiver_factory([500, 200])
    with app_factory(webhook_backoff_s=0.05) as c:
        hook = c.post("/v1/webhooks", json={"url": rx.url, "secret": SECRET, "min_severity": "warning"})
        assert hook.status_code == 201 and hook.json()["secret"] == SECRET
        assert "secret" not in c.get("/v1/webhooks").json()[0]
        register(c)
        c.post("/v1/runs/run-1/reports", json=_report({"trainguard_grad_norm_max": 4321.0}))
        wait_until(lambda: len(rx.requests) >= 2)
        deliveries = wait_until(lambda: (d := c.get(f"/v1/webhooks/{hook.json()['id']}/deliveries").json()) and len(d) == 2 and d)
        assert [d["outcome"] for d in deliveries] == ["delivered", "retry"]
        assert [d["status_code"] for d in deliveries] == [200, 500]
        assert [d["attempt"] for d in deliveries] == [2, 1]
    first, second = rx.requests
    assert first[1] == second[1]  # the same message, sent again
    headers, body = second
    assert _documented_signature(SECRET, headers, body)
    assert not _documented_signature("another-secret-xxxxx", headers, body)
    assert headers["x-trainguard-delivery"] == first[0]["x-trainguard-delivery"]  # the same on a retry
    payload = json.loads(body)
    assert payload["version"] == "4" and payload["status"] == "firing"
    (alert,) = payload["alerts"]
    assert alert["labels"] | {"trainguard_rule": "grad_norm_high"} == {
        "alertname": "grad_norm_high", "job": "job-a", "run": "run-1", "severity": "warning", "trainguard_rule": "grad_norm_high"}
    assert json.loads(alert["annotations"]["values"])["value"] == 4321.0
    assert "Lower the learning rate" in alert["annotations"]["suggested_actions"]
    assert alert["endsAt"] == "0001-01-01T00:00:00Z"


def test_4xx_is_not_retried_and_slack_format(app_factory, receiver_factory):
    rx = receiver_factory([400])
    with app_factory(webhook_backoff_s=0.05) as c:
        hook = c.post("/v1/webhooks", json={"url": rx.url, "format": "slack", "min_severity": "info"}).json()
        register(c)
        c.post("/v1/runs/run-1/reports", json=_report({"trainguard_loss": "Infinity"}))
        deliveries = wait_until(lambda: c.get(f"/v1/webhooks/{hook['id']}/deliveries").json())
        assert [(d["outcome"], d["status_code"]) for d in deliveries] == [("failed", 400)]
        metrics = c.get("/metrics").text
        assert 'trainguard_controller_webhook_failures_total{reason="4xx"} 1.0' in metrics
    assert len(rx.requests) == 1
    text = json.loads(rx.requests[0][1])["text"]
    assert "loss_nonfinite" in text and "run-1" in text and "pause" in text


def test_min_severity_and_delete(app_factory, receiver_factory):
    rx = receiver_factory([200])
    with app_factory() as c:
        hook = c.post("/v1/webhooks", json={"url": rx.url, "min_severity": "critical"}).json()
        register(c)
        c.post("/v1/runs/run-1/reports", json=_report({"trainguard_grad_norm_max": 5000.0}))  # warning: not sent
        c.post("/v1/runs/run-1/reports", json=_report({"trainguard_loss": "NaN"}))  # critical: sent
        wait_until(lambda: rx.requests)
        assert json.loads(rx.requests[0][1])["alerts"][0]["labels"]["alertname"] == "loss_nonfinite"
        assert c.delete(f"/v1/webhooks/{hook['id']}").status_code == 204
        assert c.delete(f"/v1/webhooks/{hook['id']}").status_code == 404
        assert c.get("/v1/webhooks").json() == []
    assert len(rx.requests) == 1


def test_the_demo_sink_takes_what_the_controller_signs_and_refuses_another_secret(app_factory):
    sinks = []
    for secret in (SECRET, "not-the-webhook-secret"):
        server = make_server("127.0.0.1", 0, secret=secret, log=io.StringIO())
        threading.Thread(target=server.serve_forever, daemon=True).start()
        sinks.append(server)
    try:
        with app_factory(webhook_backoff_s=0.05) as c:
            hooks = [c.post("/v1/webhooks", json={"url": f"http://127.0.0.1:{s.server_address[1]}/controller",
                                                  "secret": SECRET, "min_severity": "info"}).json() for s in sinks]
            register(c)
            c.post("/v1/runs/run-1/reports", json=_report({"trainguard_loss": "NaN"}))
            good, bad = (wait_until(lambda h=h: c.get(f"/v1/webhooks/{h['id']}/deliveries").json()) for h in hooks)
        assert [(d["outcome"], d["status_code"]) for d in good] == [("delivered", 204)]
        assert [(d["outcome"], d["status_code"]) for d in bad] == [("failed", 401)]  # a 4xx: not retried
        (item,) = sinks[0].inbox.newest_first()
        assert item["signed"] and item["payload"]["alerts"][0]["labels"]["alertname"] == "loss_nonfinite"
        assert sinks[1].inbox.received == 0
    finally:
        for s in sinks:
            s.shutdown()
            s.server_close()

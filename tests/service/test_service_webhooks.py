"""Webhooks out against a real local HTTP receiver: signature, retries on 5xx, none on 4xx, and the
incidents of the automatic recovery (opened, a rung, recovered or escalated) next to the alerts.
Signatures are checked by code that does not share the controller's: rebuilt here from the
README's recipe, and by the demo webhook sink (what a user copies)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import io
import json
import threading
import time
from datetime import datetime, timezone

from prometheus_client import CollectorRegistry

from trainguard.demo.webhook_sink import make_server
from trainguard.service import statements as sql
from trainguard.service.metrics import ControllerMetrics
from trainguard.service.rules import default_rules_text
from trainguard.service.store import Store
from trainguard.service.webhooks import WebhookDeliverer
from tests.service.conftest import LADDER_STEPS, climb_ladder, register, wait_until

SECRET = "s3cret-s3cret-s3cret"


def _documented_signature(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """The README's recipe: X-Trainguard-Signature = sha256=HMAC_SHA256(secret, "{X-Trainguard-Timestamp}." + body)."""
    mac = hmac.new(secret.encode(), headers["x-trainguard-timestamp"].encode() + b"." + body, hashlib.sha256)
    return hmac.compare_digest("sha256=" + mac.hexdigest(), headers["x-trainguard-signature"])


def _report(values, step=1):
    return {"job": "job-a", "step_first": step, "step_last": step, "time": 1.0, "values": values}


def _grad_norm_rises_to(c, value: float) -> None:
    """A healthy report, then the gradient norm above 1e3: grad_norm_high fires (it acts on a rise)."""
    assert c.post("/v1/runs/run-1/reports", json=_report({"trainguard_grad_norm_max": 1.0})).json()["alerts"] == []
    c.post("/v1/runs/run-1/reports", json=_report({"trainguard_grad_norm_max": value}, step=2))


def _notify_only(c) -> None:
    """The default rules with the gradient rules only notifying: their alert changes nothing, opens
    no incident, and is the one message a webhook gets."""
    text = default_rules_text()
    assert "actions: [adaptive_lr, notify]" in text
    assert c.put("/v1/rules", content=text.replace("actions: [adaptive_lr, notify]", "actions: [notify]")).status_code == 200


def test_500_then_200_is_retried_signed_and_recorded(app_factory, receiver_factory):
    rx = receiver_factory([500, 200])
    with app_factory(webhook_backoff_s=0.05) as c:
        _notify_only(c)
        hook = c.post("/v1/webhooks", json={"url": rx.url, "secret": SECRET, "min_severity": "warning"})
        assert hook.status_code == 201 and hook.json()["secret"] == SECRET
        assert "secret" not in c.get("/v1/webhooks").json()[0]
        register(c)
        _grad_norm_rises_to(c, 4321.0)
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
        # the alert, and its incident: the refused rollback (no snapshot) paused the run
        deliveries = wait_until(lambda: len(d := c.get(f"/v1/webhooks/{hook['id']}/deliveries").json()) == 2 and d)
        assert [(d["outcome"], d["status_code"]) for d in deliveries] == [("failed", 400)] * 2
        metrics = c.get("/metrics").text
        assert 'trainguard_controller_webhook_failures_total{reason="4xx"} 2.0' in metrics
        (inc,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
    assert len(rx.requests) == 2
    alert, incident = sorted((json.loads(body)["text"] for _, body in rx.requests), key=lambda t: " incident " in t)
    assert "loss_nonfinite" in alert and "run-1" in alert and "pause" in alert
    assert incident.startswith(f":rotating_light: incident {inc['id']} on run run-1 (job job-a): escalated to a human")
    assert "• step 1: pause by rule:loss_nonfinite: " in incident and "rollback refused" in incident
    assert incident.endswith("\n/ui/runs/run-1")


def test_min_severity_and_delete(app_factory, receiver_factory):
    rx = receiver_factory([200])
    with app_factory() as c:
        hook = c.post("/v1/webhooks", json={"url": rx.url, "min_severity": "critical"}).json()
        register(c)
        # a warning alert, and the incident its LR action opens: neither is sent
        _grad_norm_rises_to(c, 5000.0)
        c.post("/v1/runs/run-1/reports", json=_report({"trainguard_loss": "NaN"}, step=3))  # critical: sent
        wait_until(lambda: len(rx.requests) == 2)  # the alert, and the incident escalated by its pause
        assert c.delete(f"/v1/webhooks/{hook['id']}").status_code == 204
        assert c.delete(f"/v1/webhooks/{hook['id']}").status_code == 404
        assert c.get("/v1/webhooks").json() == []
    assert len(rx.requests) == 2
    payloads = sorted((json.loads(body) for _, body in rx.requests), key=lambda p: p.get("kind", ""))
    assert [p.get("kind") for p in payloads] == [None, "incident"]
    assert payloads[0]["alerts"][0]["labels"]["alertname"] == "loss_nonfinite"
    assert payloads[1]["update"] == "escalated" and payloads[1]["alerts"][0]["labels"]["severity"] == "critical"


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
            # the alert and its incident (escalated: the refused rollback paused the run), to each
            good, bad = (wait_until(lambda h=h: len(d := c.get(f"/v1/webhooks/{h['id']}/deliveries").json()) == 2 and d)
                         for h in hooks)
        assert [(d["outcome"], d["status_code"]) for d in good] == [("delivered", 204)] * 2
        assert [(d["outcome"], d["status_code"]) for d in bad] == [("failed", 401)] * 2  # a 4xx: not retried
        items = sinks[0].inbox.newest_first()
        assert all(item["signed"] for item in items)
        assert sorted(item["payload"]["alerts"][0]["labels"]["alertname"] for item in items) == ["incident", "loss_nonfinite"]
        assert sinks[1].inbox.received == 0
    finally:
        for s in sinks:
            s.shutdown()
            s.server_close()


def _iso(t: float | None) -> str:
    """RFC 3339 as Alertmanager writes it (zero time for none), rebuilt here."""
    if t is None:
        return "0001-01-01T00:00:00Z"
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(t * 1000) % 1000:03d}Z"


def _received(rx) -> list[dict]:
    """The payloads a receiver got, each signature checked, oldest message first (by delivery id:
    the outbox row, in the order the controller wrote them; delivery itself is concurrent)."""
    assert all(_documented_signature(SECRET, headers, body) for headers, body in rx.requests)
    ordered = sorted(rx.requests, key=lambda r: int(r[0]["x-trainguard-delivery"]))
    return [json.loads(body) for _, body in ordered]


def _pending_zero(c) -> bool:
    return "trainguard_controller_webhook_outbox_pending 0.0" in c.get("/metrics").text


def test_an_incident_is_sent_when_it_opens_and_when_it_recovers_to_the_webhooks_that_want_it(app_factory, receiver_factory):
    loud, quiet, pager = receiver_factory([200]), receiver_factory([200]), receiver_factory([200])
    with app_factory(external_url="http://tg.internal:8000/", webhook_timeout_s=60.0) as c:
        for rx, severity, resolved in ((loud, "warning", True), (quiet, "info", False), (pager, "critical", True)):
            assert c.post("/v1/webhooks", json={"url": rx.url, "secret": SECRET, "min_severity": severity,
                                                "send_resolved": resolved}).status_code == 201
        register(c)
        _grad_norm_rises_to(c, 3000.0)  # adaptive LR: opened
        for step in range(3, 8):  # 5 healthy reports close it: recovered
            body = {"job": "job-a", "step_first": step, "step_last": step, "time": 1.0, "values": {"trainguard_grad_norm_max": 1.0}}
            assert c.post("/v1/runs/run-1/reports", json=body).status_code == 200
        (incident,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
        assert (incident["outcome"], incident["closed_step"]) == ("recovered", 7)
        wait_until(lambda: len(loud.requests) == 4 and len(quiet.requests) == 2 and _pending_zero(c))
    assert pager.requests == []  # critical only: an incident that recovered never concerned it
    # warning + send_resolved: the alert fired and resolved, the incident opened and recovered
    alert, opened, resolved, recovered = _received(loud)
    assert (alert["status"], alert.get("kind"), resolved["status"], resolved.get("kind")) == ("firing", None, "resolved", None)
    assert (opened["kind"], opened["update"], recovered["kind"], recovered["update"]) == ("incident", "opened", "incident", "recovered")
    assert recovered["incident"] == incident  # as the API lists it
    assert opened["incident"] == incident | {"outcome": "open", "closed_step": None, "closed_time": None}
    assert [r["rung"] for r in incident["rungs"]] == ["adaptive_lr"] and incident["trigger"] == "rule:grad_norm_high"
    for msg, status, severity in ((opened, "firing", "warning"), (recovered, "resolved", "warning")):
        assert (msg["run"], msg["job"], msg["link"]) == ("run-1", "job-a", "http://tg.internal:8000/ui/runs/run-1")
        (am,) = msg["alerts"]
        assert msg["status"] == am["status"] == status
        assert am["labels"] == {"alertname": "incident", "job": "job-a", "run": "run-1", "severity": severity,
                                "incident": str(incident["id"]), "cause": incident["cause"]}
        assert am["startsAt"] == _iso(incident["onset_time"])
        assert am["generatorURL"] == "http://tg.internal:8000/v1/runs/run-1/incidents"
    assert opened["alerts"][0]["endsAt"] == _iso(None) and recovered["alerts"][0]["endsAt"] == _iso(incident["closed_time"])
    assert opened["alerts"][0]["fingerprint"] == recovered["alerts"][0]["fingerprint"]  # one incident, one alert
    assert "recovered without a human" in recovered["alerts"][0]["annotations"]["summary"]
    # info without send_resolved: the openings only
    assert [(m.get("kind"), m["status"]) for m in _received(quiet)] == [(None, "firing"), ("incident", "firing")]


def test_an_incident_climbing_the_ladder_is_sent_at_each_rung_and_pages_critical_webhooks_once(app_factory, receiver_factory):
    watch, pager = receiver_factory([200]), receiver_factory([200])
    # A receiver slowed by a busy machine must not turn one delivery into a timeout and a retry.
    with app_factory(webhook_timeout_s=60.0) as c:
        for rx, severity in ((watch, "warning"), (pager, "critical")):
            c.post("/v1/webhooks", json={"url": rx.url, "secret": SECRET, "min_severity": severity})
        register(c)
        climb_ladder(c)
        (incident,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
        wait_until(lambda: len(watch.requests) >= 4 and len(pager.requests) >= 1 and _pending_zero(c), timeout=120.0)
    assert [(r["rung"], r["step"]) for r in incident["rungs"]] == list(LADDER_STEPS.items())
    assert (incident["outcome"], incident["closed_step"]) == ("escalated", LADDER_STEPS["pause"])
    watched = _received(watch)
    assert [m.get("kind") for m in watched] == [None, "incident", "incident", "incident"]  # the alert, then the incident
    assert [m["update"] for m in watched[1:]] == ["opened", "rung", "escalated"]
    assert [[r["rung"] for r in m["incident"]["rungs"]] for m in watched[1:]] == [["adaptive_lr"], ["adaptive_lr", "rollback"],
                                                                                  ["adaptive_lr", "rollback", "pause"]]
    assert [m["alerts"][0]["labels"]["severity"] for m in watched[1:]] == ["warning", "warning", "critical"]
    assert watched[-1]["incident"] == incident and watched[-1]["link"] == "/ui/runs/run-1"  # no external URL: a path
    (paged,) = _received(pager)
    assert paged == watched[-1]  # the same message: escalated to a human
    assert "escalated to a human (the run is paused)" in paged["alerts"][0]["annotations"]["summary"]
    description = paged["alerts"][0]["annotations"]["description"]  # one line per rung
    assert [line.split(": ")[:2] for line in description.splitlines()] == [
        [f"step {LADDER_STEPS['adaptive_lr']}", "adaptive_lr by rule:grad_norm_high"],
        [f"step {LADDER_STEPS['rollback']}", "rollback by recovery:ladder"],
        [f"step {LADDER_STEPS['pause']}", "pause by recovery:ladder"]]


def test_rows_committed_while_the_worker_reads_are_sent_at_once_and_counted_once(tmp_path, receiver_factory):
    """The interleaving a busy machine makes likely, made certain: the worker finds no due row, and
    while its next read runs in a thread, a transaction commits a row and wakes it. That wake must
    not be lost (the row would wait for the worker's one-minute idle timer: the flake of the
    incident test above under load), and the row must be counted once in the pending gauge."""
    rx = receiver_factory([200])
    store = Store(tmp_path / "tg.db")
    hook = store.write_now(lambda c: sql.insert_webhook(c, url=rx.url, format="alertmanager", secret=SECRET,
                                                        min_severity="info", send_resolved=True, now=time.time()))

    async def scenario() -> tuple[int, list[int]]:
        store.start()
        deliverer = WebhookDeliverer(store, ControllerMetrics(CollectorRegistry(), lambda: None), clock=time.time,
                                     timeout_s=30.0, max_attempts=3, backoff_s=0.05, backoff_max_s=1.0)
        real_read, seen = store.read, {"no_due_rows": False, "committed": False}
        pending_seen = []

        async def read(op):
            result = await real_read(op)  # this read's snapshot predates the commit below
            if seen["no_due_rows"] and not seen["committed"]:
                seen["committed"] = True
                await store.submit(lambda c: sql.insert_outbox(c, webhook_id=hook, alert_id=None, body=b"{}", now=time.time()))
                deliverer.wake(1)  # as the controller does after its commit
                pending_seen.append(deliverer.pending)
            seen["no_due_rows"] = result == []
            return result

        store.read = read  # type: ignore[method-assign]
        task = asyncio.create_task(deliverer.run())
        try:
            # far below the worker's one-minute idle timer, far above one local delivery
            deadline = time.monotonic() + 20.0
            while not (len(rx.requests) == 1 and deliverer.pending == 0) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return deliverer.pending, pending_seen

    try:
        pending, pending_seen = asyncio.run(scenario())
        assert store.read_now(sql.pending_outbox_count) == 0
    finally:
        store.close()
    assert len(rx.requests) == 1 and rx.requests[0][1] == b"{}"
    assert pending_seen == [1] and pending == 0


def test_at_most_100_webhooks_are_subscribed_and_a_deleted_one_frees_its_place(app_factory):
    with app_factory() as c:
        made = [c.post("/v1/webhooks", json={"url": f"http://127.0.0.1:9/hook-{i}"}) for i in range(100)]
        assert {r.status_code for r in made} == {201}
        r = c.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/hook-100"})
        assert r.status_code == 429
        assert r.json()["detail"] == "100 webhooks are subscribed, the limit: delete one (DELETE /v1/webhooks/{id}) first"
        assert len(c.get("/v1/webhooks").json()) == 100
        assert c.delete(f"/v1/webhooks/{made[0].json()['id']}").status_code == 204
        assert c.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/hook-100"}).status_code == 201


def test_a_message_in_flight_when_its_webhook_is_deleted_is_not_sent_again(app_factory, receiver_factory):
    """The first attempt is on its way when the webhook is deleted; the connection then drops (an
    attempt to retry): the message stays cancelled, as the deletion left it."""
    rx = receiver_factory([0, 200])
    with app_factory(webhook_backoff_s=0.05) as c:
        _notify_only(c)
        hook = c.post("/v1/webhooks", json={"url": rx.url, "min_severity": "warning"}).json()
        register(c)
        _grad_norm_rises_to(c, 4321.0)
        wait_until(lambda: len(rx.requests) == 1)
        assert c.delete(f"/v1/webhooks/{hook['id']}").status_code == 204
        rx.release.set()
        # (404 until the attempt is recorded: a deleted webhook without one is one that does not exist)
        (attempt,) = wait_until(lambda: (r := c.get(f"/v1/webhooks/{hook['id']}/deliveries")).status_code == 200 and r.json())
        assert attempt["outcome"] == "retry"
        store = c.app.state.controller.store
        assert store.read_now(lambda conn: [tuple(r) for r in conn.execute("SELECT state FROM outbox")]) == [("cancelled",)]


def test_a_url_password_is_used_to_deliver_and_never_listed(app_factory, receiver_factory):
    import base64

    rx = receiver_factory([200])
    url = rx.url.replace("://", "://alice:s3cret-pw@", 1)
    with app_factory() as c:
        _notify_only(c)
        hook = c.post("/v1/webhooks", json={"url": url, "secret": SECRET, "min_severity": "warning"})
        assert hook.status_code == 201, hook.text
        listed = c.get("/v1/webhooks")
        assert [w["url"] for w in listed.json()] == [rx.url.replace("://", "://alice:***@", 1)]
        assert "s3cret-pw" not in listed.text
        register(c)
        _grad_norm_rises_to(c, 4321.0)
        wait_until(lambda: rx.requests)
    headers, _ = rx.requests[0]
    assert headers["authorization"] == "Basic " + base64.b64encode(b"alice:s3cret-pw").decode()

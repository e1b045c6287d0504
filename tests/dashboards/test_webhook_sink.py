"""The webhook sink: receives Alertmanager payloads over real HTTP on loopback, logs one line per
alert, shows them, refuses bad bodies, and can play a failing receiver."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from trainguard.demo.webhook_sink import Inbox, alert_lines, make_server

PAYLOAD = {
    "version": "4", "status": "firing", "receiver": "webhook-sink", "groupKey": "{}:{}",
    "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am",
    "alerts": [
        {"status": "firing", "labels": {"alertname": "TrainguardLossNonFinite", "run": "r1",
                                        "severity": "critical", "trainguard_action": "pause"},
         "annotations": {"summary": "Loss is NaN <b>"}, "startsAt": "2026-01-01T00:00:00Z",
         "endsAt": "0001-01-01T00:00:00Z", "fingerprint": "abc"},
        {"status": "resolved", "labels": {"alertname": "TrainguardStraggler", "run": "r2"},
         "annotations": {}, "fingerprint": "def"},
    ],
}


@pytest.fixture
def sink(request):
    status = getattr(request, "param", 204)
    log = io.StringIO()
    server = make_server("127.0.0.1", 0, keep=2, status=status, log=log)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}", log
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.read().decode()


def test_receives_logs_and_shows_alerts(sink):
    server, url, log = sink
    assert _post(url + "/alerts", json.dumps(PAYLOAD).encode()) == 204
    lines = log.getvalue().splitlines()
    assert lines == [
        "[webhook-sink] /alerts FIRING TrainguardLossNonFinite run=r1 severity=critical action=pause | Loss is NaN <b>",
        "[webhook-sink] /alerts RESOLVED TrainguardStraggler run=r2 severity=- action=- | ",
    ]
    status, body = _get(url + "/alerts.json")
    items = json.loads(body)
    assert status == 200 and len(items) == 1 and items[0]["payload"] == PAYLOAD and items[0]["path"] == "/alerts"
    status, page = _get(url + "/")
    assert "TrainguardLossNonFinite" in page
    assert "Loss is NaN &lt;b&gt;" in page and "NaN <b>" not in page  # alert text is escaped
    assert _get(url + "/healthz") == (200, "ok\n")


def test_keeps_only_the_newest_payloads(sink):
    server, url, _ = sink
    for i in range(3):
        assert _post(url + f"/p{i}", json.dumps({"n": i}).encode()) == 204
    items = json.loads(_get(url + "/alerts.json")[1])
    assert [item["payload"]["n"] for item in items] == [2, 1]
    assert server.inbox.received == 3


def test_bad_bodies_are_refused(sink):
    _, url, log = sink
    assert _post(url + "/alerts", b"{not json") == 400
    assert _post(url + "/alerts", b"\xff\xfe") == 400
    assert log.getvalue() == ""
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(url + "/nope")
    assert err.value.code == 404


@pytest.mark.parametrize("sink", [500], indirect=True)
def test_failing_mode_answers_the_configured_status(sink):
    server, url, _ = sink
    assert _post(url + "/alerts", json.dumps(PAYLOAD).encode()) == 500
    assert server.inbox.received == 1


def test_arguments_and_non_alertmanager_payloads():
    with pytest.raises(ValueError, match="keep"):
        Inbox(0)
    with pytest.raises(ValueError, match="status"):
        make_server("127.0.0.1", 0, status=99)
    assert alert_lines([1, 2]) == ["payload: [1, 2]"]


SECRET = "sink-secret-0123456789"


def _signed_post(url: str, body: bytes, *, secret: str = SECRET, ts: int | None = None,
                 signature: str | None = None) -> int:
    """POST signed as the README documents: sha256=HMAC_SHA256(secret, "{timestamp}." + body)."""
    ts = int(time.time()) if ts is None else ts
    sig = signature or "sha256=" + hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "X-Trainguard-Timestamp": str(ts), "X-Trainguard-Signature": sig})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture
def signed_sink():
    log = io.StringIO()
    server = make_server("127.0.0.1", 0, secret=SECRET, log=log)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}", log
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def test_signed_sink_takes_only_deliveries_signed_with_its_secret(signed_sink):
    server, url, log = signed_sink
    body = json.dumps(PAYLOAD).encode()
    assert _signed_post(url + "/controller", body) == 204
    assert _signed_post(url + "/controller", body, secret="another-secret-xxxxxx") == 401
    assert _signed_post(url + "/controller", body + b" ") == 204  # whitespace is part of what is signed
    tampered = json.dumps({**PAYLOAD, "status": "resolved"}).encode()
    ts = int(time.time())
    sig = "sha256=" + hmac.new(SECRET.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()
    assert _signed_post(url + "/controller", tampered, ts=ts, signature=sig) == 401  # the body changed
    assert _signed_post(url + "/controller", body, ts=int(time.time()) - 3600) == 401  # a replay an hour later
    assert _signed_post(url + "/controller", body, signature="sha256=") == 401
    assert _post(url + "/controller", body) == 401  # no signature at all
    assert _post(url + "/alerts", body) == 204  # Alertmanager's path: Alertmanager does not sign
    items = server.inbox.newest_first()
    assert [(i["path"], i["signed"]) for i in items] == [("/alerts", False), ("/controller", True), ("/controller", True)]
    assert server.inbox.received == 3
    refused = [line for line in log.getvalue().splitlines() if "refused" in line]
    assert len(refused) == 5 and "signature does not match" in refused[0] and "missing" in refused[-1]
    assert any("away from now" in line for line in refused)


def test_signed_sink_arguments():
    with pytest.raises(ValueError, match="secret"):
        make_server("127.0.0.1", 0, secret="")
    with pytest.raises(ValueError, match="max_age_s"):
        make_server("127.0.0.1", 0, secret=SECRET, max_age_s=0)

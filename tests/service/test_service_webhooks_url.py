"""A webhook URL httpx cannot parse, or whose host or port is none (a port beyond 65535, a space
in the host, a label over 63 characters), is refused at creation (422) and, if one is already
stored, fails its own delivery without ending delivery for every other webhook."""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Callable

import pytest

from tests.service.conftest import register, wait_until


@pytest.mark.parametrize("url", ["http://host:abc/hook", "http://[::1/hook", "http://exa\x00mple/hook", "http:///hook",
                                 "http://host:99999/hook", "http://host:-1/hook", "http://[::1]:0/hook", "http://exa mple.com/hook",
                                 "http://" + "a" * 64 + ".example.com/hook"])
def test_unparseable_webhook_url_is_422(app_factory: Callable[..., Any], url: str) -> None:
    with app_factory() as c:
        r = c.post("/v1/webhooks", json={"url": url})
        assert r.status_code == 422, r.text
        assert c.get("/v1/webhooks").json() == []


@pytest.mark.parametrize("url", ["http://127.0.0.1:65535/hook", "http://[::1]:1/hook", "https://hooks.example.com/services/T0/B0",
                                 "http://bücher.example/hook", "http://sink_1.local/hook"])
def test_urls_of_real_hosts_and_ports_are_taken(app_factory: Callable[..., Any], url: str) -> None:
    with app_factory() as c:
        r = c.post("/v1/webhooks", json={"url": url})
        assert r.status_code == 201, r.text
        assert [w["url"] for w in c.get("/v1/webhooks").json()] == [url]


def test_a_stored_bad_url_does_not_stop_delivery_to_other_webhooks(app_factory: Callable[..., Any], receiver_factory: Any, tmp_path: Any) -> None:
    rx = receiver_factory([200])
    with app_factory(webhook_backoff_s=0.05) as c:
        bad = c.post("/v1/webhooks", json={"url": "http://placeholder.invalid/hook"}).json()["id"]
        good = c.post("/v1/webhooks", json={"url": rx.url}).json()["id"]
        # A row from before URLs were checked (or edited in the database): httpx cannot parse it.
        db = sqlite3.connect(tmp_path / "tg.db")
        with db:
            db.execute("UPDATE webhooks SET url=? WHERE id=?", ("http://host:abc/hook", bad))
        db.close()
        register(c)
        # (notify-only rules: one message per alert, no incident)
        report = {"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0, "values": {"trainguard_data_duplicate_ratio": 0.5}}
        assert c.post("/v1/runs/run-1/reports", json=report).status_code == 200
        bad_rows = wait_until(lambda: c.get(f"/v1/webhooks/{bad}/deliveries").json())
        assert [(d["outcome"], d["status_code"]) for d in bad_rows] == [("failed", None)]
        assert "invalid URL" in bad_rows[0]["error"]
        good_rows = wait_until(lambda: c.get(f"/v1/webhooks/{good}/deliveries").json())
        assert [(d["outcome"], d["status_code"]) for d in good_rows] == [("delivered", 200)]
        # The worker is still alive: a later alert (another rule) is delivered too.
        report2 = report | {"step_first": 2, "step_last": 2, "values": {"trainguard_data_token_kl_divergence": 0.5}}
        assert c.post("/v1/runs/run-1/reports", json=report2).status_code == 200
        wait_until(lambda: len(c.get(f"/v1/webhooks/{good}/deliveries").json()) == 2)
    rules = [json.loads(body)["alerts"][0]["labels"]["alertname"] for _, body in rx.requests]
    assert rules == ["data_duplicate_ratio", "data_token_kl"]

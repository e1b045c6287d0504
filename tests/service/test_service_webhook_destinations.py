"""Webhooks are never sent to link-local addresses (the cloud metadata services at
169.254.169.254), the metadata services' other addresses, the unspecified address, multicast or
broadcast, however the address is spelled: such a URL is refused at creation (422), and a stored
one, or a host name that resolves there, fails its delivery without a connection and is not
retried. Loopback and private receivers are still served."""

from __future__ import annotations

import socket
import sqlite3
from typing import Any, Callable

import pytest

from tests.service.conftest import register, wait_until

_REPORT = {"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0, "values": {"trainguard_data_duplicate_ratio": 0.5}}


@pytest.mark.parametrize("host", ["169.254.169.254", "169.254.0.1", "[fe80::1]", "[::ffff:169.254.169.254]",
                                  "[64:ff9b::a9fe:a9fe]", "[2002:a9fe:a9fe::1]", "2852039166", "0xa9fea9fe",
                                  "169.254.43518", "0.0.0.0", "[::]", "[fd00:ec2::254]", "100.100.100.200", "224.0.0.1",
                                  "255.255.255.255"])
def test_a_webhook_to_a_refused_address_is_422(app_factory: Callable[..., Any], host: str) -> None:
    with app_factory() as c:
        r = c.post("/v1/webhooks", json={"url": f"http://{host}/latest/meta-data/"})
        assert r.status_code == 422, r.text
        assert "webhooks are never sent there" in r.json()["detail"]
        assert c.get("/v1/webhooks").json() == []


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "192.168.0.10", "172.16.0.1", "[::1]", "[fd12::1]",
                                  "alerts.example.com"])
def test_loopback_private_and_named_receivers_are_taken(app_factory: Callable[..., Any], host: str) -> None:
    with app_factory() as c:
        assert c.post("/v1/webhooks", json={"url": f"http://{host}:9000/hook"}).status_code == 201


def _deliveries(c: Any, hook: int) -> list[tuple[str, Any, str]]:
    return [(d["outcome"], d["status_code"], d["error"]) for d in c.get(f"/v1/webhooks/{hook}/deliveries").json()]


def test_a_stored_url_of_a_refused_address_fails_without_a_connection(app_factory: Callable[..., Any], receiver_factory: Any,
                                                                       tmp_path: Any) -> None:
    rx = receiver_factory([200])
    with app_factory(webhook_backoff_s=0.05) as c:
        hook = c.post("/v1/webhooks", json={"url": rx.url}).json()["id"]
        db = sqlite3.connect(tmp_path / "tg.db")  # a row from before addresses were checked
        with db:
            db.execute("UPDATE webhooks SET url=? WHERE id=?", (rx.url.replace("127.0.0.1", "[::ffff:169.254.169.254]"), hook))
        db.close()
        register(c)
        assert c.post("/v1/runs/run-1/reports", json=_REPORT).status_code == 200
        rows = wait_until(lambda: _deliveries(c, hook))
    assert rows == [("failed", None, "destination refused (not retried): ::ffff:169.254.169.254 is a link-local "
                                       "address (where cloud metadata services answer)")]
    assert rx.requests == []


def test_a_host_name_resolving_to_a_metadata_address_fails_its_delivery(app_factory: Callable[..., Any], monkeypatch: Any) -> None:
    real = socket.getaddrinfo

    def resolve(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "metadata.attacker.example":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("169.254.169.254", 80))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with app_factory(webhook_backoff_s=0.05) as c:
        hook = c.post("/v1/webhooks", json={"url": "http://metadata.attacker.example/latest/meta-data/"}).json()["id"]
        register(c)
        assert c.post("/v1/runs/run-1/reports", json=_REPORT).status_code == 200
        rows = wait_until(lambda: _deliveries(c, hook))
    assert rows == [("failed", None, "destination refused (not retried): metadata.attacker.example resolves to "
                                     "169.254.169.254, a link-local address (where cloud metadata services answer)")]


def test_a_delivery_connects_to_the_address_it_judged_though_the_name_then_resolves_elsewhere(
        app_factory: Callable[..., Any], receiver_factory: Any, monkeypatch: Any) -> None:
    rx = receiver_factory([200])
    port = int(rx.url.split(":")[2].split("/")[0])
    real, asked = socket.getaddrinfo, []

    def rebinding(host: Any, *args: Any, **kwargs: Any) -> Any:  # the receiver once, then the metadata service
        if host != "rebind.attacker.example":
            return real(host, *args, **kwargs)
        asked.append(host)
        address = "127.0.0.1" if len(asked) == 1 else "169.254.169.254"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    with app_factory(webhook_backoff_s=0.05) as c:
        hook = c.post("/v1/webhooks", json={"url": f"http://rebind.attacker.example:{port}/hook"}).json()["id"]
        register(c)
        assert c.post("/v1/runs/run-1/reports", json=_REPORT).status_code == 200
        rows = wait_until(lambda: _deliveries(c, hook))
    assert rows == [("delivered", 200, None)]
    assert asked == ["rebind.attacker.example"]  # resolved once: the address judged is the one connected to
    ((headers, _),) = rx.requests
    assert headers["host"] == f"rebind.attacker.example:{port}"


def test_a_name_that_does_not_resolve_is_retried_without_a_connection(app_factory: Callable[..., Any], monkeypatch: Any) -> None:
    real, asked = socket.getaddrinfo, []

    def failing(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "flaky.attacker.example":
            return real(host, *args, **kwargs)
        asked.append(host)  # (a connection would resolve it again, and could get another answer)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", failing)
    with app_factory(webhook_backoff_s=0.05, webhook_max_attempts=2) as c:
        hook = c.post("/v1/webhooks", json={"url": "http://flaky.attacker.example/hook"}).json()["id"]
        register(c)
        assert c.post("/v1/runs/run-1/reports", json=_REPORT).status_code == 200
        rows = wait_until(lambda: len(_deliveries(c, hook)) == 2 and _deliveries(c, hook))
    error = "ConnectError: flaky.attacker.example does not resolve: [Errno -3] Temporary failure in name resolution"
    assert sorted(rows) == [("failed", None, error), ("retry", None, error)]
    assert asked == ["flaky.attacker.example"] * 2  # once per attempt, never by the connection


@pytest.mark.parametrize(("url", "pinned", "host", "extensions"), [
    ("https://alerts.example.com:8443/hook?k=1", "https://10.1.2.3:8443/hook?k=1", "alerts.example.com:8443",
     {"sni_hostname": "alerts.example.com"}),
    ("http://alerts.example.com/hook", "http://10.1.2.3/hook", "alerts.example.com", {}),
])
def test_the_destination_names_the_address_judged_and_keeps_the_host_for_http_and_tls(
        monkeypatch: Any, url: str, pinned: str, host: str, extensions: dict[str, str]) -> None:
    import asyncio

    from trainguard.service.webhook_destinations import checked_destination

    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", 0)),
                                                                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.4", 0))])
    to = asyncio.run(checked_destination(url))
    assert (to.refused, to.unresolved, to.url, to.headers["Host"], to.extensions) == (None, None, pinned, host, extensions)
    # a TLS connection made for one name is never reused for another name at the same address
    assert to.headers.get("Connection") == ("close" if url.startswith("https") else None)

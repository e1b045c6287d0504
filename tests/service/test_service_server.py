"""``trainguard serve`` as a process: connections that never finish their request are closed
while real reports get through, and a request head over the size limit gets 431; SIGTERM exits within its deadline with an idle event stream, a
long-poll and a half-sent body open; SIGHUP reloads the rules file and keeps the old rules when
the new file is invalid."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path

import httpx

from tests.service.conftest import wait_until
from trainguard.service.rules import default_rules_text

FAST = {"TRAINGUARD_HEADER_TIMEOUT_S": "1", "TRAINGUARD_BODY_TIMEOUT_S": "1", "TRAINGUARD_KEEPALIVE_TIMEOUT_S": "1",
        "TRAINGUARD_SHUTDOWN_TIMEOUT_S": "3"}
REG = {"job": "job-a", "run": "run-1", "world_size": 1, "ranks": []}


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails after 30 s)."""
    sock.settimeout(30)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_unfinished_requests_are_closed_and_reports_still_pass(tmp_path: Path, serve) -> None:
    srv = serve(tmp_path / "tg.db", env=FAST)
    addr = _addr(srv.url)
    socks = []
    for payload in (b"", b"GET /v1/ru", b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Le",
                    b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"job\""):
        s = socket.create_connection(addr)
        s.sendall(payload)
        socks.append(s)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/runs", json=REG).status_code == 200
        r = c.post("/v1/runs/run-1/reports", json={"job": "job-a", "step_first": 1, "step_last": 1, "time": 1.0, "values": {}})
        assert r.status_code == 200
    answers = [_closed(s) for s in socks]
    assert answers[:3] == [b"", b"", b""]
    assert answers[3].startswith(b"HTTP/1.1 408")
    # a slow trickle does not extend the head deadline
    s = socket.create_connection(addr)
    s.settimeout(30)
    closed = False
    for ch in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200:
        try:
            s.sendall(bytes([ch]))
            s.settimeout(0.05)
            if s.recv(1) == b"":
                closed = True
                break
        except socket.timeout:
            continue
        except OSError:
            closed = True
            break
    assert closed
    for sock in socks + [s]:
        sock.close()


def test_a_request_head_over_the_limit_gets_431_and_a_normal_one_still_passes(tmp_path: Path, serve) -> None:
    srv = serve(tmp_path / "tg.db", env=FAST | {"TRAINGUARD_HEADER_TIMEOUT_S": "60"})
    s = socket.create_connection(_addr(srv.url))
    # 64 KB of headers that never end: without the limit the server waits for the rest (until the
    # 60 s head deadline, then a silent close); with it the answer is 431 at once (or, when the
    # server closed with our unread bytes in its buffer, a reset)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 4000) for i in range(16)))
    try:
        answer = _closed(s)
    except ConnectionResetError:
        answer = b"reset"
    s.close()
    assert answer.startswith(b"HTTP/1.1 431") or answer == b"reset", answer[:100]
    with httpx.Client(base_url=srv.url, timeout=30) as c:  # 8 KB of headers are fine
        assert c.get("/healthz", headers={"X-Pad": "a" * 8000}).status_code == 200


def test_sigterm_exits_with_a_stream_a_long_poll_and_a_half_body_open(tmp_path: Path, serve) -> None:
    srv = serve(tmp_path / "tg.db", env=FAST | {"TRAINGUARD_BODY_TIMEOUT_S": "600", "TRAINGUARD_LONGPOLL_MAX_S": "600"})
    addr = _addr(srv.url)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/runs", json=REG).status_code == 200
    stream = socket.create_connection(addr)
    stream.sendall(b"GET /v1/events/stream HTTP/1.1\r\nHost: x\r\n\r\n")
    stream.settimeout(30)
    assert b"200 OK" in stream.recv(4096)
    poll = socket.create_connection(addr)
    poll.sendall(b"GET /v1/runs/run-1/desired?after=0&wait=600 HTTP/1.1\r\nHost: x\r\n\r\n")
    half = socket.create_connection(addr)
    half.sendall(b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    wait_until(lambda: httpx.get(srv.url + "/healthz").status_code == 200)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) in (0, -signal.SIGTERM)  # (uvicorn re-raises the signal once shut down)
    assert _closed(half).startswith(b"HTTP/1.1 503")
    assert b"200 OK" in _closed(poll)
    _closed(stream)
    for s in (stream, poll, half):
        s.close()


def test_sighup_reloads_the_rules_file_and_keeps_the_old_rules_when_it_is_invalid(tmp_path: Path, serve) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(default_rules_text())
    srv = serve(tmp_path / "tg.db", extra=["--rules", str(rules)])
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        first = c.get("/v1/rules").json()
        assert first["text"] == default_rules_text()
        rules.write_text("rules: []\n")
        srv.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: c.get("/v1/rules").json()["text"] == "rules: []\n")
        rules.write_text("rules: [{name: broken}]\n")  # invalid
        srv.proc.send_signal(signal.SIGHUP)
        rules.write_text("rules: []  # third\n")  # signals are handled in order: this one comes after
        srv.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: c.get("/v1/rules").json()["text"] == "rules: []  # third\n")
        assert srv.proc.poll() is None
        rules.write_text("rules: [{name: broken}]\n")
        srv.proc.send_signal(signal.SIGHUP)
        assert c.get("/v1/rules").json()["text"] in ("rules: []  # third\n",)
        assert c.get("/healthz").status_code == 200 and srv.proc.poll() is None
    assert json.loads(json.dumps(first))["version"] >= 1
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(30) in (0, -signal.SIGTERM)  # (uvicorn re-raises the signal once shut down)
    assert subprocess.call(["true"]) == 0

"""The audit events' stream (``service/events.py`` fanned out by ``GET /v1/events/stream``) against a
real ``trainguard serve`` process: every change of an incident reaches a subscriber live, as an
``incident`` event carrying the incident as the API lists it, and again on a replay."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import LADDER_STEPS, climb_ladder, wait_until

REG = {"job": "job-a", "run": "run-1", "world_size": 1, "agent_version": "test",
       "ranks": [{"rank": 0, "local_rank": 0, "host": "127.0.0.1", "port": 9100}]}


class _Subscriber:
    """Reads a Server-Sent Events stream in a thread, frame by frame: (id, event, data)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.frames: list[tuple[int, str, dict]] = []
        self.connected = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._args = (url, headers or {})
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        url, headers = self._args
        try:
            with httpx.stream("GET", url, headers=headers, timeout=httpx.Timeout(10.0, read=60.0)) as resp:
                assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                frame: dict[str, str] = {}
                for line in resp.iter_lines():
                    if line.startswith("retry:"):
                        self.connected.set()  # (sent once the stream has subscribed)
                    elif line == "" and "data" in frame:
                        self.frames.append((int(frame["id"]), frame["event"], json.loads(frame["data"])))
                        frame = {}
                    elif ": " in line and not line.startswith(":"):
                        key, value = line.split(": ", 1)
                        frame[key] = value
                    if self.stop.is_set():
                        return
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
            self.connected.set()

    def incidents(self) -> list[tuple[int, dict]]:
        return [(i, data) for i, event, data in list(self.frames) if event == "incident"]


def test_incident_events_reach_the_stream_live_and_on_a_replay(tmp_path: Path, serve) -> None:
    srv = serve(tmp_path / "tg.db")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/runs", json=REG).status_code == 200
        live = _Subscriber(f"{srv.url}/v1/events/stream?run=run-1")
        assert live.connected.wait(30) and live.error is None, live.error
        climb_ladder(c)
        wait_until(lambda: len(live.incidents()) == 3 or live.error)
        live.stop.set()
        assert live.error is None, live.error
        (incident,) = c.get("/v1/runs/run-1/incidents").json()["incidents"]
        events = [e for e in c.get("/v1/runs/run-1/events").json() if e["kind"] == "incident"]

        got = live.incidents()
        assert [i for i, _ in got] == [e["id"] for e in events]  # the audit log's events, in order
        assert [d["data"]["update"] for _, d in got] == ["opened", "rung", "escalated"]
        assert [[r["rung"] for r in d["data"]["incident"]["rungs"]] for _, d in got] == [
            ["adaptive_lr"], ["adaptive_lr", "rollback"], ["adaptive_lr", "rollback", "pause"]]
        assert got[-1][1]["data"]["incident"] == incident  # the incident as GET .../incidents lists it
        assert [r["step"] for r in incident["rungs"]] == list(LADDER_STEPS.values())
        for _, d in got:
            assert (d["kind"], d["run"], d["job"], d["actor"]) == ("incident", "run-1", "job-a", "recovery")
        assert [d["reason"] for _, d in got] == [f"incident {incident['id']}: opened (adaptive_lr)",
                                                 f"incident {incident['id']}: rung (rollback)",
                                                 f"incident {incident['id']}: escalated (pause)"]

        # a subscriber that reconnects after the first incident event gets the rest from the log
        replay = _Subscriber(f"{srv.url}/v1/events/stream?run=run-1", {"Last-Event-ID": str(got[0][0])})
        wait_until(lambda: len(replay.incidents()) == 2 or replay.error)
        replay.stop.set()
        assert replay.error is None and replay.incidents() == got[1:]


def _open_stream(address: tuple[str, int], token: str) -> tuple[socket.socket, bytes]:
    """A raw ``GET /v1/events/stream`` with ``token``: the socket and the start of the answer."""
    s = socket.create_connection(address)
    s.settimeout(30)
    s.sendall(f"GET /v1/events/stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
    answer = s.recv(4096)
    while b"\r\n\r\n" not in answer or (b"content-length" in answer and answer.endswith(b"\r\n\r\n")):
        answer += s.recv(4096)  # (the head, and a refusal's body, may come in several pieces)
    return s, answer


def test_a_token_holds_at_most_16_event_streams_and_a_closed_one_frees_its_place(tmp_path: Path, serve) -> None:
    first, second = "reader-token-0001", "reader-token-0002"
    srv = serve(tmp_path / "tg.db", env={"TRAINGUARD_OPERATOR_TOKENS": f"{first}:read,{second}:read"})
    address = ("127.0.0.1", srv.port)
    opened = [_open_stream(address, first) for _ in range(16)]
    try:
        assert all(head.startswith(b"HTTP/1.1 200") for _, head in opened)
        refused, head = _open_stream(address, first)
        refused.close()
        assert head.startswith(b"HTTP/1.1 429")
        assert b'"this token has 16 event streams open, its limit: close one first"' in head
        other, head = _open_stream(address, second)  # another token's streams are its own
        other.close()
        assert head.startswith(b"HTTP/1.1 200")
        opened.pop()[0].close()

        def reopened() -> bool:
            s, head = _open_stream(address, first)
            if head.startswith(b"HTTP/1.1 200"):
                opened.append((s, head))
                return True
            s.close()
            return False

        wait_until(reopened)
    finally:
        for s, _ in opened:
            s.close()


def test_event_streams_are_bounded_in_all_and_released_once() -> None:
    from trainguard.service.errors import TooMany
    from trainguard.service.routes.alerts import StreamSlots

    slots = StreamSlots(per_token=2, total=3)
    a1, a2 = slots.take("a"), slots.take("a")
    with pytest.raises(TooMany, match="this token has 2 event streams open, its limit: close one first"):
        slots.take("a")
    b1 = slots.take("b")
    with pytest.raises(TooMany, match="the controller serves 3 event streams, its limit: try again later"):
        slots.take("c")
    a1()
    a1()  # a second release gives nothing more back
    slots.take("c")
    with pytest.raises(TooMany, match="the controller serves 3 event streams"):
        slots.take("b")
    a2()
    b1()
    slots.take("d")
    slots.take("d")  # (c, d, d: three in all again)
    with pytest.raises(TooMany, match="the controller serves 3 event streams"):
        slots.take("e")

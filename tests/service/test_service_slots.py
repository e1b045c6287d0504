"""The requests held open at once are bounded: the desired state's long-polls per run and token,
per operator token and in all, on a real ``trainguard serve``; and the bounds themselves."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import wait_until
from trainguard.service.errors import TooMany
from trainguard.service.slots import CONNECTIONS_KEPT_FREE, POLLS_PER_OPERATOR_TOKEN, POLLS_PER_RUN, Slots, long_poll_slots

AGENT, OTHER_AGENT, READER, OPERATOR = "agent-token-aaaa", "agent-token-bbbb", "reader-token-01", "operator-token-1"


def test_a_key_and_all_keys_are_bounded_and_a_release_gives_back_one_place() -> None:
    slots = Slots(2, 3, "long-polls")
    a1, _ = slots.take("a"), slots.take("a")
    with pytest.raises(TooMany, match="^this token has 2 long-polls open, its limit: close one first$"):
        slots.take("a")
    slots.take("b", per_key=1)
    with pytest.raises(TooMany, match="^the controller serves 3 long-polls, its limit: try again later$"):
        slots.take("c")
    a1()
    a1()  # a second release gives nothing more back
    assert slots.taken == 2
    slots.take("c")
    with pytest.raises(TooMany, match="^run x has 1 long-polls open, its limit: wait$"):
        slots.take("b", per_key=1, holder="run x", remedy="wait")


def test_the_long_polls_leave_connections_to_the_other_requests() -> None:
    assert long_poll_slots(4096).total == 4096 - CONNECTIONS_KEPT_FREE
    assert long_poll_slots(300).total == 150  # half, when fewer than twice the connections kept free
    small = long_poll_slots(8)
    for run in "abcd":
        small.take(("token", run))
    with pytest.raises(TooMany, match=r"^the controller serves 4 long-polls \(TRAINGUARD_MAX_CONNECTIONS=8 less the 4 kept "
                       r"for other requests\), its limit: try again later$"):
        small.take(("token", "e"))
    with pytest.raises(ValueError, match="must be >= 1"):
        Slots(0, 3, "long-polls")


def _poll(address: tuple[str, int], token: str, run: str, after: int = 0) -> socket.socket:
    """A raw long-poll of ``run``'s desired state, waiting for a generation after ``after``."""
    s = socket.create_connection(address)
    s.settimeout(60)
    s.sendall(f"GET /v1/runs/{run}/desired?after={after}&wait=600 HTTP/1.1\r\nHost: x\r\n"
              f"Authorization: Bearer {token}\r\n\r\n".encode())
    return s


def _answer(s: socket.socket) -> bytes:
    answer = s.recv(4096)
    while b"\r\n\r\n" not in answer or answer.endswith(b"\r\n\r\n"):
        answer += s.recv(4096)  # (the head and the body may come in several pieces)
    return answer


def _waiting(client: httpx.Client) -> int:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("trainguard_controller_longpoll_waiters "):
            return int(float(line.split()[1]))
    raise AssertionError("no longpoll_waiters gauge")


def test_long_polls_are_bounded_per_run_and_token_and_per_operator_token(tmp_path: Path, serve) -> None:
    srv = serve(tmp_path / "tg.db", env={"TRAINGUARD_OPERATOR_TOKENS": f"{OPERATOR},{READER}:read",
                                         "TRAINGUARD_AGENT_TOKENS": f"{AGENT},{OTHER_AGENT}", "TRAINGUARD_LONGPOLL_MAX_S": "600"})
    address = ("127.0.0.1", srv.port)
    opened: list[socket.socket] = []
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=30) as c:
        for token, run in ((AGENT, "r1"), (OTHER_AGENT, "r2")):
            reg = {"job": "j", "run": run, "world_size": 1, "ranks": [{"rank": 0, "local_rank": 0, "host": "h", "port": 1}]}
            assert c.post("/v1/runs", json=reg, headers={"Authorization": f"Bearer {token}"}).status_code == 200
        try:
            opened += [_poll(address, AGENT, "r1") for _ in range(POLLS_PER_RUN)]
            wait_until(lambda: _waiting(c) == POLLS_PER_RUN)
            refused = _poll(address, AGENT, "r1")
            head = _answer(refused)
            refused.close()
            assert head.startswith(b"HTTP/1.1 429"), head
            assert (f"this token's run 'r1' has {POLLS_PER_RUN} long-polls open, its limit: wait for one to "
                    "answer").encode() in head
            opened.append(_poll(address, OTHER_AGENT, "r2"))  # another token's run has its own
            opened += [_poll(address, READER, run) for run in ("r1", "r2") * (POLLS_PER_OPERATOR_TOKEN // 2)]
            wait_until(lambda: _waiting(c) == POLLS_PER_RUN + 1 + POLLS_PER_OPERATOR_TOKEN)
            refused = _poll(address, READER, "r2")
            head = _answer(refused)
            refused.close()
            assert head.startswith(b"HTTP/1.1 429") and f"has {POLLS_PER_OPERATOR_TOKEN} long-polls".encode() in head
            # a new generation answers r1's polls: their places are free again
            assert c.post("/v1/runs/r1/pause", json={"reason": "test"}).status_code == 200
            for s in opened[:POLLS_PER_RUN]:
                assert _answer(s).startswith(b"HTTP/1.1 200")
            wait_until(lambda: _waiting(c) == 1 + POLLS_PER_OPERATOR_TOKEN // 2)
            opened.append(_poll(address, AGENT, "r1", after=1))
            wait_until(lambda: _waiting(c) == 2 + POLLS_PER_OPERATOR_TOKEN // 2)
        finally:
            for s in opened:
                s.close()

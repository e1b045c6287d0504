"""ControllerClient against a misbehaving real server: an answer bigger than the cap is not read
past it, a server trickling one byte at a time cannot hold a request past its total bound, and
``close()`` ends every thread it started within its deadline (the long-poll included), so that
attaching and closing in a loop does not accumulate threads."""

from __future__ import annotations

import json
import socket
import threading

from trainguard.protocol.wire import DesiredState, RunRegistration, dumps
from tests.control.procs import until
from trainer_agent.client import MAX_ANSWER_BYTES, ControllerClient

REG = RunRegistration(job="job-a", run="run-a", world_size=1)
REGISTERED = json.dumps({"job": "job-a", "run": "run-a", "desired": json.loads(dumps(DesiredState()))}).encode()


class RawServer:
    """A loopback HTTP server whose answers are scripted per request path, on raw sockets."""

    def __init__(self, handler) -> None:  # type: ignore[no-untyped-def]
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.handler = handler
        self.sent: dict[str, int] = {}
        self.polls = 0
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            try:
                while True:
                    while b"\r\n\r\n" not in buf:
                        chunk = conn.recv(65536)
                        if not chunk:
                            return
                        buf += chunk
                    head, buf = buf.split(b"\r\n\r\n", 1)
                    length = 0
                    for line in head.split(b"\r\n")[1:]:
                        k, _, v = line.partition(b":")
                        if k.strip().lower() == b"content-length":
                            length = int(v)
                    while len(buf) < length:
                        buf += conn.recv(65536)
                    buf = buf[length:]
                    path = head.split(b" ")[1].decode().split("?")[0]
                    self.handler(self, conn, path)
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def _ok(conn: socket.socket, body: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)


def test_an_oversized_answer_is_not_read_past_the_cap() -> None:
    def handler(srv: RawServer, conn: socket.socket, path: str) -> None:
        if path == "/v1/runs":
            # a chunked answer (no Content-Length to refuse up front) that never ends
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
            block = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)
            srv.sent[path] = 0
            try:
                while srv.sent[path] < 200 * MAX_ANSWER_BYTES:
                    conn.sendall(block)
                    srv.sent[path] += 65536
            except OSError:
                raise
        else:
            _ok(conn, b"{}")

    srv = RawServer(handler)
    c = ControllerClient(srv.url, registration=REG, request_timeout_s=30.0, long_poll_s=0.5, backoff_initial_s=5.0, backoff_max_s=5.0)
    c.start()
    c.wait_registered(60)
    assert until(lambda: "/v1/runs" in srv.sent and not c.up, timeout=60)
    assert c.desired is None  # nothing from the oversized answer was taken
    assert c.close(5.0)
    # the client stopped reading at the cap: the server could not push much more than that
    # (plus what the sockets' buffers hold) before its writes failed
    assert srv.sent["/v1/runs"] < 40 * MAX_ANSWER_BYTES
    srv.close()


def test_a_trickling_server_cannot_hold_a_request_past_its_total_bound() -> None:
    def handler(srv: RawServer, conn: socket.socket, path: str) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n")
        while not srv.stop.is_set():  # one byte every 50 ms: each read is well within its timeout
            conn.sendall(b" ")
            srv.stop.wait(0.05)

    srv = RawServer(handler)
    c = ControllerClient(srv.url, registration=REG, request_timeout_s=0.5, long_poll_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.1)
    c.start()
    # without a total bound the registration would hang for 100000 * 50 ms; with it, it fails
    # and is retried, again and again
    assert c.wait_registered(60) is None and not c.up
    assert until(lambda: c._first_attempt.is_set(), timeout=60)
    assert c.close(5.0)
    srv.close()


def test_close_ends_every_thread_including_the_long_poll_in_a_loop() -> None:
    def handler(srv: RawServer, conn: socket.socket, path: str) -> None:
        if path == "/v1/runs":
            _ok(conn, REGISTERED)
        elif path.endswith("/desired"):
            srv.polls += 1
            srv.stop.wait(120)  # hold the long-poll
        else:
            _ok(conn, b"{}")

    srv = RawServer(handler)
    before = {t.ident for t in threading.enumerate()}
    for i in range(20):
        c = ControllerClient(srv.url, registration=REG, request_timeout_s=2.0, long_poll_s=60.0)
        c.start()
        assert c.wait_registered(30) is not None
        polls = i + 1
        assert until(lambda: srv.polls >= polls, timeout=30)  # the poller is inside its long-poll
        assert c.close(5.0)
        assert not any(t.is_alive() for t in c._threads)
    def ours() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.ident not in before and t.name.startswith(("trainguard-", "Thread-"))
                and "RawServer" not in repr(t._target if hasattr(t, "_target") else None)]
    # only the server's own per-connection threads may remain (they wait on the held polls)
    assert until(lambda: not [t for t in ours() if t.name.startswith("trainguard-") or "Timer" in type(t).__name__], timeout=10)
    srv.close()

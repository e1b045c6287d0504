"""A fault-injection TCP proxy on loopback, for tests of network code that must fail open.

    with FaultProxy(upstream_port) as proxy:          # listens on 127.0.0.1:<free port>
        client = ControllerClient(base_url=proxy.url, ...)
        proxy.set_mode("blackhole")                    # accept, read, never answer
        proxy.set_mode("pass", latency_s=2.0)          # forward, each request delayed 2 s
        proxy.set_mode("down")                         # nothing listens: connection refused
        proxy.set_mode("pass")                         # back to normal, same port
        proxy.set_latency(2.0)                         # slower, kept-alive connections too

Modes:

``pass``
    Forward bytes both ways to the upstream; ``latency_s`` delays every chunk sent towards the
    upstream (one small HTTP request is one chunk, so: a slow answer per request).
``blackhole``
    Accept connections and read whatever arrives; never answer, never close.
``reset``
    Accept, then close with a TCP RST (``SO_LINGER`` 0).
``down``
    Close the listening socket: connections are refused. Leaving ``down`` listens on the same
    port again.
``http500``
    Answer every request with ``500 Internal Server Error`` and a small JSON body.
``garbage``
    Answer every request with ``200 OK`` and a body that is not JSON.
``junk``
    Answer with bytes that are not HTTP at all, then close.

Changing the mode resets the connections that are open, so a client holding a keep-alive
connection sees the new fault on its next request (as it would if the server had been killed).
:meth:`FaultProxy.set_latency` changes the delay of ``pass`` without resetting anything: the open
connections get slower or faster too, as with a real server whose slowness is not per connection
(one that is overloaded, then recovers, while its clients keep their connections alive).
The proxy needs no upstream for the modes that do not forward. Threads are daemons; ``close()``
ends them.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from typing import Literal

__all__ = ["FaultProxy", "Mode"]

Mode = Literal["pass", "blackhole", "reset", "down", "http500", "garbage", "junk"]
_MODES: tuple[str, ...] = ("pass", "blackhole", "reset", "down", "http500", "garbage", "junk")

_HTTP500 = (
    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
    b"content-length: 27\r\nconnection: close\r\n\r\n{\"detail\":\"injected fault\"}"
)
_GARBAGE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 17\r\n"
    b"connection: close\r\n\r\n{not json at all\x00"
)
_JUNK = b"\x16\x03\x01\x00\xa5 this is not an HTTP answer \xff\xfe\r\n\r\n"


def _hard_close(sock: socket.socket) -> None:
    """Close with RST instead of FIN, so the peer sees 'connection reset'."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:<port>`` to ``upstream_host:upstream_port`` with injectable
    faults. ``upstream_port`` may be ``None`` (or changed with :meth:`set_upstream`) when only
    non-forwarding modes are used."""

    def __init__(
        self,
        upstream_port: int | None = None,
        *,
        upstream_host: str = "127.0.0.1",
        mode: Mode = "pass",
        latency_s: float = 0.0,
    ) -> None:
        self._lock = threading.Lock()
        self._upstream = (upstream_host, upstream_port)
        self._mode: str = "pass"
        self._latency_s = 0.0
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.accepted = 0
        """Connections accepted so far (in every mode but ``down``)."""
        self._listener: socket.socket | None = None
        self._listen_thread: threading.Thread | None = None
        self.port = 0
        self._listen()
        self.set_mode(mode, latency_s=latency_s)

    # -- public ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def mode(self) -> str:
        return self._mode

    def set_upstream(self, port: int, host: str = "127.0.0.1") -> None:
        """Forward new connections to another upstream (e.g. a restarted server)."""
        with self._lock:
            self._upstream = (host, port)

    def set_mode(self, mode: Mode, *, latency_s: float = 0.0) -> None:
        """Switch fault mode; open connections are reset."""
        if mode not in _MODES:
            raise ValueError(f"unknown fault mode {mode!r}; expected one of {_MODES}")
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        with self._lock:
            if self._closed:
                raise ValueError("the proxy is closed")
            previous = self._mode
            self._mode, self._latency_s = mode, latency_s
            conns, self._conns = self._conns, set()
        for c in conns:
            _hard_close(c)
        if mode == "down" and previous != "down":
            self._stop_listening()
        elif mode != "down" and self._listener is None:
            self._listen()

    def set_latency(self, latency_s: float) -> None:
        """Delay every request by ``latency_s`` from now on, on the open connections too (none is
        reset); the mode must be ``pass``."""
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        with self._lock:
            if self._mode != "pass":
                raise ValueError(f"set_latency needs the pass mode, the proxy is in {self._mode!r}")
            self._latency_s = latency_s

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._conns = self._conns, set()
        for c in conns:
            _hard_close(c)
        self._stop_listening()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------
    def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 5.0
        while True:  # the same port again after 'down': it may linger for a moment
            try:
                sock.bind(("127.0.0.1", self.port))
                break
            except OSError:
                if self.port == 0 or time.monotonic() > deadline:
                    sock.close()
                    raise
                time.sleep(0.05)
        sock.listen(64)
        self.port = int(sock.getsockname()[1])
        self._listener = sock
        t = threading.Thread(target=self._accept_loop, args=(sock,), name="faultproxy-accept", daemon=True)
        self._listen_thread = t
        t.start()

    def _stop_listening(self) -> None:
        sock, self._listener = self._listener, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self._listen_thread is not None and self._listen_thread is not threading.current_thread():
            self._listen_thread.join(timeout=2.0)
        self._listen_thread = None

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    _hard_close(conn)
                    return
                mode, upstream = self._mode, self._upstream
                self._conns.add(conn)
                self.accepted += 1
            threading.Thread(
                target=self._serve, args=(conn, mode, upstream), name="faultproxy-conn", daemon=True
            ).start()

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            for s in socks:
                self._conns.discard(s)

    def _serve(self, conn: socket.socket, mode: str, upstream: tuple[str, int | None]) -> None:
        try:
            if mode == "reset":
                self._forget(conn)
                _hard_close(conn)
            elif mode == "blackhole":
                while conn.recv(65536):
                    pass
            elif mode in ("http500", "garbage", "junk"):
                self._answer_canned(conn, {"http500": _HTTP500, "garbage": _GARBAGE, "junk": _JUNK}[mode])
            else:
                self._forward(conn, upstream)
        except (OSError, ValueError):  # a socket reset by set_mode()/close() under our feet
            pass
        finally:
            self._forget(conn)
            try:
                conn.close()
            except OSError:
                pass

    @staticmethod
    def _answer_canned(conn: socket.socket, answer: bytes) -> None:
        buf = b""
        while b"\r\n\r\n" not in buf:  # read the request head, then answer and close
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk
        conn.sendall(answer)
        conn.shutdown(socket.SHUT_WR)

    def _forward(self, conn: socket.socket, upstream: tuple[str, int | None]) -> None:
        host, port = upstream
        if port is None:
            _hard_close(conn)
            return
        try:
            up = socket.create_connection((host, port), timeout=5.0)
        except OSError:
            _hard_close(conn)  # upstream is down: the client sees a reset, as through a real LB
            return
        up.settimeout(None)
        for s in (conn, up):  # forward each chunk at once: no Nagle/delayed-ACK stalls of ~40 ms
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._conns.add(up)
        try:
            peers = {conn: up, up: conn}
            while True:
                readable, _, _ = select.select([conn, up], [], [], 1.0)
                if self._closed:
                    return
                for s in readable:
                    data = s.recv(65536)
                    if not data:
                        return
                    latency = self._latency_s  # read per request: set_latency applies to this one
                    if s is conn and latency > 0:
                        time.sleep(latency)
                    peers[s].sendall(data)
        finally:
            self._forget(up)
            try:
                up.close()
            except OSError:
                pass

"""The private httpx/httpcore members of ``trainer_agent/compat/httpx_private.py``, on a real
loopback connection: the network backend installed through ``HTTPTransport._pool._network_backend``
is the one that opens the transport's connections, and cutting its sockets ends a request that is
waiting for an answer that never comes."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest

from trainer_agent import compat
from trainer_agent.report.controller_link import _AbortableBackend
from trainer_agent.compat.httpx_private import install_network_backend


class _SilentServer:
    """Accepts one connection, reads the request head, and never answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.got_request = threading.Event()
        self.release = threading.Event()
        self.head = b""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            while b"\r\n\r\n" not in self.head:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                self.head += chunk
            self.got_request.set()
            self.release.wait(60)

    def close(self) -> None:
        self.release.set()
        self.listener.close()
        self.thread.join(10)


def test_installed_backend_makes_the_connections_and_abort_ends_a_pending_request():
    server = _SilentServer()
    backend = _AbortableBackend()
    transport = httpx.HTTPTransport()
    assert install_network_backend(transport, backend)
    outcome: list[BaseException | httpx.Response] = []

    def request() -> None:
        with httpx.Client(transport=transport, timeout=httpx.Timeout(120.0)) as http:
            try:
                outcome.append(http.get(f"http://127.0.0.1:{server.port}/v1/poll"))
            except BaseException as exc:  # noqa: BLE001 - the outcome under test
                outcome.append(exc)

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    try:
        assert server.got_request.wait(60), "the request never reached the server"
        assert server.head.startswith(b"GET /v1/poll HTTP/1.1")
        assert len(backend._socks) == 1  # the installed backend opened the connection
        backend.abort()
        thread.join(60)
        assert not thread.is_alive(), "abort did not end the pending request"
    finally:
        server.close()
    (exc,) = outcome
    assert isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException), repr(exc)


def test_a_transport_without_the_pool_is_left_as_it_is(monkeypatch):
    """The documented fallback: a transport with another inside (here a mock) is not touched, the
    caller learns it, and the degradation is logged once."""
    monkeypatch.setattr(compat, "DEGRADED", {})
    transport = httpx.MockTransport(lambda request: httpx.Response(200))
    assert not install_network_backend(transport, _AbortableBackend())  # type: ignore[arg-type]
    assert list(compat.DEGRADED) == ["httpx.HTTPTransport._pool"]
    with httpx.Client(transport=transport) as http:
        assert http.get("http://controller/").status_code == 200


@pytest.mark.parametrize("closing", [False, True])
def test_a_closing_backend_refuses_new_connections(closing):
    """``abort(final=True)`` (the client closing): no new connection through the installed backend."""
    backend = _AbortableBackend()
    transport = httpx.HTTPTransport()
    assert install_network_backend(transport, backend)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        if closing:
            backend.abort(final=True)
        with httpx.Client(transport=transport, timeout=httpx.Timeout(5.0)) as http:
            if closing:
                with pytest.raises(httpx.ConnectError, match="closing"):
                    http.get(f"http://127.0.0.1:{port}/")
            else:
                with pytest.raises(httpx.ReadTimeout):  # connected (nobody answers)
                    http.get(f"http://127.0.0.1:{port}/", timeout=httpx.Timeout(5.0, read=0.2))
    finally:
        listener.close()

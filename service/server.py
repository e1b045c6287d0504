"""How ``trainguard serve`` runs the app: uvicorn with connection limits, timeouts, a bounded
shutdown and a rules reload on SIGHUP.

uvicorn by itself closes only connections that idle after a response (``timeout_keep_alive``): a
connection that sends nothing, half a request line, half its headers or half of a promised body
stays open, and enough of them exhaust the process's file descriptors. :class:`GuardedHttpProtocol`
adds what a front proxy (nginx's ``client_header_timeout`` / ``client_body_timeout`` /
``large_client_header_buffers``, HAProxy's ``timeout http-request``) would:

* **request-head deadline** (``header_timeout_s``): from the first byte of a request (or from the
  connection, for the first request) to its last header line. Armed once per request, so a
  client trickling one byte a second does not extend it.
* **request-head size** (``max_head_bytes``): a request line and headers longer than this get 431
  and the connection is closed (the C parser itself buffers no head, but the URL and the header
  list it hands over would grow without end).
* **body deadline** (``body_timeout_s``): the whole body must arrive within it; else 408 and close.
* **connection cap** (``max_connections``): connections beyond it are closed at once.

It is uvicorn's httptools protocol (a C parser): with the pure-Python h11 parser an ~8 KB report
cost about twice the server CPU (bench/controller_ingest.py).

Shutdown (SIGTERM or SIGINT): the listener closes, long-polls answer at once, event streams end,
bodies still arriving are answered 503, and requests still running get ``shutdown_timeout_s``
before they are cancelled; then the queued writes commit and the process exits. SIGHUP reloads
the ``--rules`` file; an invalid file is logged and the old rules stay (as Prometheus does).

Behind a proxy, give the proxy shorter header/body timeouts than these (so it answers the client)
and an idle timeout longer than the agents' long-poll (``longpoll_max_s``, 60 s by default), and
make it pass ``Authorization`` and ``Last-Event-ID`` through and not buffer
``/v1/events/stream`` (the stream sets ``X-Accel-Buffering: no``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from trainguard.service.store import shown_db

__all__ = ["GuardedHttpProtocol", "ControllerServer", "make_config", "startup_banner"]

log = logging.getLogger("trainguard.server")


def _raw_answer(status: str, detail: str) -> bytes:
    body = ('{"detail":"%s"}' % detail).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


_TIMEOUT_408 = _raw_answer("408 Request Timeout", "the request body did not arrive in time")
_SHUTDOWN_503 = _raw_answer("503 Service Unavailable", "the controller is shutting down")
_HEAD_431 = _raw_answer("431 Request Header Fields Too Large", "the request line and headers are too long")


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a request-head deadline and size limit, a body deadline
    and a connection cap (class attributes, set by :func:`make_config`)."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0
    max_connections = 4096
    max_head_bytes = 16 * 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_cycle: Any = None
        self._head_bytes = 0
        self._body_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            log.warning("connection refused: %d connections open (limit %d)", len(self.connections) - 1, self.max_connections)
            transport.close()
            return
        self._arm_head()

    def _arm_head(self) -> None:
        if self._head_timer is None:
            self._head_cycle = self.cycle
            self._head_bytes = 0
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.cycle is self._head_cycle and not self.transport.is_closing():
            self.transport.close()  # no complete request head in time

    def _body_expired(self, cycle: Any) -> None:
        self._body_timer = None
        if cycle is self.cycle and cycle.more_body and not self.transport.is_closing():
            if not cycle.response_started:
                self.transport.write(_TIMEOUT_408)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self._arm_head()  # bytes of a next request, not complete yet
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self.transport.write(_HEAD_431)
                self.transport.close()
            return
        if self._head_timer is not None and cycle is not self._head_cycle:
            self._head_timer.cancel()
            self._head_timer = None
        if cycle.more_body and self._body_timer is None:
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_expired, cycle)
        elif not cycle.more_body and self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (getattr(self, "_head_timer", None), getattr(self, "_body_timer", None)):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and cycle.more_body:
            # a body still arriving at shutdown: the request cannot be served in time
            if not cycle.response_started:
                self.transport.write(_SHUTDOWN_503)
            self.transport.close()
            return
        super().shutdown()


class ControllerServer(uvicorn.Server):
    """uvicorn's server that, on SIGTERM/SIGINT, first wakes long-polls and ends event streams
    (they would otherwise hold the graceful shutdown for its whole timeout), and reloads the rules
    file on SIGHUP."""

    def __init__(self, config: uvicorn.Config, controller: Any) -> None:
        super().__init__(config)
        self.controller = controller
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            self._loop.add_signal_handler(signal.SIGHUP, self._reload)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / not Unix
            pass
        await super().startup(sockets)

    def _reload(self) -> None:
        self.controller.reload_rules_file()

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.controller.begin_shutdown)


def startup_banner(settings: Any, host: str, port: int) -> str:
    """What ``trainguard serve`` prints once it listens: the address (first line, which scripts
    parse), the console and API docs URLs, and whether requests need a token.

    Bound to every interface (``0.0.0.0``, ``::``), the URLs name the loopback address, the one
    that works from the machine itself (and through a port published on loopback)."""
    shown = f"[{host}]" if ":" in host else host
    lines = [f"trainguard controller listening on http://{shown}:{port} (db {shown_db(settings.db)})"]
    browse = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, shown)
    lines += [f"  console:  http://{browse}:{port}/ui", f"  API docs: http://{browse}:{port}/docs"]
    if settings.auth_enabled:
        lines.append(f"  auth is ON: {len(settings.operator_tokens)} operator and {len(settings.agent_tokens)} agent "
                     "token(s) configured; every /v1 request and the console need one")
    else:
        lines.append("  WARNING: auth is OFF: no tokens are configured (TRAINGUARD_OPERATOR_TOKENS, "
                     "TRAINGUARD_AGENT_TOKENS), so anything that reaches this address may pause, stop or "
                     "change any run; that is why the controller binds only to loopback without tokens")
    return "\n".join(lines)


def make_config(app: Any, settings: Any, *, log_level: str, access_log: bool) -> uvicorn.Config:
    """The uvicorn configuration of ``trainguard serve`` for ``settings``."""
    protocol = type("ControllerHttpProtocol", (GuardedHttpProtocol,), {
        "header_timeout_s": settings.header_timeout_s, "body_timeout_s": settings.body_timeout_s,
        "max_connections": settings.max_connections})
    return uvicorn.Config(
        app, log_level=log_level, access_log=access_log, workers=1, http=protocol,
        timeout_keep_alive=int(settings.keepalive_timeout_s), timeout_graceful_shutdown=int(settings.shutdown_timeout_s),
        limit_concurrency=settings.max_connections,
    )

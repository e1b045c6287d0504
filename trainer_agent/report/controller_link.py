"""The HTTP side of the controller client (``trainer_agent/report/client.py``): one of several controller
URLs (an active controller and its standbys), every request bounded in time and size, and each
answer turned into what the client does next.

:class:`ControllerLink` holds the URLs, the headers and timeouts, and the abortable network
backends that let :meth:`ControllerClient.close` cut a request blocked in a read. Its
:meth:`ControllerLink.exchange` sends one request to the controller being talked to and maps the
answer: a 2xx to the validated answer model (``up`` True), a 404 to :class:`Unknown` (register
again), a 413 to :class:`TooLarge`, another 4xx to :class:`Refused` (drop the item), a standby's
answer, a 5xx or a network failure to an exception after moving on to the next URL. A desired state
outside the protocol's bounds is no failure of the controller: it goes to the client's refusal
callback and the exchange returns None.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import httpcore
import httpx
from pydantic import Field, ValidationError

from trainguard.protocol.wire import (
    API_PREFIX,
    LR_SCALE_MAX,
    LR_SCALE_MIN,
    DesiredState,
    ReportAccepted,
    RunRegistered,
    WireModel,
    dumps,
)
from trainer_agent.compat.httpx_private import install_network_backend
from trainer_agent.config import controller_urls
from trainer_agent.report.outbox import SendCounts
from trainer_agent.version import __version__

__all__ = ["MAX_ANSWER_BYTES", "ControllerLink", "Failures", "Refused", "TooLarge", "Unknown", "controller_urls"]

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=WireModel)

#: Largest answer read from the controller (its answers are a few hundred bytes): a bigger one is
#: a failure, and is not read past this.
MAX_ANSWER_BYTES = 1 << 20

#: What the link calls with a desired state it refuses: the (field, value) pairs and the answer.
RefuseCommand = Callable[[list[tuple[str, Any]], bytes], None]


class _AbortableBackend(httpcore.SyncBackend):
    """httpcore's network backend, remembering its sockets so that another thread can end a
    request blocked in one (``shutdown`` wakes a blocked ``recv``; ``close`` does not)."""

    def __init__(self) -> None:
        super().__init__()
        self._socks: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._final = False

    def connect_tcp(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self._final:
            raise httpcore.ConnectError("the client is closing")
        stream = super().connect_tcp(*args, **kwargs)
        sock = stream.get_extra_info("socket")
        if sock is not None:
            with self._lock:
                self._socks.add(sock)
                final = self._final
            if final:  # closed while connecting
                sock.shutdown(socket.SHUT_RDWR)
        return stream

    def abort(self, *, final: bool = False) -> None:
        """Cut every connection; ``final``: and every later one (the client is closing)."""
        with self._lock:
            self._final = self._final or final
            socks = list(self._socks)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _command_fields(exc: ValidationError, answer_type: type[WireModel]) -> list[tuple[str, Any]] | None:
    """The (field, value) pairs of a desired state that made ``exc``, when it is about the desired
    state alone (``None`` when another part of the answer is unreadable)."""
    out = []
    for error in exc.errors():
        loc = error["loc"]
        if answer_type is not Command:
            if not loc or loc[0] != "desired":
                return None
            loc = loc[1:]
        if not loc or error["type"] == "json_invalid":
            return None  # not a desired state at all (garbage, not JSON, not an object): unreadable
        out.append((".".join(str(part) for part in loc), error.get("input")))
    return out


def _without_unknown_fields(exc: ValidationError, content: bytes) -> tuple[bytes, list[str]] | None:
    """When fields unknown to this agent's protocol are among ``exc``'s errors (a controller newer
    than the agent: forward compatibility), the answer without them and their dotted names; else None."""
    unknown = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden" and e["loc"]]
    if not unknown:
        return None
    try:
        answer = json.loads(content)
        for loc in unknown:
            holder = answer
            for part in loc[:-1]:
                holder = holder[part]
            del holder[loc[-1]]
    except (ValueError, LookupError, TypeError):
        return None
    return json.dumps(answer).encode(), [".".join(map(str, loc[1:] if loc[0] == "desired" else loc)) for loc in unknown]


class Refused(Exception):
    """The controller answered with a 4xx that retrying will not fix: drop the item. ``status``
    and ``content``: the answer's (``content`` bounded by :data:`MAX_ANSWER_BYTES`)."""

    def __init__(self, message: str, status: int = 0, content: bytes = b"") -> None:
        super().__init__(message)
        self.status, self.content = status, content


class TooLarge(Refused):
    """The controller refused the body as too large (413)."""


class Command(DesiredState):
    """A desired state as the agent takes it from the wire: every bound of the protocol, the
    ``lr_scale`` range included (the wire model leaves that one to the controller)."""

    lr_scale: float = Field(default=1.0, ge=LR_SCALE_MIN, le=LR_SCALE_MAX, allow_inf_nan=False)


class Registered(RunRegistered):
    desired: Command


class Accepted(ReportAccepted):
    desired: Command


class Unknown(Exception):
    """The controller does not know the run (404): register again, then retry."""


class Failures:
    """Failures and refusals: each kind logged once as a warning (then at debug), errors of the
    agent's sent to its callback."""

    def __init__(self, on_error: Callable[[str, BaseException], None] | None, counts: SendCounts) -> None:
        self._logged: set[str] = set()
        self._on_error = on_error
        self._counts = counts
        self._last_refused: tuple[Any, ...] | None = None

    def note(self, kind: str, message: str) -> None:
        """Log a failure of ``kind``: a warning the first time, then at debug."""
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("trainguard: %s (training goes on; further ones logged at debug)", message)
        else:
            log.debug("trainguard: %s", message)

    def error(self, kind: str, exc: BaseException) -> None:
        """An error of the agent's (its counter, its log), else a warning here."""
        if self._on_error is not None:
            try:
                self._on_error(kind, exc)
                return
            except Exception:  # noqa: BLE001 - the callback must not end a client thread
                pass
        self.note(kind, str(exc))

    def refuse_command(self, refused: list[tuple[str, Any]], content: bytes) -> None:
        """Count and report a desired state refused for ``refused`` (field, value) pairs, once per
        command (the poller is answered the same state until the controller changes it)."""
        try:
            raw = json.loads(content)
            generation = raw.get("desired", raw).get("generation") if isinstance(raw, dict) else None
        except (ValueError, AttributeError):
            generation = None
        key = (repr(generation), tuple((f, repr(v)) for f, v in refused))
        if key == self._last_refused:
            return
        self._last_refused = key
        self._counts.commands_refused += 1
        fields = ", ".join(f"{f}={v!r}" for f, v in refused)
        self.error("command_out_of_bounds:" + ",".join(sorted({f for f, _ in refused})), ValueError(
            f"the controller's desired state (generation {generation!r}) has {fields}, outside the protocol's "
            f"bounds: refused, the last valid state stays"))


class ControllerLink:
    """Requests to the controller being talked to, of ``urls`` (see the module docstring).
    ``on_refused_command`` receives a desired state refused for its bounds; ``lock`` guards the
    choice of URL (shared with the client's threads)."""

    def __init__(self, urls: list[str], *, token: str | None, request_timeout_s: float, connect_timeout_s: float | None,
                 long_poll_s: float, transport: httpx.BaseTransport | None, lock: threading.Condition,
                 on_refused_command: RefuseCommand) -> None:
        self.bases = [u + API_PREFIX for u in urls]
        self._at = 0  # the controller being talked to: the next one after a failure or a standby's answer
        self._lock = lock
        self._headers = {"content-type": "application/json"}
        if token:
            self._headers["authorization"] = f"Bearer {token}"
        connect = connect_timeout_s or min(request_timeout_s, 1.0)
        self.timeout = httpx.Timeout(request_timeout_s, connect=connect)
        self.poll_timeout = httpx.Timeout(long_poll_s + request_timeout_s, connect=connect)
        self._transport = transport
        self.aborters = {"sender": _AbortableBackend(), "poller": _AbortableBackend()}
        self._on_refused_command = on_refused_command
        self._unknown_logged: set[str] = set()
        self.up = False
        """True after the last exchange with the controller got a 2xx answer."""

    def post_once(self, path: str, body: Any) -> str | None:
        """POST ``body`` to ``path`` once, on a client of its own: None when the controller took it,
        else why not (never raises)."""
        transport = self._transport or httpx.HTTPTransport()
        http = httpx.Client(transport=transport, timeout=self.timeout, headers=self._headers)
        try:
            self.exchange(http, "POST", path, dumps(body), None)
            return None
        except Exception as exc:  # noqa: BLE001 - reported to the caller as text
            return str(exc) or type(exc).__name__
        finally:
            if self._transport is None:  # an injected transport is shared with the other threads
                http.close()

    def new_http(self, timeout: httpx.Timeout, which: str) -> httpx.Client:
        """An HTTP client for the ``which`` thread (``sender`` or ``poller``), cut by its aborter."""
        # httpcore writes a request's head and body separately: without TCP_NODELAY, Nagle holds
        # the body until the server's delayed ACK (~40 ms) arrives.
        transport = self._transport
        if transport is None:
            transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
            install_network_backend(transport, self.aborters[which])
            http = httpx.Client(transport=transport, timeout=timeout, headers=self._headers)
            http.trainguard_aborter = self.aborters[which]  # type: ignore[attr-defined]
            return http
        return httpx.Client(transport=transport, timeout=timeout, headers=self._headers)

    def exchange(
        self,
        http: httpx.Client,
        method: str,
        path: str,
        body: bytes | None,
        answer_type: type[_M] | None,
        params: dict[str, float] | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> _M | None:
        """One request to the controller being talked to: its answer as ``answer_type`` (None
        without one, and for a desired state refused for its bounds); raises what any other
        answer means (see the module docstring)."""
        at = self._at
        try:
            status, content, role = self._request(http, self.bases[at], method, path, body, params,
                                                  timeout or http.timeout)
        except Exception:
            self.up = False
            self._move_on(at)
            raise
        self._check_status(at, status, content, role, body)
        if answer_type is None or status in (204, 304):
            self.up = True
            return None
        return self._parse(at, content, answer_type)

    def _check_status(self, at: int, status: int, content: bytes, role: str, body: bytes | None) -> None:
        """Raise unless controller ``at`` answered 2xx as the active controller."""
        if role == "standby":
            self.up = False
            self._move_on(at)
            raise ValueError(f"controller {self.bases[at]} is a standby ({status})")
        if status == 404:
            self.up = True  # it answered: it just does not know the run
            raise Unknown()
        if status == 413:
            self.up = True  # it answered: the body is what it refuses
            raise TooLarge(f"413 for {len(body or b'')} bytes: {content[:200].decode('utf-8', 'replace')}")
        if 400 <= status < 500 and status not in (408, 425, 429):
            self.up = False
            raise Refused(f"{status} {content[:200].decode('utf-8', 'replace')}", status, content)
        if not 200 <= status < 300:
            self.up = False
            # e.g. an active cut off from its database: another may have taken over. Not so for one
            # still reading its runs back (it holds the database): the agent waits for it.
            if status >= 500 and role != "loading":
                self._move_on(at)
            raise ValueError(f"controller answered {status}" + (" (reading its runs back)" if role == "loading" else ""))

    def _parse(self, at: int, content: bytes, answer_type: type[_M]) -> _M | None:
        """A 2xx answer's body as ``answer_type``; a desired state out of bounds goes to the
        refusal callback (None), anything else unreadable raises."""
        try:
            answer = answer_type.model_validate_json(content)
        except ValidationError as exc:
            known = _without_unknown_fields(exc, content)
            if known is not None:  # a newer controller's fields: the rest is read as this agent knows it
                self._note_unknown_fields(known[1])
                return self._parse(at, known[0], answer_type)
            refused = _command_fields(exc, answer_type)
            if refused is None:
                self.up = False
                raise ValueError(f"unreadable answer from the controller: {exc.error_count()} errors") from None
            self.up = True  # it answered; its command is what the agent refuses
            self._on_refused_command(refused, content)
            return None
        if not self.up:
            log.info("trainguard: controller %s reachable again", self.bases[at])
        self.up = True
        return answer

    def _note_unknown_fields(self, fields: list[str]) -> None:
        """Log, once per field, the fields of a controller's answer this agent does not know."""
        new = sorted(set(fields) - self._unknown_logged)
        if new:
            self._unknown_logged.update(new)
            log.warning("trainguard: the controller's answers hold fields this agent (trainer_agent %s) does not know: "
                        "%s; they are ignored and the rest is applied. The controller is newer than this agent: "
                        "commands that need them take effect only with an agent as new", __version__, ", ".join(new))

    def _move_on(self, at: int) -> None:
        """After a failure at controller ``at``: the next one of several (once per failure, even
        when the sender and the poller both fail there)."""
        if len(self.bases) > 1:
            with self._lock:
                if self._at == at:
                    self._at = (at + 1) % len(self.bases)
                    log.info("trainguard: controller %s failed or stands by; trying %s", self.bases[at], self.bases[self._at])

    def _request(self, http: httpx.Client, base: str, method: str, path: str, body: bytes | None,
                 params: dict[str, float] | None, timeout: httpx.Timeout) -> tuple[int, bytes, str]:
        """One exchange: (status, body, the controller's ``X-Trainguard-Role``: ``standby``,
        ``loading`` while it reads its runs back, else empty). The whole exchange is
        bounded by the timeout's connect plus read time (a server trickling bytes cannot hold it
        longer: its connection is cut), and the body by :data:`MAX_ANSWER_BYTES`."""
        total = (timeout.connect or 0.0) + (timeout.read or 0.0) + (timeout.write or 0.0)
        aborter: _AbortableBackend | None = getattr(http, "trainguard_aborter", None)
        timer = threading.Timer(total, aborter.abort) if aborter is not None and total > 0 else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        try:
            request = http.build_request(method, base + path, content=body, params=params, timeout=timeout)
            resp = http.send(request, stream=True)
            try:
                length = resp.headers.get("content-length", "")
                if length.isdigit() and int(length) > MAX_ANSWER_BYTES:
                    raise ValueError(f"the controller's answer of {length} bytes exceeds {MAX_ANSWER_BYTES}")
                chunks, size = [], 0
                for chunk in resp.iter_bytes():
                    size += len(chunk)
                    if size > MAX_ANSWER_BYTES:
                        raise ValueError(f"the controller's answer exceeds {MAX_ANSWER_BYTES} bytes")
                    chunks.append(chunk)
                return resp.status_code, b"".join(chunks), resp.headers.get("x-trainguard-role", "")
            finally:
                resp.close()
        finally:
            if timer is not None:
                timer.cancel()

"""The leader rank's client of the controller: registration, reports, acks and the long-poll for
the desired state, all on daemon threads, so that no training step ever waits on the network.

Two threads, each with its own ``httpx.Client`` (one transport may be injected for both, e.g.
``httpx.MockTransport`` in tests):

* the *sender* registers the run (again after a controller that forgot it answers 404), then
  sends acks and reports from bounded buffers. A report that could not be sent goes back to the
  head of its buffer and is retried after a backoff; when the buffer is full the oldest report is
  dropped and counted (``reports_dropped``, exported as ``trainguard_agent_reports_dropped_total``).
* the *poller* long-polls ``GET /v1/runs/{run}/desired?after=GEN&wait=S`` so that a command
  reaches the job between reports and while it is paused (no reports are sent then).

On :meth:`close` the sender flushes what is queued (one attempt each) and then, when given one,
posts ``POST /v1/runs/{run}/finish`` once, its timeout cut to what is left of the close deadline:
the controller then knows the run ended and does not report it silent.

Every request has a connect and a read timeout; failures back off exponentially with jitter
(``delay = d/2 + uniform(0, d/2)``, ``d = min(backoff_max_s, backoff_initial_s * 2**failures)``).
``up`` (``trainguard_agent_controller_up``) is True after a 2xx answer and False after anything
else. Nothing here raises into the caller: ``submit_*`` only append to a buffer.

The client trusts the controller no further than the protocol: a desired state with any field
outside its documented bounds (``lr_scale`` outside [``LR_SCALE_MIN``, ``LR_SCALE_MAX``], a negative
sequence number, ``accumulation_steps`` beyond ``MAX_ACCUMULATION_STEPS``, ...) is refused whole:
the last valid state stays, and the refusal goes to ``on_error`` (the agent's error counter and a
log line) with each field and value, once per command. A report the controller refuses as too large
(413) is dropped and goes to ``on_error`` too, with the setting that decides the limit.

The desired state is level-based: the client keeps the one with the highest generation it has
seen (from the registration answer, report answers and polls); out-of-order answers never move it
backwards.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpcore
import httpx
from pydantic import Field, ValidationError

from trainguard.protocol.wire import (
    API_PREFIX,
    LR_SCALE_MAX,
    LR_SCALE_MIN,
    Ack,
    DesiredState,
    MemoryReport,
    QuarantineReport,
    PreflightResult,
    Report,
    ReportAccepted,
    RunFinished,
    RunRegistered,
    RunRegistration,
    WireModel,
    dumps,
)
from trainer_agent.compat.httpx_private import install_network_backend

__all__ = ["ControllerClient", "backoff_delay"]

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=WireModel)

#: Largest answer read from the controller (its answers are a few hundred bytes): a bigger one is
#: a failure, and is not read past this.
MAX_ANSWER_BYTES = 1 << 20


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
        if answer_type is not _Command:
            if not loc or loc[0] != "desired":
                return None
            loc = loc[1:]
        if not loc or error["type"] == "json_invalid":
            return None  # not a desired state at all (garbage, not JSON, not an object): unreadable
        out.append((".".join(str(part) for part in loc), error.get("input")))
    return out


def backoff_delay(failures: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Seconds to wait after ``failures`` consecutive failures (>= 1): exponential with "equal
    jitter", ``d/2 + uniform(0, d/2)`` with ``d = min(max_s, initial_s * 2**(failures-1))``, so
    that the agents of many jobs do not retry in lockstep after a controller restart."""
    d = min(max_s, initial_s * 2 ** min(failures - 1, 60))
    return d / 2 + rng.uniform(0, d / 2)


class _Refused(Exception):
    """The controller answered with a 4xx that retrying will not fix: drop the item."""


class _TooLarge(_Refused):
    """The controller refused the body as too large (413)."""


class _Command(DesiredState):
    """A desired state as the agent takes it from the wire: every bound of the protocol, the
    ``lr_scale`` range included (the wire model leaves that one to the controller)."""

    lr_scale: float = Field(default=1.0, ge=LR_SCALE_MIN, le=LR_SCALE_MAX, allow_inf_nan=False)


class _Registered(RunRegistered):
    desired: _Command


class _Accepted(ReportAccepted):
    desired: _Command


class _Unknown(Exception):
    """The controller does not know the run (404): register again, then retry."""


def controller_urls(value: str) -> list[str]:
    """The controller URLs of ``AgentConfig.controller``: one, or several separated by commas (an
    active controller and its standbys on one database, in any order); ``ValueError`` unless each
    is an http(s) URL."""
    urls = [u.strip().rstrip("/") for u in value.split(",")]
    for u in urls:
        if not u.startswith(("http://", "https://")) or not urlsplit(u).netloc:
            raise ValueError(f"controller URL must start with http:// or https://, got {u!r} (in {value!r})")
    if len(set(urls)) != len(urls):
        raise ValueError(f"controller URLs named twice in {value!r}")
    return urls


class ControllerClient:
    """Talks to the controller for one run, from daemon threads. Build, :meth:`start`, then
    :meth:`submit_report` / :meth:`submit_ack` from the training loop (non-blocking) and read
    :attr:`desired`. :meth:`close` returns within its timeout."""

    def __init__(
        self,
        base_url: str,
        *,
        registration: RunRegistration,
        token: str | None = None,
        request_timeout_s: float = 2.0,
        connect_timeout_s: float | None = None,
        long_poll_s: float = 10.0,
        max_buffered_reports: int = 64,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_error: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        urls = controller_urls(base_url)
        if not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        if connect_timeout_s is not None and not connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {connect_timeout_s}")
        if not long_poll_s >= 0:
            raise ValueError(f"long_poll_s must be >= 0, got {long_poll_s}")
        if max_buffered_reports < 1:
            raise ValueError(f"max_buffered_reports must be >= 1, got {max_buffered_reports}")
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError(
                f"need 0 < backoff_initial_s <= backoff_max_s, got {backoff_initial_s}, {backoff_max_s}"
            )
        self.run = registration.run
        self._bases = [u + API_PREFIX for u in urls]
        self._at = 0  # the controller being talked to: the next one after a failure or a standby's answer
        self._registration = registration
        self._headers = {"content-type": "application/json"}
        if token:
            self._headers["authorization"] = f"Bearer {token}"
        self._timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s or min(request_timeout_s, 1.0))
        self._poll_timeout = httpx.Timeout(
            long_poll_s + request_timeout_s, connect=connect_timeout_s or min(request_timeout_s, 1.0)
        )
        self._long_poll_s = long_poll_s
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._transport = transport
        self._rng = rng or random.Random()
        self._clock = clock

        self._cond = threading.Condition()
        self._reports: deque[Report] = deque()
        self._max_reports = max_buffered_reports
        self._acks: deque[Ack] = deque(maxlen=64)
        self._desired: DesiredState | None = None
        self._registered = False
        self._first_attempt = threading.Event()
        self._closing = False
        self._finish: RunFinished | None = None
        self._close_deadline = 0.0
        self._threads: list[threading.Thread] = []
        self._aborters = {"sender": _AbortableBackend(), "poller": _AbortableBackend()}
        self._failures_logged: set[str] = set()
        self._on_error = on_error
        self._last_refused: tuple[Any, ...] | None = None

        self.up = False
        """True after the last exchange with the controller got a 2xx answer."""
        self.reports_dropped = 0
        """Reports dropped, oldest first, because the buffer was full."""
        self.reports_sent = 0
        """Reports the controller accepted."""
        self.acks_sent = 0
        """Acks the controller accepted."""
        self.refused = 0
        """Reports and acks the controller refused with a 4xx (dropped: resending cannot help)."""
        self.reports_too_large = 0
        """Of those, reports refused as too large (413)."""
        self.commands_refused = 0
        """Desired states refused for a field outside the protocol's bounds."""
        self.finished = False
        """True once the controller accepted the finish sent by :meth:`close`."""

    # -- the training loop's side (never blocks on the network) -------------------------------
    def start(self) -> None:
        """Start the sender and the poller threads (idempotent)."""
        if self._threads:
            return
        for name, target in (("sender", self._send_loop), ("poller", self._poll_loop)):
            t = threading.Thread(target=target, name=f"trainguard-{name}-{self.run}", daemon=True)
            self._threads.append(t)
            t.start()

    def wait_registered(self, timeout: float) -> DesiredState | None:
        """Wait up to ``timeout`` s for the first registration attempt; the run's desired state
        if it succeeded, else None (the sender keeps trying in the background)."""
        self._first_attempt.wait(timeout)
        with self._cond:
            return self._desired if self._registered else None

    def submit_report(self, report: Report) -> None:
        """Queue a report; when the buffer is full the oldest one is dropped and counted."""
        with self._cond:
            if len(self._reports) >= self._max_reports:
                self._reports.popleft()
                self.reports_dropped += 1
            self._reports.append(report)
            self._cond.notify_all()

    def submit_ack(self, ack: Ack) -> None:
        """Queue an ack (the few most recent are kept)."""
        with self._cond:
            self._acks.append(ack)
            self._cond.notify_all()

    @property
    def desired(self) -> DesiredState | None:
        """The desired state with the highest generation seen so far (None before any answer)."""
        return self._desired

    def wait_desired(self, after_generation: int, timeout: float) -> DesiredState | None:
        """Block up to ``timeout`` s until a desired state newer than ``after_generation`` is
        known; return it, or None. (Used by a paused leader: a pause waits on purpose.)"""
        deadline = self._clock() + timeout
        with self._cond:
            while self._desired is None or self._desired.generation <= after_generation:
                left = deadline - self._clock()
                if left <= 0 or self._closing:
                    return None
                self._cond.wait(left)
            return self._desired

    def pending(self) -> tuple[int, int]:
        """(reports, acks) waiting to be sent."""
        with self._cond:
            return len(self._reports), len(self._acks)

    def close(self, timeout: float = 5.0, *, finish: RunFinished | None = None) -> bool:
        """Stop: the sender flushes what is queued (no retries), then posts ``finish`` if given
        and the run is registered (once, within the deadline). Every thread this client started
        has ended when it returns True, within ``timeout`` seconds: the poller's long-poll is cut
        at once, and a sender still in a request at the deadline has its connection cut."""
        deadline = self._clock() + max(timeout, 0.0)
        with self._cond:
            self._closing = True
            self._finish, self._close_deadline = finish, deadline
            self._cond.notify_all()
        if not self._threads:
            return True
        sender, poller = self._threads
        self._aborters["poller"].abort(final=True)
        sender.join(max(deadline - self._clock(), 0.0))
        if sender.is_alive():
            self._aborters["sender"].abort(final=True)
        for t in (sender, poller):
            t.join(max(deadline - self._clock(), 0.05))
        return not (sender.is_alive() or poller.is_alive())

    # -- threads -------------------------------------------------------------------------------
    def post_preflight(self, result: PreflightResult) -> str | None:
        """Send the pre-flight result once, synchronously (it runs before training: there is no
        step to block). None when the controller accepted it, else why not (never raises)."""
        return self._post_once("preflight", result)

    def post_memory_report(self, report: MemoryReport) -> threading.Thread:
        """Send a memory trace's result once, from a thread of its own (the training loop never
        waits on it; bounded by the request timeout). A failure is logged."""
        return self._post_in_thread("memory-report", report, "the memory trace's result")

    def post_quarantine(self, report: QuarantineReport) -> threading.Thread:
        """Send the samples a data skip left out once, from a thread of its own (as
        :meth:`post_memory_report`). A failure is logged (the loader's skip list keeps them)."""
        return self._post_in_thread("quarantine", report, "the quarantined samples")

    def _post_in_thread(self, what: str, body: Any, label: str) -> threading.Thread:
        def send() -> None:
            why = self._post_once(what, body)
            if why is not None:
                log.warning("trainguard: the controller did not take %s: %s", label, why)

        thread = threading.Thread(target=send, name=f"trainguard-{what}", daemon=True)
        thread.start()
        return thread

    def _post_once(self, what: str, body: Any) -> str | None:
        transport = self._transport or httpx.HTTPTransport()
        http = httpx.Client(transport=transport, timeout=self._timeout, headers=self._headers)
        try:
            self._exchange(http, "POST", f"/runs/{self.run}/{what}", dumps(body), None)
            return None
        except Exception as exc:  # noqa: BLE001 - reported to the caller as text
            return str(exc) or type(exc).__name__
        finally:
            if self._transport is None:  # an injected transport is shared with the other threads
                http.close()

    def _new_http(self, timeout: httpx.Timeout, which: str) -> httpx.Client:
        # httpcore writes a request's head and body separately: without TCP_NODELAY, Nagle holds
        # the body until the server's delayed ACK (~40 ms) arrives.
        transport = self._transport
        if transport is None:
            transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
            install_network_backend(transport, self._aborters[which])
            http = httpx.Client(transport=transport, timeout=timeout, headers=self._headers)
            http.trainguard_aborter = self._aborters[which]  # type: ignore[attr-defined]
            return http
        return httpx.Client(transport=transport, timeout=timeout, headers=self._headers)

    def _send_loop(self) -> None:
        failures = 0
        unknown = 0  # 404s since an item was last accepted
        with self._new_http(self._timeout, "sender") as http:
            while True:
                with self._cond:
                    while not (self._closing or not self._registered or self._acks or self._reports):
                        self._cond.wait()
                    if self._closing and not (self._registered and (self._acks or self._reports)):
                        finish = self._finish if self._registered else None
                        break
                    if not self._registered:
                        op, item = "register", None
                    elif self._acks:
                        op, item = "ack", self._acks.popleft()
                    else:
                        op, item = "report", self._reports.popleft()
                try:
                    if item is None:
                        self._register(http)
                    else:
                        self._send_item(http, op, item)
                        unknown = 0
                    failures = 0
                    continue
                except _Refused as exc:
                    if isinstance(exc, _TooLarge) and op == "report":
                        self.reports_too_large += 1
                        self._error("report_too_large", ValueError(
                            f"the controller refused a report as too large ({exc}); its limit follows from its "
                            f"TRAINGUARD_MAX_WORLD_SIZE (and TRAINGUARD_MAX_BODY_BYTES): the report is dropped"))
                    else:
                        self._note_failure(f"refused-{op}", f"controller refused a {op}: {exc}")
                    if item is not None:  # retrying the same body cannot help: drop it
                        self.refused += 1
                        continue
                except _Unknown:
                    self._note_failure("unknown-run", "controller does not know the run; registering again")
                    with self._cond:
                        self._registered = False
                    self._requeue(op, item)
                    unknown += 1
                    if unknown > 1:  # registered again, still unknown: back off, do not spin
                        self._sleep(unknown - 1)
                    continue
                except Exception as exc:  # noqa: BLE001 - fail open: any failure means 'retry later'
                    self._note_failure(type(exc).__name__, f"controller exchange failed: {exc!r}")
                    self._requeue(op, item)
                if op == "register" and failures + 1 >= len(self._bases):
                    self._first_attempt.set()  # every controller was asked once
                if self._closing:
                    return  # no retries while closing (nor a finish: the controller just failed)
                failures += 1
                self._sleep(failures)
            if finish is not None:
                self._send_finish(http, finish)

    def _send_finish(self, http: httpx.Client, finish: RunFinished) -> None:
        """Closing: tell the controller the run ended, never past the close deadline and never
        raising (the run is over either way). Another attempt when one failed on a kept-alive
        connection the server had closed (no answer, no timeout), and one at each further
        controller URL: the finish is idempotent, so sending it twice is harmless."""
        attempts = max(2, len(self._bases))
        for attempt in range(1, attempts + 1):
            left = self._close_deadline - self._clock()
            if left <= 0:
                return
            try:
                self._exchange(http, "POST", f"/runs/{self.run}/finish", dumps(finish), None,
                               timeout=httpx.Timeout(min(left, self._timeout.read or left)))
                self.finished = True
                return
            except Exception as exc:  # noqa: BLE001 - fail open
                stale = isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))
                if attempt == attempts or not (stale or attempt < len(self._bases)):
                    self._note_failure(f"finish-{type(exc).__name__}", f"could not tell the controller the run finished: {exc!r}")
                    return

    def _register(self, http: httpx.Client) -> None:
        answer = self._exchange(http, "POST", "/runs", dumps(self._registration), _Registered)
        with self._cond:
            self._registered = True
            if answer is not None:  # else its desired state was refused: the run is registered all the same
                self._observe(answer.desired)
        self._first_attempt.set()

    def _send_item(self, http: httpx.Client, op: str, item: Report | Ack) -> None:
        if op == "ack":
            self._exchange(http, "POST", f"/runs/{self.run}/acks", dumps(item), None)
            self.acks_sent += 1
        else:
            answer = self._exchange(http, "POST", f"/runs/{self.run}/reports", dumps(item), _Accepted)
            self.reports_sent += 1
            if answer is not None:
                with self._cond:
                    self._observe(answer.desired)

    def _requeue(self, op: str, item: Report | Ack | None) -> None:
        """Put a failed item back at the head of its buffer, or count it dropped when newer
        ones filled the buffer meanwhile (it is the oldest)."""
        if item is None:
            return
        with self._cond:
            if op == "ack":
                if len(self._acks) < (self._acks.maxlen or 0):
                    self._acks.appendleft(item)  # type: ignore[arg-type]
            elif len(self._reports) < self._max_reports:
                self._reports.appendleft(item)  # type: ignore[arg-type]
            else:
                self.reports_dropped += 1

    def _poll_loop(self) -> None:
        failures = 0
        with self._new_http(self._poll_timeout, "poller") as http:
            while True:
                with self._cond:
                    while not self._closing and not self._registered:
                        self._cond.wait()
                    if self._closing:
                        return
                    after = self._desired.generation if self._desired is not None else 0
                started = self._clock()
                try:
                    answer = self._exchange(
                        http,
                        "GET",
                        f"/runs/{self.run}/desired",
                        None,
                        _Command,
                        params={"after": after, "wait": self._long_poll_s},
                    )
                    failures = 0
                    with self._cond:
                        newer = self._observe(answer) if answer is not None else False
                    if not newer and self._clock() - started < min(0.5, self._long_poll_s):
                        # the controller answered 'no change' at once: do not spin
                        self._sleep_plain(min(0.5, max(self._long_poll_s, 0.05)))
                except _Unknown:
                    with self._cond:
                        self._registered = False
                        self._cond.notify_all()
                    failures += 1  # the sender registers again; a repeated 404 backs off
                    self._sleep(failures)
                except Exception as exc:  # noqa: BLE001 - fail open
                    with self._cond:
                        if self._closing:
                            return  # close() cut the long-poll: not a failure of the controller
                    self._note_failure(f"poll-{type(exc).__name__}", f"controller poll failed: {exc!r}")
                    failures += 1
                    self._sleep(failures)

    def _exchange(
        self,
        http: httpx.Client,
        method: str,
        path: str,
        body: bytes | None,
        answer_type: type[_M] | None,
        params: dict[str, float] | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> _M | None:
        at = self._at
        try:
            status, content, role = self._request(http, self._bases[at], method, path, body, params,
                                                  timeout or http.timeout)
        except Exception:
            self.up = False
            self._move_on(at)
            raise
        if role == "standby":
            self.up = False
            self._move_on(at)
            raise ValueError(f"controller {self._bases[at]} is a standby ({status})")
        if status == 404:
            self.up = True  # it answered: it just does not know the run
            raise _Unknown()
        if status == 413:
            self.up = True  # it answered: the body is what it refuses
            raise _TooLarge(f"413 for {len(body or b'')} bytes: {content[:200].decode('utf-8', 'replace')}")
        if 400 <= status < 500 and status not in (408, 425, 429):
            self.up = False
            raise _Refused(f"{status} {content[:200].decode('utf-8', 'replace')}")
        if not 200 <= status < 300:
            self.up = False
            # e.g. an active cut off from its database: another may have taken over. Not so for one
            # still reading its runs back (it holds the database): the agent waits for it.
            if status >= 500 and role != "loading":
                self._move_on(at)
            raise ValueError(f"controller answered {status}" + (" (reading its runs back)" if role == "loading" else ""))
        if answer_type is None or status in (204, 304):
            self.up = True
            return None
        try:
            answer = answer_type.model_validate_json(content)
        except ValidationError as exc:
            refused = _command_fields(exc, answer_type)
            if refused is None:
                self.up = False
                raise ValueError(f"unreadable answer from the controller: {exc.error_count()} errors") from None
            self.up = True  # it answered; its command is what the agent refuses
            self._refuse_command(refused, content)
            return None
        if not self.up:
            log.info("trainguard: controller %s reachable again", self._bases[at])
        self.up = True
        return answer

    def _move_on(self, at: int) -> None:
        """After a failure at controller ``at``: the next one of several (once per failure, even
        when the sender and the poller both fail there)."""
        if len(self._bases) > 1:
            with self._cond:
                if self._at == at:
                    self._at = (at + 1) % len(self._bases)
                    log.info("trainguard: controller %s failed or stands by; trying %s", self._bases[at], self._bases[self._at])

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

    def _observe(self, desired: DesiredState) -> bool:
        """Keep ``desired`` if it is newer; caller holds the condition's lock."""
        if isinstance(desired, _Command):  # checked against every bound: kept as the wire type
            desired = DesiredState.model_validate(desired.model_dump())
        if self._desired is None or desired.generation > self._desired.generation:
            self._desired = desired
            self._cond.notify_all()
            return True
        return False

    def _refuse_command(self, refused: list[tuple[str, Any]], content: bytes) -> None:
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
        self.commands_refused += 1
        fields = ", ".join(f"{f}={v!r}" for f, v in refused)
        self._error("command_out_of_bounds:" + ",".join(sorted({f for f, _ in refused})), ValueError(
            f"the controller's desired state (generation {generation!r}) has {fields}, outside the protocol's "
            f"bounds: refused, the last valid state stays"))

    def _error(self, kind: str, exc: BaseException) -> None:
        """An error of the agent's (its counter, its log), else a warning here."""
        if self._on_error is not None:
            try:
                self._on_error(kind, exc)
                return
            except Exception:  # noqa: BLE001 - the callback must not end a client thread
                pass
        self._note_failure(kind, str(exc))

    def _note_failure(self, kind: str, message: str) -> None:
        if kind not in self._failures_logged:
            self._failures_logged.add(kind)
            log.warning("trainguard: %s (training goes on; further ones logged at debug)", message)
        else:
            log.debug("trainguard: %s", message)

    def _sleep(self, failures: int) -> None:
        self._sleep_plain(backoff_delay(failures, *self._backoff, self._rng))

    def _sleep_plain(self, seconds: float) -> None:
        deadline = self._clock() + seconds
        with self._cond:
            while not self._closing:
                left = deadline - self._clock()
                if left <= 0:
                    return
                self._cond.wait(left)

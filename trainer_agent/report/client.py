"""The leader rank's client of the controller: registration, reports, acks and the long-poll for
the desired state, all on daemon threads, so that no training step ever waits on the network.

Two threads, each with its own ``httpx.Client`` (one transport may be injected for both, e.g.
``httpx.MockTransport`` in tests):

* the *sender* registers the run (again after a controller that forgot it answers 404), then
  sends acks and reports from bounded buffers. A report that could not be sent goes back to the
  head of its buffer and is retried after a backoff; when the buffer is full the oldest report is
  dropped and counted (``counts.reports_dropped``, exported as ``trainguard_agent_reports_dropped_total``).
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

The HTTP side (the URLs, the timeouts, what each answer means) is
``trainer_agent/report/controller_link.py``; the buffers and the counts ``trainer_agent/report/outbox.py``;
the finish ``trainer_agent/report/run_finish.py``; the settings' bounds and the backoff
``trainer_agent/report/client_settings.py``.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from trainguard.protocol.wire import (
    Ack,
    DesiredState,
    MemoryReport,
    PreflightResult,
    QuarantineReport,
    Report,
    RunFinished,
    RunRegistration,
    dumps,
)
from trainer_agent.report.client_settings import backoff_delay, check_settings
from trainer_agent.report.older_controller import registration_for
from trainer_agent.report.outbox import Outbox, SendCounts
from trainer_agent.report.run_finish import send_finish
from trainer_agent.report.controller_link import (
    MAX_ANSWER_BYTES,
    Accepted,
    Command,
    ControllerLink,
    Failures,
    Refused,
    Registered,
    TooLarge,
    Unknown,
    controller_urls,
)

__all__ = ["MAX_ANSWER_BYTES", "ControllerClient", "SendCounts", "backoff_delay", "controller_urls"]

log = logging.getLogger(__name__)


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
        check_settings(request_timeout_s, connect_timeout_s, long_poll_s, max_buffered_reports,
                        backoff_initial_s, backoff_max_s)
        self.run = registration.run
        self._registration = registration
        self._long_poll_s = long_poll_s
        self._sleep_for = lambda failures: backoff_delay(failures, backoff_initial_s, backoff_max_s, self._rng)
        self._rng = rng or random.Random()
        self._clock = clock
        self._cond = threading.Condition()
        self.counts = SendCounts()
        """What the sender did and dropped (the agent exports these)."""
        self._failures = Failures(on_error, self.counts)
        self._link = ControllerLink(urls, token=token, request_timeout_s=request_timeout_s,
                                    connect_timeout_s=connect_timeout_s, long_poll_s=long_poll_s,
                                    transport=transport, lock=self._cond,
                                    on_refused_command=self._failures.refuse_command)
        self._outbox = Outbox(max_buffered_reports, self.counts)
        self._desired: DesiredState | None = None
        self.applied_before: DesiredState | None = None
        """The registration answer's state the run's processes last applied (None: not said)."""
        self._registered_desired: DesiredState | None = None  # the registration answer's desired state
        self._registered = False
        self._first_attempt = threading.Event()
        self._closing = False
        self._finish: tuple[RunFinished | None, float] = (None, 0.0)  # what close() sends, and its deadline
        self._threads: list[threading.Thread] = []

    # -- what the agent reads (``/metrics``) ----------------------------------------------------
    @property
    def up(self) -> bool:
        """True after the last exchange with the controller got a 2xx answer."""
        return self._link.up

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

    @property
    def registration(self) -> tuple[DesiredState | None, DesiredState | None]:
        """The last registration answer's desired state and the state the run's processes last
        applied (either None: not answered, or not said), read together."""
        with self._cond:
            return self._registered_desired, self.applied_before

    def submit_report(self, report: Report) -> None:
        """Queue a report; when the buffer is full the oldest one is dropped and counted."""
        with self._cond:
            self._outbox.add_report(report)
            self._cond.notify_all()

    def submit_ack(self, ack: Ack) -> None:
        """Queue an ack (the few most recent are kept)."""
        with self._cond:
            self._outbox.acks.append(ack)
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
            return len(self._outbox.reports), len(self._outbox.acks)

    def close(self, timeout: float = 5.0, *, finish: RunFinished | None = None) -> bool:
        """Stop: the sender flushes what is queued (no retries), then posts ``finish`` if given
        and the run is registered (once, within the deadline). Every thread this client started
        has ended when it returns True, within ``timeout`` seconds: the poller's long-poll is cut
        at once, and a sender still in a request at the deadline has its connection cut."""
        deadline = self._clock() + max(timeout, 0.0)
        with self._cond:
            self._closing = True
            self._finish = (finish, deadline)
            self._cond.notify_all()
        if not self._threads:
            return True
        sender, poller = self._threads
        self._link.aborters["poller"].abort(final=True)
        sender.join(max(deadline - self._clock(), 0.0))
        if sender.is_alive():
            self._link.aborters["sender"].abort(final=True)
        for t in (sender, poller):
            t.join(max(deadline - self._clock(), 0.05))
        return not (sender.is_alive() or poller.is_alive())

    # -- one-off posts ---------------------------------------------------------------------------
    def post_preflight(self, result: PreflightResult) -> str | None:
        """Send the pre-flight result once, synchronously (it runs before training: there is no
        step to block). None when the controller accepted it, else why not (never raises)."""
        return self._link.post_once(f"/runs/{self.run}/preflight", result)

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
            why = self._link.post_once(f"/runs/{self.run}/{what}", body)
            if why is not None:
                log.warning("trainguard: the controller did not take %s: %s", label, why)

        thread = threading.Thread(target=send, name=f"trainguard-{what}", daemon=True)
        thread.start()
        return thread

    # -- the sender ------------------------------------------------------------------------------
    def _next_to_send(self) -> tuple[str, Report | Ack | None] | None:
        """Wait for work: (op, item) to send (``register`` has no item), or None when closing with
        nothing left to flush."""
        with self._cond:
            while not (self._closing or not self._registered or self._outbox):
                self._cond.wait()
            if self._closing and not (self._registered and self._outbox):
                return None
            return ("register", None) if not self._registered else self._outbox.take()

    def _send_loop(self) -> None:
        failures = 0
        unknown = 0  # 404s since an item was last accepted
        with self._link.new_http(self._link.timeout, "sender") as http:
            while (work := self._next_to_send()) is not None:
                op, item = work
                try:
                    if item is None:
                        self._register(http)
                    else:
                        self._send_item(http, op, item)
                        unknown = 0
                    failures = 0
                    continue
                except Refused as exc:
                    self._refused(op, exc)
                    if item is not None:  # retrying the same body cannot help: drop it
                        self.counts.refused += 1
                        continue
                except Unknown:
                    unknown += 1
                    self._unknown_run(op, item, unknown)
                    continue
                except Exception as exc:  # noqa: BLE001 - fail open: any failure means 'retry later'
                    self._failures.note(type(exc).__name__, f"controller exchange failed: {exc!r}")
                    self._requeue(op, item)
                if op == "register" and failures + 1 >= len(self._link.bases):
                    self._first_attempt.set()  # every controller was asked once
                if self._closing:
                    return  # no retries while closing (nor a finish: the controller just failed)
                failures += 1
                self._sleep(failures)
            finish, deadline = self._finish
            if finish is not None and self._registered and send_finish(
                    self._link, http, self.run, finish, deadline=deadline, clock=self._clock, failures=self._failures):
                self.counts.finished = True

    def _refused(self, op: str, exc: Refused) -> None:
        if isinstance(exc, TooLarge) and op == "report":
            self.counts.reports_too_large += 1
            self._failures.error("report_too_large", ValueError(
                f"the controller refused a report as too large ({exc}); its limit follows from its "
                f"TRAINGUARD_MAX_WORLD_SIZE (and TRAINGUARD_MAX_BODY_BYTES): the report is dropped"))
        else:
            self._failures.note(f"refused-{op}", f"controller refused a {op}: {exc}")

    def _unknown_run(self, op: str, item: Report | Ack | None, unknown: int) -> None:
        self._failures.note("unknown-run", "controller does not know the run; registering again")
        with self._cond:
            self._registered = False
        self._requeue(op, item)
        if unknown > 1:  # registered again, still unknown: back off, do not spin
            self._sleep(unknown - 1)

    def _register(self, http: httpx.Client) -> None:
        try:
            answer = self._link.exchange(http, "POST", "/runs", dumps(self._registration), Registered)
        except Refused as exc:  # a controller older than this agent: again without the fields it refuses, else raised
            self._registration = registration_for(self._registration, exc, self._failures)
            answer = self._link.exchange(http, "POST", "/runs", dumps(self._registration), Registered)
        with self._cond:
            self._registered = True
            if answer is not None:  # else its desired state was refused: the run is registered all the same
                self._observe(answer.desired)
                self.applied_before, self._registered_desired = answer.applied, answer.desired
        self._first_attempt.set()

    def _send_item(self, http: httpx.Client, op: str, item: Report | Ack) -> None:
        if op == "ack":
            self._link.exchange(http, "POST", f"/runs/{self.run}/acks", dumps(item), None)
            self.counts.acks_sent += 1
        else:
            answer = self._link.exchange(http, "POST", f"/runs/{self.run}/reports", dumps(item), Accepted)
            self.counts.reports_sent += 1
            if answer is not None:
                with self._cond:
                    self._observe(answer.desired)

    def _requeue(self, op: str, item: Report | Ack | None) -> None:
        if item is not None:
            with self._cond:
                self._outbox.requeue(op, item)

    # -- the poller ------------------------------------------------------------------------------
    def _poll_loop(self) -> None:
        failures = 0
        with self._link.new_http(self._link.poll_timeout, "poller") as http:
            while True:
                with self._cond:
                    while not self._closing and not self._registered:
                        self._cond.wait()
                    if self._closing:
                        return
                    after = self._desired.generation if self._desired is not None else 0
                try:
                    self._poll_once(http, after)
                    failures = 0
                except Unknown:
                    with self._cond:
                        self._registered = False
                        self._cond.notify_all()
                    failures += 1  # the sender registers again; a repeated 404 backs off
                    self._sleep(failures)
                except Exception as exc:  # noqa: BLE001 - fail open
                    with self._cond:
                        if self._closing:
                            return  # close() cut the long-poll: not a failure of the controller
                    self._failures.note(f"poll-{type(exc).__name__}", f"controller poll failed: {exc!r}")
                    failures += 1
                    self._sleep(failures)

    def _poll_once(self, http: httpx.Client, after: int) -> None:
        started = self._clock()
        answer = self._link.exchange(http, "GET", f"/runs/{self.run}/desired", None, Command,
                                     params={"after": after, "wait": self._long_poll_s})
        with self._cond:
            newer = self._observe(answer) if answer is not None else False
        if not newer and self._clock() - started < min(0.5, self._long_poll_s):
            # the controller answered 'no change' at once: do not spin
            self._sleep_plain(min(0.5, max(self._long_poll_s, 0.05)))

    def _observe(self, desired: DesiredState) -> bool:
        """Keep ``desired`` if it is newer; caller holds the condition's lock."""
        if isinstance(desired, Command):  # checked against every bound: kept as the wire type
            desired = DesiredState.model_validate(desired.model_dump())
        if self._desired is None or desired.generation > self._desired.generation:
            self._desired = desired
            self._cond.notify_all()
            return True
        return False

    def _sleep(self, failures: int) -> None:
        self._sleep_plain(self._sleep_for(failures))

    def _sleep_plain(self, seconds: float) -> None:
        deadline = self._clock() + seconds
        with self._cond:
            while not self._closing:
                left = deadline - self._clock()
                if left <= 0:
                    return
                self._cond.wait(left)

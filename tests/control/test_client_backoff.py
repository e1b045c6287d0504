"""A controller that keeps answering 404 after accepting the registration (e.g. an older
controller without one of the routes) must not drive the client into a busy loop of
register / retry without any backoff."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from trainguard.protocol.wire import Ack, DesiredState, RunRegistration, dumps
from tests.control.procs import until
from trainer_agent.report.client import ControllerClient

pytestmark = pytest.mark.timing


def test_repeated_404_backs_off() -> None:
    requests: list[str] = []
    lock = threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        with lock:
            requests.append(request.url.path)
        if request.url.path == "/v1/runs":
            return httpx.Response(200, json={"job": "j", "run": "r", "desired": json.loads(dumps(DesiredState()))})
        return httpx.Response(404, json={"detail": "Not Found"})  # acks and polls: unknown route

    client = ControllerClient("http://controller.invalid", registration=RunRegistration(job="j", run="r", world_size=1),
                              request_timeout_s=0.5, long_poll_s=1.0, backoff_initial_s=0.1, backoff_max_s=0.2,
                              transport=httpx.MockTransport(handler))
    client.start()
    t0 = time.monotonic()

    def registrations() -> int:
        with lock:
            return requests.count("/v1/runs")

    try:
        client.submit_ack(Ack(generation=1, step=1))
        # it still re-registers, just not in a busy loop; measured over at least a second
        assert until(lambda: registrations() >= 2 and time.monotonic() - t0 >= 1.0, 30.0)
        elapsed = time.monotonic() - t0
        with lock:
            count = len(requests)
        # With backoff (>= 0.05 s between rounds of at most 3 requests) at most ~60 requests a
        # second; a busy loop sends thousands.
        assert count < 100 * elapsed, (count, elapsed)
    finally:
        assert client.close(2.0)

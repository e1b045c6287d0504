"""ControllerClient: buffering, backoff, desired-state tracking, and fail-open behaviour against
httpx.MockTransport and, through the fault proxy, a real loopback server."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

from trainguard.protocol.wire import Ack, DesiredState, Report, RunFinished, RunRegistration, dumps
from tests.control.fake_controller import FakeController
from tests.control.procs import until
from tests.tools.faultproxy import FaultProxy
from trainer_agent.report.client import ControllerClient, backoff_delay

pytestmark = pytest.mark.timing

REG = RunRegistration(job="job-a", run="run-a", world_size=1)


def _report(step: int) -> Report:
    return Report(job="job-a", step_first=step, step_last=step, time=1.0, values={"trainguard_loss": float("nan")})


def _client(url: str, **kw) -> ControllerClient:  # type: ignore[no-untyped-def]
    kw.setdefault("request_timeout_s", 0.5)
    kw.setdefault("backoff_initial_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    kw.setdefault("long_poll_s", 1.0)
    return ControllerClient(url, registration=REG, **kw)



class Scripted:
    """A MockTransport handler: a desired state per route, recorded requests, a failure script."""

    def __init__(self) -> None:
        self.desired = DesiredState()
        self.requests: list[httpx.Request] = []
        self.fail_next: list[int | str] = []  # status codes, or "garbage"
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.requests.append(request)
            fault = self.fail_next.pop(0) if self.fail_next else None
        if fault == "garbage":
            return httpx.Response(200, content=b"{oops")
        if isinstance(fault, int):
            return httpx.Response(fault, json={"detail": "scripted"})
        path = request.url.path
        if path == "/v1/runs":
            return httpx.Response(200, json={"job": "job-a", "run": "run-a", "desired": json.loads(dumps(self.desired))})
        if path.endswith("/reports"):
            return httpx.Response(200, json={"desired": json.loads(dumps(self.desired)), "alerts": []})
        if path.endswith("/acks") or path.endswith("/finish"):
            return httpx.Response(200, json={})
        if path.endswith("/desired"):
            time.sleep(0.02)  # a short long-poll
            return httpx.Response(200, content=dumps(self.desired))
        return httpx.Response(404)

    def paths(self) -> list[str]:
        with self.lock:
            return [r.url.path for r in self.requests]


def test_backoff_delay_is_exponential_with_equal_jitter() -> None:
    rng, ref = random.Random(7), random.Random(7)
    for failures, d in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (50, 1.0)]:
        expected = d / 2 + ref.uniform(0, d / 2)
        assert backoff_delay(failures, 0.1, 1.0, rng) == pytest.approx(expected, rel=1e-12)
        assert d / 2 <= expected <= d


def test_bad_arguments_are_value_errors() -> None:
    with pytest.raises(ValueError, match="http"):
        ControllerClient("ftp://x", registration=REG)
    with pytest.raises(ValueError, match="max_buffered_reports"):
        ControllerClient("http://x", registration=REG, max_buffered_reports=0)
    with pytest.raises(ValueError, match="request_timeout_s"):
        ControllerClient("http://x", registration=REG, request_timeout_s=0)


def test_registers_reports_acks_and_tracks_newest_desired_state() -> None:
    h = Scripted()
    h.desired = DesiredState(generation=3, lr_scale=0.5)
    c = _client("http://ctl", transport=httpx.MockTransport(h), token="s3cret")
    c.start()
    d = c.wait_registered(30.0)
    assert d is not None and d.generation == 3 and d.lr_scale == 0.5
    c.submit_report(_report(1))
    c.submit_ack(Ack(generation=3, step=1))
    assert until(lambda: c.counts.reports_sent == 1 and c.counts.acks_sent == 1)
    sent = [r for r in h.requests if r.url.path.endswith("/reports")][0]
    assert sent.headers["authorization"] == "Bearer s3cret"
    assert json.loads(sent.content)["values"]["trainguard_loss"] == "NaN"  # NaN survives the wire
    h.desired = DesiredState(generation=2, paused=True)  # an older generation never wins
    c.submit_report(_report(2))
    assert until(lambda: c.counts.reports_sent == 2)
    assert c.desired is not None and c.desired.generation == 3 and not c.desired.paused
    h.desired = DesiredState(generation=4, paused=True)
    assert c.wait_desired(3, timeout=30.0) == DesiredState(generation=4, paused=True)  # via the poller
    assert c.up
    assert c.close(2.0)


def test_full_buffer_drops_oldest_and_counts() -> None:
    gate, inflight = threading.Event(), threading.Event()
    h = Scripted()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/reports"):
            inflight.set()
            gate.wait(5.0)
        return h(request)

    c = _client("http://ctl", transport=httpx.MockTransport(handler), max_buffered_reports=3)
    c.start()
    assert c.wait_registered(30.0) is not None
    c.submit_report(_report(0))
    assert inflight.wait(2.0)
    for step in range(1, 8):
        c.submit_report(_report(step))
    # report 0 is in flight; 7 more arrived into a buffer of 3: 1..4 dropped
    assert c.counts.reports_dropped == 4
    gate.set()
    assert until(lambda: c.pending() == (0, 0))
    got = [json.loads(r.content)["step_last"] for r in h.requests if r.url.path.endswith("/reports")]
    assert got == [0, 5, 6, 7]  # the one in flight, then the newest three
    assert c.close(2.0)


def test_500_and_garbage_back_off_then_recover_without_losing_the_report() -> None:
    h = Scripted()
    c = _client("http://ctl", transport=httpx.MockTransport(h))
    c.start()
    assert c.wait_registered(30.0) is not None
    h.fail_next = [500, "garbage", 503, 500]
    c.submit_report(_report(9))
    assert until(lambda: c.counts.reports_sent == 1)
    report_posts = [r for r in h.requests if r.url.path.endswith("/reports")]
    assert len(report_posts) >= 2 and all(json.loads(r.content)["step_last"] == 9 for r in report_posts)
    assert c.up and c.counts.reports_dropped == 0
    assert c.close(2.0)


def test_4xx_report_is_dropped_and_404_reregisters() -> None:
    h = Scripted()
    c = _client("http://ctl", transport=httpx.MockTransport(h))
    c.start()
    assert c.wait_registered(30.0) is not None
    with h.lock:
        h.fail_next = [422]
    c.submit_report(_report(1))
    assert until(lambda: c.counts.refused == 1)
    with h.lock:
        h.fail_next = [404]
    c.submit_report(_report(2))
    assert until(lambda: c.counts.reports_sent == 1)
    assert c.counts.refused == 1 and c.counts.reports_dropped == 0
    paths = h.paths()
    i404 = max(i for i, p in enumerate(paths) if p.endswith("/reports")) - 1
    assert "/v1/runs" in paths[i404 - 2 :]  # registered again before the retry
    assert c.close(2.0)


def test_close_returns_within_deadline_while_a_request_hangs() -> None:
    release = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        release.wait(10.0)
        return httpx.Response(500)

    c = _client("http://ctl", transport=httpx.MockTransport(handler))
    c.start()
    assert c.wait_registered(0.2) is None  # registration still hanging: fail open
    c.submit_report(_report(1))
    t0 = time.monotonic()
    assert c.close(0.3) is False  # the sender is stuck in a request: we do not wait for it
    assert time.monotonic() - t0 < 5.0  # the request hangs 10 s: a close that waited would last that
    release.set()


def test_close_flushes_then_sends_finish_once() -> None:
    h = Scripted()
    c = _client("http://ctl", transport=httpx.MockTransport(h))
    c.start()
    assert c.wait_registered(30.0) is not None
    c.submit_report(_report(1))
    c.submit_report(_report(2))
    c.submit_ack(Ack(generation=0, step=2))
    assert c.close(2.0, finish=RunFinished(step=2, reason="completed"))
    posts = [(r.url.path, json.loads(r.content)) for r in h.requests if r.method == "POST" and r.url.path != "/v1/runs"]
    assert [p for p, _ in posts][-1] == "/v1/runs/run-a/finish"  # after everything queued was flushed
    assert sorted(b.get("step_last", -1) for p, b in posts if p.endswith("/reports")) == [1, 2]
    assert posts[-1][1] == {"step": 2, "reason": "completed"}
    assert [p for p, _ in posts].count("/v1/runs/run-a/finish") == 1 and c.counts.finished


def test_close_sends_no_finish_for_an_unregistered_run_and_survives_a_refused_one() -> None:
    c = _client("http://ctl", transport=httpx.MockTransport(lambda r: httpx.Response(503)))
    c.start()
    assert c.wait_registered(1.0) is None
    assert c.close(1.0, finish=RunFinished(step=1))
    assert not c.counts.finished
    h = Scripted()
    c = _client("http://ctl", transport=httpx.MockTransport(h))
    c.start()
    assert c.wait_registered(30.0) is not None
    with h.lock:
        h.fail_next = [404]  # the controller forgot the run: the finish fails, close does not raise
    assert c.close(1.0, finish=RunFinished(step=1))
    assert not c.counts.finished and h.paths()[-1] == "/v1/runs/run-a/finish"


@pytest.mark.parametrize("mode", ["down", "blackhole", "reset", "http500", "garbage", "junk", "slow"])
def test_faults_through_the_proxy_then_recovery(mode: str) -> None:
    with FakeController() as ctl, FaultProxy(ctl.port) as proxy:
        c = _client(proxy.url, request_timeout_s=1.0, backoff_max_s=0.1)
        c.start()
        assert c.wait_registered(30.0) is not None
        c.submit_report(_report(0))
        assert until(lambda: len(ctl.reports) == 1)
        if mode == "slow":
            proxy.set_mode("pass", latency_s=2.0)  # slower than the read timeout
        else:
            proxy.set_mode(mode)  # type: ignore[arg-type]
        t0 = time.monotonic()
        for step in range(1, 6):
            c.submit_report(_report(step))
        # submitting never waits on the network: one wait would last a request timeout (1 s)
        assert time.monotonic() - t0 < 1.0
        assert until(lambda: not c.up, 30.0)
        ctl.command("run-a", paused=True)
        proxy.set_mode("pass")
        assert until(lambda: [r.step_last for r in ctl.reports][-1:] == [5], 30.0)
        assert [r.step_last for r in ctl.reports][:1] == [0]
        assert c.wait_desired(0, 30.0) is not None and c.desired.paused  # the command arrived
        assert c.up and c.counts.reports_dropped == 0
        t0 = time.monotonic()
        c.close(1.0)
        assert time.monotonic() - t0 < 1.0 + 1.0  # its deadline; a request in flight is not waited for


class _Pair:
    """Two controllers on one database behind a MockTransport: ``active`` names the host that
    serves (the other answers as a standby, 503 with its role), ``down`` hosts refuse connections,
    ``cut`` hosts answer 503 as an active controller cut off from its database does."""

    def __init__(self) -> None:
        self.active = "b"
        self.down: set[str] = set()
        self.cut: set[str] = set()  # hosts whose database is cut off: 503 from an active
        self.served = Scripted()
        self.asked: list[str] = []
        self.reports: list[tuple[str, int]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.asked.append(host)
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if host in self.cut:
            return httpx.Response(503, json={"detail": "database writes fail"})
        if host != self.active:
            return httpx.Response(503, json={"detail": "standby: another controller holds the writer lease"},
                                  headers={"x-trainguard-role": "standby", "retry-after": "1"})
        if request.url.path.endswith("/reports"):
            self.reports.append((host, json.loads(request.content)["step_last"]))
        return self.served(request)


def test_several_controller_urls_the_client_follows_the_active_one() -> None:
    pair = _Pair()
    c = _client("http://a, http://b/", transport=httpx.MockTransport(pair))
    c.start()
    assert c.wait_registered(30.0) is not None  # a stood by: registered at b
    c.submit_report(_report(1))
    assert until(lambda: c.counts.reports_sent == 1)
    assert pair.reports == [("b", 1)]
    pair.down, pair.active = {"b"}, "a"  # b dies; a takes the lease
    for step in (2, 3, 4):
        c.submit_report(_report(step))
    assert until(lambda: c.counts.reports_sent == 4)
    assert pair.reports == [("b", 1), ("a", 2), ("a", 3), ("a", 4)]  # in order, none lost
    # a is cut off from the database (503, not a standby's answer) and b took over: the client
    # does not stay with a.
    pair.down, pair.cut, pair.active = set(), {"a"}, "b"
    c.submit_report(_report(5))
    assert until(lambda: c.counts.reports_sent == 5)
    assert pair.reports[-1] == ("b", 5)
    pair.down, pair.cut, pair.active = {"b"}, set(), "a"  # b dies as the run closes: the finish goes to a
    assert c.close(5.0, finish=RunFinished(step=5)) and c.counts.finished
    assert pair.served.paths()[-1] == "/v1/runs/run-a/finish" and pair.asked[-1] == "a"
    assert c.counts.reports_dropped == 0 and c.up


def test_controller_urls_must_each_be_http_and_distinct() -> None:
    from trainer_agent.report.client import controller_urls
    from trainer_agent.config import AgentConfig

    assert controller_urls("http://a:1/, https://b:2") == ["http://a:1", "https://b:2"]
    for bad, message in (("http://a,ftp://b", "must start with http"), ("http://a,", "must start with http"),
                         ("http://a,http://a/", "named twice")):
        with pytest.raises(ValueError, match=message):
            controller_urls(bad)
        with pytest.raises(ValueError, match=message):
            AgentConfig(controller=bad)

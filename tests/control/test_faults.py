"""Fail-open: a real controller process behind the fault proxy, the real agent in this process.

For every fault (down at start, black hole, 3 s per answer, connection reset, 500, garbage,
killed and restarted, answers slower than the request timeout): no step waits on the controller, /metrics keeps answering, nothing raises
into the loop, reports resume when the controller is back, a command issued during the fault is
applied afterwards, and ``close()`` returns within its deadline. And ``close()`` tells the
controller the run finished, or, when it black-holes, returns in time anyway.

Time bounds are set by what a regression would cost, not by how fast a step is: a step that
waited on one request to a faulty controller lasts at least the request timeout (or the proxy's
delay), so a step under a fault may take the slowest normal step plus that, and no more. The
figures (how much slower a step is under each fault) are measured by ``bench/fail_open.py``.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import trainer_agent as ta
from trainguard.protocol.wire import RunFinished
from tests.control.procs import TRAINGUARD, ControllerProcess, module_controller, operator_only_rules, until
from tests.tools.faultproxy import FaultProxy

pytestmark = pytest.mark.integration
REQUEST_TIMEOUT_S = 2.0  # the agent's request timeout in these loops (slow mode: longer than SLOW_S)
SLOW_S = 3.0  # the proxy's delay per request in the slow mode


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    yield from module_controller(tmp_path_factory, operator_only=True)


class Loop:
    """A tiny training loop with a 5 ms 'device' wait per step; records each step's wall time."""

    def __init__(self, url: str, run: str, **cfg: object) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.run = run
        t0 = time.monotonic()
        cfg = {"report_every": 1, "metrics_port": 0, "request_timeout_s": REQUEST_TIMEOUT_S, **cfg}
        self.agent = ta.attach(self.model, self.opt, job="faults", run=run,
                               config=ta.AgentConfig(controller=url, **cfg))
        self.attach_s = time.monotonic() - t0

    def steps(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.monotonic()
            x = torch.randn(32, 16)
            loss = self.model(x).pow(2).mean()
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            time.sleep(0.005)
            self.agent.end_step(loss)
            times.append(time.monotonic() - t0)
        return times

    def scrape(self) -> dict[str, float]:
        with urllib.request.urlopen(self.agent.metrics_url, timeout=5) as r:
            text = r.read().decode()
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    def close(self, timeout: float) -> float:
        t0 = time.monotonic()
        self.agent.close(timeout)
        return time.monotonic() - t0


def _recovers(loop: Loop, ctl: ControllerProcess, generation: int) -> None:
    """Train on until the command of ``generation`` is applied and a fresh report arrived."""
    def done() -> bool:
        loop.steps(1)
        detail = ctl.run_detail(loop.run) or {}
        return (loop.agent.control.applied_generation >= generation
                and detail.get("applied_generation") == generation
                and (detail.get("last_step") or 0) >= loop.agent.step - 5)
    assert until(done, 60.0, 0.0), (loop.agent.latest(), ctl.run_detail(loop.run))


@pytest.mark.parametrize("mode", ["blackhole", "slow", "reset", "http500", "garbage"])
def test_fault_mid_run(controller: ControllerProcess, mode: str) -> None:
    with FaultProxy(controller.port) as proxy:
        loop = Loop(proxy.url, f"fault-{mode}", **({"request_timeout_s": SLOW_S + 2.0} if mode == "slow" else {}))
        assert until(lambda: loop.agent.control.client.up, 60.0)  # registered (attach waits one request timeout at most)
        normal = loop.steps(30)
        if mode == "slow":
            proxy.set_mode("pass", latency_s=SLOW_S)
        else:
            proxy.set_mode(mode)  # type: ignore[arg-type]
        faulty = loop.steps(20)
        gen = controller.command(loop.run, "lr-scale", scale=0.5)["desired"]["generation"]
        faulty += loop.steps(20)
        scraped = loop.scrape()  # /metrics answers during the fault
        if mode != "slow":  # the agent notices (a request fails or times out) while the loop goes on
            assert until(lambda: faulty.extend(loop.steps(1)) or loop.scrape()["trainguard_agent_controller_up"] == 0.0,
                         60.0, 0.0), scraped
        # a step that waited on one request would last the request timeout (slow: the delay)
        blocked = SLOW_S if mode == "slow" else REQUEST_TIMEOUT_S
        assert max(faulty) < max(normal) + blocked, (mode, max(normal), [round(t*1e3) for t in faulty])
        proxy.set_mode("pass")
        _recovers(loop, controller, gen)
        assert loop.agent.control.lr_scale == 0.5
        assert loop.agent.latest()["trainguard_agent_errors_total"] == 0.0
        assert loop.close(1.0) < 1.0 + REQUEST_TIMEOUT_S


def test_controller_down_at_start(controller: ControllerProcess) -> None:
    with FaultProxy(controller.port, mode="down") as proxy:
        loop = Loop(proxy.url, "fault-down-at-start")
        # attach waits at most one request timeout for the registration, and not for a retry
        assert loop.attach_s < REQUEST_TIMEOUT_S + 1.0 and loop.agent.control.applied_generation == 0
        faulty = loop.steps(40)
        assert loop.scrape()["trainguard_agent_controller_up"] == 0.0
        proxy.set_mode("pass")
        assert until(lambda: loop.steps(1) and controller.run_detail(loop.run) is not None, 60.0, 0.0)
        gen = controller.command(loop.run, "checkpoint")["desired"]["generation"]
        _recovers(loop, controller, gen)
        normal = loop.steps(30)
        assert max(faulty) < max(normal) + REQUEST_TIMEOUT_S, (max(normal), max(faulty))
        assert loop.close(1.0) < 1.0 + REQUEST_TIMEOUT_S


def test_close_tells_the_controller_the_run_finished(controller: ControllerProcess) -> None:
    loop = Loop(controller.url, "finish-normal")
    loop.steps(12)
    assert loop.close(2.0) < 2.0 + REQUEST_TIMEOUT_S
    assert loop.agent.control.client.counts.finished
    detail = controller.run_detail(loop.run)
    assert (detail["status"], detail["finished_step"], detail["finish_reason"]) == ("finished", 12, "completed")
    events = httpx.get(f"{controller.url}/v1/runs/{loop.run}/events", timeout=10.0).json()
    assert [e["data"] for e in events if e["kind"] == "finished"] == [{"step": 12, "reason": "completed"}]
    table = subprocess.run([TRAINGUARD, "runs", "--url", controller.url], capture_output=True, text=True, timeout=60)
    (row,) = [line.split() for line in table.stdout.splitlines() if line.startswith("finish-normal ")]
    assert row[2:4] == ["finished", "12"], table.stdout + table.stderr
    again = Loop(controller.url, "finish-normal")  # the job restarts under the same run id: live again
    assert controller.run_detail(loop.run)["status"] != "finished"
    again.steps(3)
    try:
        raise RuntimeError("the training loop crashed")
    except RuntimeError:
        again.close(2.0)  # as from a `finally:` of a failing loop
    detail = controller.run_detail(loop.run)
    assert (detail["status"], detail["finished_step"], detail["finish_reason"]) == ("finished", 3, "error: RuntimeError")


def test_close_returns_within_its_deadline_when_the_finish_is_black_holed(controller: ControllerProcess) -> None:
    with FaultProxy(controller.port) as proxy:
        request_timeout = 5.0  # a close that waited for the black-holed finish would last this long
        loop = Loop(proxy.url, "finish-blackhole", request_timeout_s=request_timeout)
        loop.steps(10)
        client = loop.agent.control.client
        assert until(lambda: client.pending() == (0, 0) and client.counts.reports_sent >= 10, 30.0)
        seen: dict[str, object] = {}
        real_close = client.close

        def timed_close(timeout: float, **kw: object) -> bool:  # a spy on the client's close
            t0 = time.monotonic()
            seen["ok"] = real_close(timeout, **kw)  # type: ignore[arg-type]
            seen["s"], seen["deadline"], seen["finish"] = time.monotonic() - t0, timeout, kw.get("finish")
            return bool(seen["ok"])

        client.close = timed_close  # type: ignore[method-assign]
        proxy.set_mode("blackhole")
        elapsed = loop.close(0.5)
        # Nothing else was queued: the sender was still stuck in the finish when the client's
        # deadline came (not the request timeout); its connection was cut then, so every thread
        # had ended when close returned (True), and the run is not marked finished.
        assert seen["ok"] is True and not client.counts.finished, (seen, client.counts.finished)
        assert not any(t.is_alive() for t in client._threads)
        assert seen["deadline"] - 0.05 <= seen["s"] < request_timeout and seen["deadline"] > 0.3
        # The agent's close as a whole keeps its deadline (the /metrics server's shutdown included).
        assert elapsed < request_timeout, elapsed
        assert seen["finish"] == RunFinished(step=10, reason="completed")
        assert controller.run_detail(loop.run)["status"] != "finished"


def test_killed_and_restarted_controller_loses_no_command(tmp_path: Path) -> None:
    ctl = ControllerProcess(tmp_path / "trainguard.db", rules=operator_only_rules(tmp_path)).start()
    try:
        with FaultProxy(ctl.port) as proxy:
            loop = Loop(proxy.url, "fault-kill")
            normal = loop.steps(30)
            gen = ctl.command(loop.run, "lr-scale", scale=0.25)["desired"]["generation"]
            ctl.kill()  # right after committing the command, before the agent may have seen it
            faulty = loop.steps(30)
            assert max(faulty) < max(normal) + REQUEST_TIMEOUT_S
            ctl.start()  # same database, new port
            proxy.set_upstream(ctl.port)
            _recovers(loop, ctl, gen)
            assert loop.agent.control.lr_scale == 0.25
            gen2 = ctl.command(loop.run, "checkpoint")["desired"]["generation"]
            _recovers(loop, ctl, gen2)
            assert loop.close(1.0) < 1.0 + REQUEST_TIMEOUT_S
    finally:
        ctl.kill()


def _steps_flowing(loop: Loop, n: int) -> list[float]:
    """``n`` steps, each report accepted before the next step (a loaded controller cannot fill the buffer)."""
    client, times = loop.agent.control.client, []
    for _ in range(n):
        sent = client.counts.reports_sent
        times += loop.steps(1)
        assert until(lambda: client.counts.reports_sent > sent, 30.0), client.counts
    return times


@pytest.mark.parametrize("slowness", ["proxy-reset", "kept-alive"])
def test_a_controller_slower_than_the_request_timeout_then_normal(controller: ControllerProcess, slowness: str) -> None:
    """Every request takes 2 s, twice the agent's request timeout, for a while; then the controller
    is fast again. ``proxy-reset``: the open connections are reset when its speed changes;
    ``kept-alive``: they are not (a real server's slowness is not per connection)."""
    buffered, timeout = 8, 1.0
    with FaultProxy(controller.port) as proxy:
        loop = Loop(proxy.url, f"slow-{slowness}", request_timeout_s=timeout, max_buffered_reports=buffered)
        client = loop.agent.control.client
        assert until(lambda: client.up, 60.0)
        normal = _steps_flowing(loop, 20)
        slow_from = int(loop.agent.latest()["trainguard_step"])
        accepted = proxy.accepted
        proxy.set_latency(2.0) if slowness == "kept-alive" else proxy.set_mode("pass", latency_s=2.0)
        faulty: list[float] = []
        # Train on until the proxy took 5 new connections: the sender timed out 3 times at least (a
        # timed-out request's connection is closed; the poller's long poll outlasts the delay), and
        # backs off longer each time.
        assert until(lambda: faulty.extend(loop.steps(1)) or proxy.accepted >= accepted + 5, 60.0, 0.0)
        assert client.counts.reports_dropped > 0
        # a step that waited on one request would last the request timeout
        assert max(faulty) < max(normal) + timeout, (max(normal), [round(t * 1e3) for t in faulty])
        recovered_at = int(loop.agent.latest()["trainguard_step"])  # the newest report: the buffer's last
        proxy.set_latency(0.0) if slowness == "kept-alive" else proxy.set_mode("pass")
        buffer = set(range(recovered_at - buffered + 1, recovered_at + 1))
        stored = lambda: {r["steps"][1] for r in controller.reports(loop.run)}  # noqa: E731
        assert until(lambda: buffer <= stored(), 60.0), (sorted(buffer - stored()), client.counts)
        dropped = client.counts.reports_dropped
        _steps_flowing(loop, 20)
        last = int(loop.agent.latest()["trainguard_step"])
        # one report per step, each sent or counted dropped; none dropped once the controller is back
        # (the sender counts a report sent once its answer came back, after the controller stored it)
        assert until(lambda: max(stored()) == last and client.counts.reports_sent + client.counts.reports_dropped == last,
                     30.0), (last, client.counts)
        assert client.pending()[0] == 0
        assert client.counts.reports_dropped == dropped
        missing = set(range(1, last + 1)) - stored()
        # the reports kept in the buffer, and every one after, reached the controller; only reports
        # of the slow while are missing, and each of them was counted dropped
        assert missing and min(missing) > slow_from and max(missing) <= recovered_at - buffered, sorted(missing)
        assert len(missing) <= dropped
        assert loop.scrape()["trainguard_agent_reports_dropped_total"] == dropped
        assert loop.close(1.0) < 1.0 + timeout

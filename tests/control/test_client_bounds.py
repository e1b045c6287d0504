"""ControllerClient against a misbehaving real server: an answer bigger than the cap is not read
past it, a server trickling one byte at a time cannot hold a request past its total bound,
``close()`` ends every thread it started within its deadline (the long-poll included), so that
attaching and closing in a loop does not accumulate threads, a desired state with any field
outside the protocol's bounds is refused (the last valid one stays) and counted as an agent error
with its field and value, and a report refused as too large (413) is counted, not dropped silently."""

from __future__ import annotations

import json
import logging
import socket
import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

import trainer_agent as ta
from trainguard.protocol.wire import DesiredState, Report, RunRegistration, dumps
from tests.control.procs import until
from trainer_agent.report.client import MAX_ANSWER_BYTES, ControllerClient

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


#: One value outside the protocol's bounds for every field of the desired state.
OUT_OF_BOUNDS = [
    ("generation", -1), ("generation", 2**63), ("paused", "maybe"), ("lr_scale", 1e30), ("lr_scale", 1e-300),
    ("lr_scale", 0.0), ("lr_scale", -2.0), ("lr_scale", "NaN"), ("checkpoint_seq", -1), ("checkpoint_seq", 2**63),
    ("stop", 2), ("rollback_seq", -1), ("rollback_step", -5), ("reason", "x" * 2001), ("accumulation_steps", 65537),
    ("accumulation_steps", -1), ("accumulation_lr_rule", "cubic"), ("memory_trace_seq", -1), ("verify_seq", -1),
    ("data_skip_until", -1), ("data_skip_from", -1), ("stop_exit_code", 256), ("grad_clip_norm", -1.0), ("grad_clip_norm", 1e7),
    ("reset_optimizer_seq", -1), ("reset_optimizer_layers", "x" * (64 * 257 + 1)), ("momentum_scale", 0.0),
    ("momentum_scale", 11.0), ("weight_decay_scale", -1.0), ("weight_decay_scale", 101.0),
    ("verify_float32_seq", -1), ("verify_float32_seq", 2**63),
]


class ScriptedController:
    """A RawServer answering registrations, polls and reports with ``state`` (raw JSON, so it may
    break any bound) and reports with ``report_status``."""

    def __init__(self) -> None:
        self.state: dict = {"generation": 1}
        self.report_status = 200
        self.reports = 0
        self.registered_extra = b""  # more fields of the registration answer (raw JSON)
        self.srv = RawServer(self._handle)
        self.url = self.srv.url

    def _handle(self, srv: RawServer, conn: socket.socket, path: str) -> None:
        desired = json.dumps(self.state).encode()
        if path == "/v1/runs":
            _ok(conn, b'{"job":"job-a","run":"run-a","desired":%s%s}' % (desired, self.registered_extra))
        elif path.endswith("/desired"):
            _ok(conn, desired)
        elif path.endswith("/reports"):
            self.reports += 1
            if self.report_status == 413:
                body = b'{"detail":"request body of 9999 bytes exceeds the limit of 1024"}'
                conn.sendall(b"HTTP/1.1 413 Content Too Large\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % len(body) + body)
            else:
                _ok(conn, b'{"desired":%s,"alerts":[]}' % desired)
        else:
            _ok(conn, b"{}")


def test_a_desired_state_out_of_the_protocols_bounds_is_refused_field_by_field() -> None:
    assert {f for f, _ in OUT_OF_BOUNDS} == set(DesiredState.model_fields)  # every field is tried
    ctl = ScriptedController()
    errors: list[tuple[str, str]] = []
    c = ControllerClient(ctl.url, registration=REG, request_timeout_s=5.0, long_poll_s=0.05,
                         on_error=lambda kind, exc: errors.append((kind, str(exc))))
    c.start()
    try:
        assert c.wait_registered(30) == DesiredState(generation=1)
        generation = 1
        for n, (field, value) in enumerate(OUT_OF_BOUNDS, start=1):
            last = c.desired
            ctl.state = {"generation": generation + 1, field: value}
            assert until(lambda n=n: len(errors) >= n, timeout=30), (field, value)
            assert c.desired == last, field  # the last valid state stays
            kind, message = errors[-1]
            assert kind == f"command_out_of_bounds:{field}" and f"{field}={value!r}" in message
            generation += 2
            ctl.state = {"generation": generation, "lr_scale": 0.5}  # a valid command is taken again
            assert until(lambda g=generation: c.desired is not None and c.desired.generation == g, timeout=30)
        # every refusal counted once, though the poller and each report answer got it again and again
        assert c.counts.commands_refused == len(errors) == len(OUT_OF_BOUNDS)
        assert c.desired == DesiredState(generation=generation, lr_scale=0.5)
    finally:
        assert c.close(5.0)
        ctl.srv.close()


def test_the_agent_keeps_its_lr_under_a_huge_lr_scale_and_counts_a_413(caplog: pytest.LogCaptureFixture) -> None:
    """Through the agent: lr_scale 1e30 is not applied (the optimizer keeps the scheduler's LR),
    it is counted in trainguard_agent_errors_total with a log line naming the field and value,
    and a valid scale later is applied; a report refused as too large is counted with a log line
    naming the setting, once."""
    ctl = ScriptedController()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = ta.attach(model, opt, job="job-a", run="run-a", registry=CollectorRegistry(),
                      config=ta.AgentConfig(controller=ctl.url, report_every=1, sync_every=1, metrics_port=None,
                                            request_timeout_s=5.0))
    used: list[float] = []  # the LR each step applied (after the agent's own pre-hook)
    opt.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))

    def step() -> None:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        agent.end_step(loss)

    try:
        with caplog.at_level("WARNING"):
            ctl.state = {"generation": 2, "lr_scale": 1e30}
            assert until(lambda: (step(), agent.latest().get("trainguard_agent_errors_total", 0) >= 1)[1], timeout=60)
            assert agent.control.lr_scale == 1.0 and agent.control.applied_generation == 1
            ctl.state = {"generation": 3, "lr_scale": 0.5}
            assert until(lambda: (step(), agent.control.applied_generation == 3)[1], timeout=60)
            step()
            assert used[-1] == pytest.approx(0.05) and set(used[:-2]) <= {0.1, 0.05}
            assert max(used) == 0.1  # 1e30 never reached the optimizer
            errors = agent.latest()["trainguard_agent_errors_total"]
            ctl.report_status = 413
            sent = ctl.reports
            for _ in range(3):
                assert until(lambda: (step(), ctl.reports > sent)[1], timeout=60)
                sent = ctl.reports
            assert until(lambda: agent.control.client.counts.reports_too_large >= 3, timeout=30)
            assert agent.latest()["trainguard_agent_errors_total"] >= errors + 3
    finally:
        agent.close(timeout=5.0)
        ctl.srv.close()
    logged = [r.getMessage() + (f" {r.exc_info[1]}" if r.exc_info else "") for r in caplog.records]
    assert any("command_out_of_bounds:lr_scale" in m and "lr_scale=1e+30" in m for m in logged)
    too_large = [m for m in logged if "report_too_large" in m]
    assert len(too_large) == 1 and "TRAINGUARD_MAX_WORLD_SIZE" in too_large[0]  # once, though 3 were refused


def test_a_newer_controllers_fields_are_ignored_and_the_rest_applied(caplog: pytest.LogCaptureFixture) -> None:
    """A controller newer than the agent answers with fields the agent's protocol does not have
    (in the registration answer and in the desired state): the agent applies what it knows, refuses
    nothing, and names the unknown fields in one warning each."""
    ctl = ScriptedController()
    ctl.state = {"generation": 3, "lr_scale": 0.5, "a_newer_command_seq": 2}
    ctl.registered_extra = b',"a_newer_answer":{"x":[1,"NaN"]}'
    errors: list[tuple[str, str]] = []
    c = ControllerClient(ctl.url, registration=REG, request_timeout_s=5.0, long_poll_s=0.05,
                         on_error=lambda kind, exc: errors.append((kind, str(exc))))
    with caplog.at_level(logging.WARNING, logger="trainer_agent"):
        c.start()
        try:
            assert c.wait_registered(30) == DesiredState(generation=3, lr_scale=0.5)
            ctl.state = {"generation": 5, "lr_scale": 0.25, "a_newer_command_seq": 3, "reason": "NaN loss"}
            assert until(lambda: c.desired is not None and c.desired.generation == 5, timeout=30)
            assert c.desired == DesiredState(generation=5, lr_scale=0.25, reason="NaN loss")
            assert errors == [] and c.counts.commands_refused == 0
        finally:
            assert c.close(5.0)
            ctl.srv.close()
    named = sorted(name for r in caplog.records if "does not know" in r.getMessage()
                   for name in r.getMessage().split("does not know: ")[1].split(";")[0].split(", "))
    assert named == ["a_newer_answer", "a_newer_command_seq"]  # each once, though answered again and again

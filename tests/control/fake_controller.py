"""A minimal in-process controller speaking the agent's half of the API (register, report, ack,
long-poll, finish), on a real loopback socket, for the client's fault tests (behind the fault
proxy). It records what it received; ``command()`` changes the desired state the way an operator
would (new generation). Every other test uses the real controller (``trainguard serve``).

It refuses what the real API refuses, so a client test cannot pass on a state the real controller
never produces: reports, acks, polls and finishes for a run never registered (404), a run
registered again under another job or a report naming another job (409), per-rank vectors whose
length is not the world size (422), an ack of a generation never published (409); ``command()``
on an unregistered run or with an lr_scale outside (0, 1e6] raises ``ValueError``, and a command
that changes nothing publishes no new generation."""

from __future__ import annotations

import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from trainguard.protocol.wire import (
    Ack, DesiredState, PreflightResult, Report, ReportAccepted, RunFinished, RunRegistered, RunRegistration, dumps,
)


class FakeController:
    def __init__(self, *, token: str | None = None) -> None:
        self.token = token
        self.lock = threading.Condition()
        self.desired: dict[str, DesiredState] = {}
        self.registrations: list[RunRegistration] = []
        self.reports: list[Report] = []
        self.acks: list[Ack] = []
        self.preflights: list[PreflightResult] = []
        self.finishes: list[RunFinished] = []
        self.jobs: dict[str, tuple[str, int]] = {}  # run -> (job, world_size)
        self.requests = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms ACK stalls

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _authorised(self) -> bool:
                if owner.token and self.headers.get("authorization") != f"Bearer {owner.token}":
                    self._send(401, b'{"detail":"bad token"}')
                    return False
                return True

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                with owner.lock:
                    owner.requests += 1
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if not self._authorised():
                    return
                parts = urlparse(self.path).path.strip("/").split("/")
                if parts == ["v1", "runs"]:
                    reg = RunRegistration.model_validate_json(body)
                    with owner.lock:
                        if owner.jobs.get(reg.run, (reg.job,))[0] != reg.job:
                            self._send(409, b'{"detail":"run registered for another job"}')
                            return
                        owner.jobs[reg.run] = (reg.job, reg.world_size)
                        owner.registrations.append(reg)
                        d = owner.desired.setdefault(reg.run, DesiredState())
                    self._send(200, dumps(RunRegistered(job=reg.job, run=reg.run, desired=d)))
                elif len(parts) == 4 and parts[:2] == ["v1", "runs"] and parts[3] == "preflight":
                    with owner.lock:
                        owner.preflights.append(PreflightResult.model_validate_json(body))
                        owner.lock.notify_all()
                    self._send(200, b"{}")
                elif len(parts) == 4 and parts[:2] == ["v1", "runs"] and parts[3] in ("reports", "acks", "finish"):
                    run = parts[2]
                    with owner.lock:
                        if run not in owner.jobs:
                            self._send(404, b'{"detail":"unknown run"}')
                            return
                        job, world = owner.jobs[run]
                        if parts[3] == "reports":
                            report = Report.model_validate_json(body)
                            if report.job != job:
                                self._send(409, b'{"detail":"the report names another job"}')
                                return
                            if any(v and len(v) != world for v in report.ranks.model_dump().values()):
                                self._send(422, b'{"detail":"a rank vector is not world_size long"}')
                                return
                            owner.reports.append(report)
                            answer = dumps(ReportAccepted(desired=owner.desired[run]))
                        elif parts[3] == "acks":
                            ack = Ack.model_validate_json(body)
                            if ack.generation > owner.desired[run].generation:
                                self._send(409, b'{"detail":"generation never published"}')
                                return
                            owner.acks.append(ack)
                            answer = b"{}"
                        else:
                            fin = RunFinished.model_validate_json(body)
                            owner.finishes.append(fin)
                            answer = json.dumps({"run": run, "status": "finished", "finished_at": 0.0,
                                                 "finished_step": fin.step, "finish_reason": fin.reason,
                                                 "changed": len(owner.finishes) == 1}).encode()
                        owner.lock.notify_all()
                    self._send(200, answer)
                else:
                    self._send(404, b'{"detail":"no route"}')

            def do_GET(self) -> None:  # noqa: N802
                with owner.lock:
                    owner.requests += 1
                if not self._authorised():
                    return
                url = urlparse(self.path)
                parts = url.path.strip("/").split("/")
                if len(parts) != 4 or parts[3] != "desired":
                    self._send(404, b'{"detail":"no route"}')
                    return
                q = parse_qs(url.query)
                after = int(q.get("after", ["0"])[0])
                wait = float(q.get("wait", ["0"])[0])
                with owner.lock:
                    if parts[2] not in owner.jobs:
                        self._send(404, b'{"detail":"unknown run"}')
                        return
                    owner.lock.wait_for(lambda: owner.desired[parts[2]].generation > after, timeout=wait)
                    d = owner.desired[parts[2]]
                self._send(200, dumps(d))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def command(self, run: str, **changes: object) -> DesiredState:
        """Change the desired state of a registered ``run`` (absolute values) and bump its
        generation; a change to nothing new publishes nothing (as the real controller)."""
        scale = changes.get("lr_scale", 1.0)
        if not isinstance(scale, (int, float)) or not (0 < scale <= 1e6 and math.isfinite(scale)):
            raise ValueError(f"lr_scale must be a finite number in (0, 1e6], got {scale!r}")
        with self.lock:
            if run not in self.jobs:
                raise ValueError(f"run {run!r} is not registered (the real API answers 404)")
            cur = self.desired[run]
            if all(getattr(cur, k) == v for k, v in changes.items() if k != "reason"):
                return cur
            new = cur.model_copy(update={**changes, "generation": cur.generation + 1})
            self.desired[run] = DesiredState.model_validate(json.loads(dumps(new)))
            self.lock.notify_all()
            return self.desired[run]

    def wait_for(self, predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
        with self.lock:
            return self.lock.wait_for(predicate, timeout=timeout)

    def close(self) -> None:
        with self.lock:
            self.lock.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeController:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rank_controller(rank: int) -> tuple[FakeController | None, str]:
    """In a gloo rank of a test (the default group initialised): a fake controller on rank 0, and
    its URL on every rank (a collective: every rank calls this)."""
    import torch.distributed as dist

    fake = FakeController() if rank == 0 else None
    url = [fake.url if fake else None]
    dist.broadcast_object_list(url, src=0)
    return fake, str(url[0])


def finish_rank(agent: object, fake: FakeController | None, result: object, out: str, rank: int) -> None:
    """Close the rank's agent and fake controller, leave the process group, save ``result``."""
    import torch
    import torch.distributed as dist

    agent.close(3.0)  # type: ignore[attr-defined]
    if fake is not None:
        fake.close()
    dist.destroy_process_group()
    torch.save(result, f"{out}/rank{rank}.pt")

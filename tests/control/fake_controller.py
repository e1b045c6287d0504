"""A minimal in-process controller speaking the agent's half of the API (register, report, ack,
long-poll), on a real loopback socket, for the client's unit and fault tests. It records what it
received; ``command()`` changes the desired state the way an operator would (new generation).
The real controller (``service``) is used by the multi-process and end-to-end tests."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from trainguard.protocol.wire import Ack, DesiredState, PreflightResult, Report, ReportAccepted, RunRegistered, RunRegistration, dumps


class FakeController:
    def __init__(self, *, token: str | None = None) -> None:
        self.token = token
        self.lock = threading.Condition()
        self.desired: dict[str, DesiredState] = {}
        self.registrations: list[RunRegistration] = []
        self.reports: list[Report] = []
        self.acks: list[Ack] = []
        self.preflights: list[PreflightResult] = []
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
                        owner.registrations.append(reg)
                        d = owner.desired.setdefault(reg.run, DesiredState())
                    self._send(200, dumps(RunRegistered(job=reg.job, run=reg.run, desired=d)))
                elif len(parts) == 4 and parts[:2] == ["v1", "runs"] and parts[3] == "preflight":
                    with owner.lock:
                        owner.preflights.append(PreflightResult.model_validate_json(body))
                        owner.lock.notify_all()
                    self._send(200, b"{}")
                elif len(parts) == 4 and parts[:2] == ["v1", "runs"] and parts[3] in ("reports", "acks"):
                    run = parts[2]
                    with owner.lock:
                        if run not in owner.desired:
                            self._send(404, b'{"detail":"unknown run"}')
                            return
                        if parts[3] == "reports":
                            owner.reports.append(Report.model_validate_json(body))
                            answer = dumps(ReportAccepted(desired=owner.desired[run]))
                        else:
                            owner.acks.append(Ack.model_validate_json(body))
                            answer = b"{}"
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
                    if parts[2] not in owner.desired:
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
        """Change the desired state of ``run`` (absolute values) and bump its generation."""
        with self.lock:
            cur = self.desired.setdefault(run, DesiredState())
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

"""trainer_agent/report/client.py's report bodies: what the agent posts for a 4,096-rank job carries the
per-rank vectors packed (``trainguard.protocol.rank_vector``), a fraction of the JSON lists, and
decodes to the values the agent had (NaN included)."""

from __future__ import annotations

import base64
import http.server
import json
import math
import struct
import threading
import time

from tests.control.procs import until
from trainer_agent.report.client import ControllerClient
from trainguard.protocol.rank_values import RankValues
from trainguard.protocol.wire import DesiredState, Report, RunRegistration, dumps

WORLD = 4096


class _Recorder(http.server.ThreadingHTTPServer):
    """A loopback controller that answers registrations and reports and keeps the report bodies."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["content-length"]))
                desired = json.loads(dumps(DesiredState()))
                if self.path.endswith("/reports"):
                    recorder.bodies.append(body)
                    answer = {"desired": desired, "alerts": []}
                else:
                    answer = {"job": "job-a", "run": "run-a", "desired": desired}
                out = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self) -> None:  # noqa: N802 - the long poll: nothing new
                time.sleep(0.2)
                self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_the_agent_posts_its_per_rank_vectors_packed() -> None:
    loss = [float(struct.unpack("<f", struct.pack("<f", 2.0 + r / WORLD))[0]) for r in range(WORLD)]  # float32 values
    loss[7] = math.nan
    step = [0.8 + r * 1e-6 for r in range(WORLD)]
    report = Report(job="job-a", step_first=1, step_last=1, time=1.0, values={"trainguard_loss": 2.0},
                    ranks=RankValues(loss=loss, step_time_s=step, grad_fingerprint=[3.25] * WORLD))
    srv = _Recorder()
    client = ControllerClient(f"http://127.0.0.1:{srv.server_address[1]}",
                              registration=RunRegistration(job="job-a", run="run-a", world_size=WORLD),
                              request_timeout_s=30.0, long_poll_s=0.5)
    try:
        client.start()
        client.wait_registered(60)
        client.submit_report(report)
        assert until(lambda: srv.bodies, timeout=60)
    finally:
        client.close(5.0)
        srv.shutdown()
    body = srv.bodies[0]
    ranks = json.loads(body)["ranks"]
    assert ranks["grad_fingerprint"] == {"fill": 3.25, "n": WORLD}
    assert base64.b64decode(ranks["loss"]["float32"]) == struct.pack(f"<{WORLD}f", *loss)
    assert base64.b64decode(ranks["step_time_s"]["float32"]) == struct.pack(f"<{WORLD}f", *step)  # a timing: float32
    lists = json.dumps(report.model_dump(), separators=(",", ":")).encode()  # the JSON lists agents sent before
    assert len(body) < len(lists) / 2.5
    back = Report.model_validate_json(body).ranks
    assert [x for i, x in enumerate(back.loss) if i != 7] == [x for i, x in enumerate(loss) if i != 7]
    assert math.isnan(back.loss[7])

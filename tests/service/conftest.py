"""Fixtures of the controller tests: an app on a temporary database, report builders."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.rules import default_rules_text, load_rules
from trainguard.protocol.wire import Report


def make_report(step: int, t: float, values: dict[str, float] | None = None, job: str = "job-a", **ranks: list[float]) -> Report:
    return Report(job=job, step_first=step, step_last=step, time=t, values=values or {}, ranks=ranks)


@pytest.fixture
def app_factory(tmp_path: Path) -> Iterator[Callable[..., contextlib.AbstractContextManager[TestClient]]]:
    """``with app_factory(**settings) as client``: a started app on ``tmp_path/tg.db``."""

    @contextlib.contextmanager
    def factory(*, clock: Callable[[], float] | None = None, transport: Any = None, **overrides: Any) -> Iterator[TestClient]:
        settings = Settings(db=tmp_path / "tg.db", **overrides)
        app = create_app(settings, clock=clock, transport=transport)
        with TestClient(app) as client:
            yield client

    yield factory


def register(client: TestClient, run: str = "run-1", job: str = "job-a", world_size: int = 4, headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = {
        "job": job, "run": run, "world_size": world_size, "agent_version": "test",
        "ranks": [{"rank": r, "local_rank": r, "host": "127.0.0.1", "port": 9100 + r} for r in range(world_size)],
    }
    resp = client.post("/v1/runs", json=body, headers=headers or {})
    assert resp.status_code == 200, resp.text
    return resp.json()


class Receiver:
    """A real local HTTP server recording POSTs and answering scripted status codes (the last
    one repeats). A status of 0 means: hold the request open (never answer)."""

    def __init__(self, statuses: list[int]) -> None:
        import http.server
        import threading

        self.statuses = list(statuses)
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status = outer.statuses.pop(0) if len(outer.statuses) > 1 else outer.statuses[0]
                if status == 0:
                    outer.release.wait(30)
                    return
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver_factory() -> Iterator[Callable[[list[int]], Receiver]]:
    made: list[Receiver] = []

    def factory(statuses: list[int]) -> Receiver:
        made.append(Receiver(statuses))
        return made[-1]

    yield factory
    for r in made:
        r.close()


def rule_evaluations(metrics_text: str) -> float:
    """The controller's rule evaluations so far (reports' and the absence ticker's), from its /metrics."""
    (line,) = [ln for ln in metrics_text.splitlines() if ln.startswith("trainguard_controller_rule_evaluations_total ")]
    return float(line.split()[1])


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, every: float = 0.02) -> Any:
    """Poll ``predicate`` until it is truthy; fail the test after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(every)


class Served:
    """A real ``trainguard serve`` process on a free loopback port."""

    def __init__(self, db: Path, env: dict[str, str] | None = None, extra: list[str] | None = None, port: int = 0) -> None:
        import os
        import subprocess
        import sys
        import threading

        self.env = dict(os.environ) | (env or {})
        cmd = [sys.executable, "-m", "trainguard.cli", "serve", "--port", str(port), "--db", str(db), "--log-level", "warning", *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)
        line = self.proc.stdout.readline()  # "trainguard controller listening on http://127.0.0.1:PORT ..."
        if "listening on" not in line:
            self.proc.kill()
            raise AssertionError(f"trainguard serve did not start: {line}{self.proc.stdout.read()}")
        self.url = line.split("listening on ")[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1].strip("/"))
        self.output: list[str] = []  # what it printed after starting (drained: a full pipe would block it)
        threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()

    def _drain(self, out) -> None:  # type: ignore[no-untyped-def]
        with out:
            self.output.extend(out)

    def wait_ready(self, timeout: float = 60.0) -> "Served":
        """Wait until ``/readyz`` answers 200 (a controller sharing a PostgreSQL database listens
        at once but serves only once it holds the writer lease)."""
        import httpx

        wait_until(lambda: httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200, timeout=timeout)
        return self

    def kill(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def serve() -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(db: Path, env: dict[str, str] | None = None, extra: list[str] | None = None, port: int = 0) -> Served:
        started.append(Served(db, env, extra, port))
        return started[-1]

    yield start
    for s in started:
        s.stop()


_LADDER = load_rules(default_rules_text()).file.recovery
#: Steps between two reports of :func:`climb_ladder`: a rung's window of reports and its window of
#: steps end at the same report.
LADDER_STRIDE = max(1, -(-_LADDER.window_steps // _LADDER.window_reports))
_OPENS = 5  # the report whose gradient norm opens the incident
#: The steps at which :func:`climb_ladder`'s incident opens, rolls back, and pauses (escalated).
LADDER_STEPS = {rung: (_OPENS + i * _LADDER.window_reports) * LADDER_STRIDE
                for i, rung in enumerate(("adaptive_lr", "rollback", "pause"))}


def climb_ladder(client: Any, run: str = "run-1", job: str = "job-a", *, after: int = 0,
                 until: int = LADDER_STEPS["pause"], headers: dict[str, str] | None = None) -> None:
    """Drive one incident of ``run`` up the default rules' ladder with a report every
    ``LADDER_STRIDE`` steps, from the first after step ``after`` to step ``until``: healthy reports
    that make the snapshot of the second report's step good, then a gradient norm above the limit
    from the fifth report on. The rule's adaptive LR opens the incident; with the signals not back
    after a rung's window the ladder rolls back to that snapshot, then pauses: escalated
    (:data:`LADDER_STEPS`). ``client``: a TestClient or an httpx client of the controller;
    ``headers`` (e.g. an agent token's) go with every report."""
    snapshot = 2 * LADDER_STRIDE
    for step in range(after - after % LADDER_STRIDE + LADDER_STRIDE, until + 1, LADDER_STRIDE):
        values = {"trainguard_grad_norm_max": 1.0 if step < LADDER_STEPS["adaptive_lr"] else 3000.0}
        if step >= snapshot:
            values["trainguard_snapshot_step"] = float(snapshot)
        body = {"job": job, "step_first": step, "step_last": step, "time": float(step), "values": values}
        resp = client.post(f"/v1/runs/{run}/reports", json=body, headers=headers or {})
        assert resp.status_code == 200, resp.text


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Any]:
    """A private PostgreSQL server for the session (tests/service/postgres.py); skipped only where
    Debian's server binaries are not installed (scripts/setup.sh installs them)."""
    from tests.service.postgres import PostgresCluster, server_binaries

    if server_binaries() is None:
        pytest.skip("PostgreSQL server binaries not installed (initdb, pg_ctl under /usr/lib/postgresql/*/bin): run scripts/setup.sh")
    pytest.importorskip("psycopg", reason="the postgres extra is not installed: pip install -e '.[postgres]'")
    cluster = PostgresCluster()
    yield cluster
    cluster.stop()


@pytest.fixture
def postgres_url(postgres_cluster: Any) -> str:
    """The URL of a new, empty database on the session's PostgreSQL server."""
    return postgres_cluster.create_database()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_db(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    """Each backend in turn: a SQLite file in ``tmp_path``, then a new PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "tg.db"
    return request.getfixturevalue("postgres_url")

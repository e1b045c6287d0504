"""Controller failover benchmark: two ``trainguard serve`` on one PostgreSQL database (a private
server started from Debian's binaries, fsync on), an open-loop load of reports, and ``--rounds``
SIGKILLs of the active controller.

Each round: the active is SIGKILLed; the standby (listening, but answering 503 while it waits
for the writer lease) takes the lease once it expires, loads the state and serves; the load
generator, which posts ``--rate`` reports/s round-robin over ``--runs`` runs to the controller
last seen ready, moves to it;
the killed one is started again and becomes the next standby. Printed per round: the time from the
SIGKILL until the standby answers ``/readyz`` 200, the reports posted meanwhile that got no answer
(the agents' fail-open window: they are retried by the next report), and at the end the reports
acknowledged (200) that the database does not hold (must be 0) and the acknowledged commands whose
desired state changed (must be 0).

    .venv/bin/python bench/controller_failover.py --rounds 5 --rate 100

Not measured here (issue 26): a real 2-rank training job's longest step during the failover, and
cutting the active's database connection instead of killing it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.service.postgres
from tests.service.postgres import PostgresCluster  # noqa: E402

_LOOPBACK = "127.0.0.1"


class _Controller:
    """One ``trainguard serve``; ``url`` is set once it listens, ``active`` once it answered ``/readyz`` 200."""

    def __init__(self, db: str) -> None:
        env = dict(os.environ, TRAINGUARD_OPERATOR_TOKENS="", TRAINGUARD_AGENT_TOKENS="")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.cli", "serve", "--host", _LOOPBACK, "--port", "0", "--db", db,
             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            cwd=Path(__file__).resolve().parents[1])
        self.url: str | None = None
        self.listening = threading.Event()
        self.active = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if self.url is None and "listening on " in line:
                self.url = line.split("listening on ")[1].split()[0]
                self.listening.set()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


class _Load:
    """Open loop: a report due every 1/rate s, posted to the controller that answers."""

    def __init__(self, controllers: list[_Controller], runs: list[str], rate: float) -> None:
        self.controllers, self.runs, self.rate = controllers, runs, rate
        self.acked: list[tuple[str, int]] = []
        self.unanswered = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _target(self) -> str | None:
        for c in reversed(self.controllers):
            if c.url and c.active and c.proc.poll() is None:
                return c.url
        return None

    def _loop(self) -> None:
        step, due = 0, time.monotonic()
        with httpx.Client(timeout=2.0) as client:
            while not self.stop.is_set():
                due += 1 / self.rate
                time.sleep(max(0.0, due - time.monotonic()))
                step += 1
                run = self.runs[step % len(self.runs)]
                url = self._target()
                body = {"job": "failover-job", "step_first": step, "step_last": step, "time": float(step),
                        "values": {"trainguard_loss": 2.0, "trainguard_grad_norm_max": 1.0}}
                try:
                    if url is None:
                        raise httpx.ConnectError("no controller listens")
                    r = client.post(f"{url}/v1/runs/{run}/reports", json=body)
                    if r.status_code == 200:
                        self.acked.append((run, step))
                    else:
                        self.unanswered += 1
                except httpx.HTTPError:
                    self.unanswered += 1


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rate", type=float, default=100.0, help="reports/s offered")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--settle-s", type=float, default=3.0, help="load between two kills")
    args = p.parse_args()
    if args.rounds < 1 or args.runs < 1 or not (0 < args.rate <= 10_000):
        p.error("--rounds and --runs must be >= 1, --rate in (0, 10000]")
    cluster = PostgresCluster(durable=True)
    controllers: list[_Controller] = []
    try:
        db = cluster.create_database("failover")
        controllers.append(_Controller(db))
        if not controllers[0].listening.wait(120):
            raise SystemExit("the first controller did not start")
        while not _ready(controllers[0].url):
            time.sleep(0.05)
        controllers[0].active = True
        runs = [f"failover-run-{i}" for i in range(args.runs)]
        with httpx.Client(base_url=controllers[0].url, timeout=10) as c:
            for run in runs:
                c.post("/v1/runs", json={"job": "failover-job", "run": run, "world_size": 1,
                                         "ranks": [{"rank": 0, "local_rank": 0, "host": _LOOPBACK, "port": 9000}]}).raise_for_status()
            paused = c.post(f"/v1/runs/{runs[0]}/pause", json={"reason": "acknowledged before the failovers"}).json()["desired"]
        controllers.append(_Controller(db))  # the standby
        load = _Load(controllers, runs, args.rate)
        load.thread.start()
        rows = []
        for i in range(args.rounds):
            time.sleep(args.settle_s)
            active, standby = controllers[-2], controllers[-1]
            before = load.unanswered
            killed_at = time.monotonic()
            active.kill()
            if not standby.listening.wait(120):
                raise SystemExit(f"round {i + 1}: the standby did not take over")
            while not _ready(standby.url):
                time.sleep(0.05)
            standby.active = True
            rows.append((i + 1, time.monotonic() - killed_at, load.unanswered - before))
            controllers.append(_Controller(db))  # the killed one comes back as the next standby
        time.sleep(args.settle_s)
        load.stop.set()
        load.thread.join(10)
        active = controllers[-2]
        import psycopg

        with psycopg.connect(db) as raw:
            stored = set(raw.execute("SELECT r.run, p.step_last FROM reports p JOIN runs r ON r.id = p.run_id").fetchall())
        lost = [a for a in load.acked if a not in stored]
        desired = httpx.get(f"{active.url}/v1/runs/{runs[0]}", timeout=10).json()["desired"]
    finally:
        for c in controllers:
            if c.proc.poll() is None:
                c.proc.terminate()
                try:
                    c.proc.wait(15)
                except subprocess.TimeoutExpired:
                    c.kill()
        cluster.stop()
    print(f"controller failover: {args.rounds} SIGKILLs of the active, {args.rate:.0f} reports/s offered over {args.runs} runs, "
          f"PostgreSQL {cluster.bindir.parent.name} (private, fsync on)")
    print(f"  {'round':>5} {'serving again':>14} {'reports unanswered meanwhile':>29}")
    for n, s, u in rows:
        print(f"  {n:>5} {s:>12.2f} s {u:>29}")
    times = sorted(s for _, s, _ in rows)
    print(f"  serving again: median {times[len(times) // 2]:.2f} s, max {times[-1]:.2f} s (target <= 10 s: "
          f"{'PASS' if times[-1] <= 10 else 'FAIL'})")
    print(f"  reports acknowledged {len(load.acked)}, acknowledged and then lost {len(lost)} (must be 0)")
    same = desired == paused
    print(f"  the pause acknowledged before the failovers: {'kept' if same else 'CHANGED'} (generation {desired['generation']})")
    return 0 if not lost and same else 1


if __name__ == "__main__":
    sys.exit(main())

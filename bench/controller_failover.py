"""Controller failover benchmark: two ``trainguard serve`` on one PostgreSQL database (a private
server started from Debian's binaries, fsync on), an open-loop load of reports, a real 2-rank
training job whose agents know both controllers, and rounds that take the active one away.

Each controller listens on a port of its own (A, B) and reaches the database through a TCP proxy
of its own, so that its connection can be cut without touching the other's. Rounds:

- ``kill`` (``--kills``): the active is SIGKILLed. The standby (listening, answering 503 while it
  waits for the writer lease) takes the lease once it expires, loads the state and serves. The
  killed one is started again on its port and becomes the next standby.
- ``cut`` (``--cuts``): the active's database connections are reset and new ones refused (its
  process lives on, answering 503 as its writes fail). The standby takes the lease once it
  expires. Then the connection comes back: the deposed controller must never write again — a
  report posted to it is refused and not stored (fencing). It is then restarted as the standby.

Printed per round: the time from the fault until the standby answers ``/readyz`` 200 and the
load's reports posted meanwhile that got no answer (the agents' fail-open window: they are
retried). At the end: the load's reports acknowledged (200) that the database does not hold
(must be 0), the pause acknowledged before the rounds (must be kept), the reports the deposed
controllers stored after their cut (must be 0), and the training job: its steps, the reports its
leader had acknowledged against those stored, and its step times inside the failover windows (from each fault to 1 s after the standby served)
and outside them — median, p99, longest (the target: no step blocked beyond its normal time).

    .venv/bin/python bench/controller_failover.py --kills 3 --cuts 2 --rate 100
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tests.service.postgres, tests.tools.faultproxy
from tests.service.postgres import PostgresCluster  # noqa: E402
from tests.tools.faultproxy import FaultProxy  # noqa: E402

_LOOPBACK = "127.0.0.1"
_JOB_RUN = "failover-train"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((_LOOPBACK, 0))
        return s.getsockname()[1]


class _Controller:
    """One ``trainguard serve`` on ``port``, reaching PostgreSQL through its own proxy;
    ``active`` once it answered ``/readyz`` 200."""

    def __init__(self, cluster: PostgresCluster, db: str, port: int) -> None:
        self.proxy = FaultProxy(cluster.port)
        self.db = db.replace(f":{cluster.port}/", f":{self.proxy.port}/")
        self.port, self.url, self.active = port, f"http://{_LOOPBACK}:{port}", False
        env = dict(os.environ, TRAINGUARD_OPERATOR_TOKENS="", TRAINGUARD_AGENT_TOKENS="")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.cli", "serve", "--host", _LOOPBACK, "--port", str(port), "--db", self.db,
             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)

    def wait_ready(self, timeout: float = 120.0) -> float:
        """Seconds until ``/readyz`` answered 200."""
        t0 = time.monotonic()
        while not _ready(self.url):
            if time.monotonic() - t0 > timeout or self.proc.poll() is not None:
                raise SystemExit(f"the controller on port {self.port} did not become ready")
            time.sleep(0.05)
        self.active = True
        return time.monotonic() - t0

    def kill(self) -> None:
        self.active = False
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proxy.close()

    def stop(self) -> None:
        self.active = False
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self.proxy.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class _Load:
    """Open loop: a report due every 1/rate s, posted to the controller known active."""

    def __init__(self, slots: list[_Controller], runs: list[str], rate: float) -> None:
        self.slots, self.runs, self.rate = slots, runs, rate
        self.acked: list[tuple[str, int]] = []
        self.unanswered = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _target(self) -> str | None:
        return next((c.url for c in self.slots if c.active), None)

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
                        raise httpx.ConnectError("no controller is active")
                    r = client.post(f"{url}/v1/runs/{run}/reports", json=body)
                    if r.status_code == 200:
                        self.acked.append((run, step))
                    else:
                        self.unanswered += 1
                except httpx.HTTPError:
                    self.unanswered += 1


# -- the training job (one process per rank) ----------------------------------------------------
def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_agent as ta

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    ddp, opt = DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-3)
    agent = ta.attach(ddp, opt, job="failover-job", run=_JOB_RUN,
                      config=ta.AgentConfig(controller=args.controller, report_every=5, metrics_port=None))
    steps: list[tuple[float, float]] = []  # (wall time at the step's end, seconds the step took)
    stop = Path(args.stop_file)
    n = 0
    while True:
        n += 1
        t0 = time.perf_counter()
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank * 7919 + n))
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(args.device_ms / 1e3)  # emulated device time
        agent.end_step(loss)
        steps.append((time.time(), time.perf_counter() - t0))
        flag = torch.tensor([1 if stop.exists() else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if flag.item():
            break
    client = agent.control.client
    agent.close(10.0)
    sent = client.counts.reports_sent if client is not None else 0
    Path(args.out).with_suffix(f".{rank}.json").write_text(json.dumps({"steps": steps, "reports_sent": sent}))
    dist.destroy_process_group()


def _start_job(controller: str, out: Path, stop_file: Path, device_ms: float) -> list[subprocess.Popen]:
    env = dict(os.environ, MASTER_ADDR=_LOOPBACK, MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               TRAINGUARD_TOKEN="", OMP_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, __file__, "--worker", "--controller", controller, "--out", str(out),
                              "--stop-file", str(stop_file), "--device-ms", str(device_ms)],
                             env=dict(env, RANK=str(r)), cwd=ROOT) for r in range(2)]


def _wait_for_job(url: str, job: list[subprocess.Popen], timeout: float = 300.0) -> None:
    """Until the job's leader has had two reports acknowledged (the job trains and reports)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in job):
            raise SystemExit("a rank of the training job ended before it trained")
        r = httpx.get(f"{url}/v1/runs/{_JOB_RUN}", timeout=5.0)
        if r.status_code == 200 and r.json()["reports"] >= 2:
            return
        time.sleep(0.2)
    raise SystemExit("the training job did not report")


# -- the rounds -----------------------------------------------------------------------------------
def _round(kind: str, slots: list[_Controller], cluster: PostgresCluster, db: str,
           load: _Load) -> tuple[float, float, int, float]:
    """One fault of the active: (wall time of the fault, seconds until the standby served, the
    load's reports unanswered meanwhile, wall time when it served)."""
    active = next(c for c in slots if c.active)
    standby = next(c for c in slots if c is not active)
    before, t0, start = load.unanswered, time.monotonic(), time.time()
    if kind == "kill":
        active.kill()
    else:
        active.proxy.set_mode("reset")  # every connection to the database cut, new ones refused
        active.active = False
    standby.wait_ready()
    took, served, unanswered = time.monotonic() - t0, time.time(), load.unanswered - before
    if kind == "cut":
        active.proxy.set_mode("pass")  # the database is reachable again: the deposed one must not write
        probe = {"job": "failover-job", "step_first": 10**9, "step_last": 10**9, "time": 1.0, "values": {"trainguard_loss": 1.0}}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # give it every chance to write
            try:
                httpx.post(f"{active.url}/v1/runs/failover-run-0/reports", json=probe, timeout=2.0)
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        active.stop()
    slots[slots.index(active)] = _Controller(cluster, db, active.port)  # back as the next standby
    return start, took, unanswered, served


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=3, help="rounds that SIGKILL the active")
    p.add_argument("--cuts", type=int, default=2, help="rounds that cut the active's database connection")
    p.add_argument("--rate", type=float, default=100.0, help="reports/s offered by the load")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--settle-s", type=float, default=4.0, help="load between two rounds")
    p.add_argument("--device-ms", type=float, default=20.0, help="emulated device time of a training step")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--controller", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--stop-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return 0
    if args.kills < 0 or args.cuts < 0 or args.kills + args.cuts < 1 or args.runs < 1 or not 0 < args.rate <= 10_000:
        p.error("--kills and --cuts >= 0 (one round at least), --runs >= 1, --rate in (0, 10000]")
    cluster = PostgresCluster(durable=True)
    tmp = Path(tempfile.mkdtemp(prefix="trainguard-failover-"))
    slots: list[_Controller] = []
    job: list[subprocess.Popen] = []
    rows = []
    try:
        db = cluster.create_database("failover")
        slots.append(_Controller(cluster, db, _free_port()))
        slots[0].wait_ready()
        slots.append(_Controller(cluster, db, _free_port()))  # the standby
        runs = [f"failover-run-{i}" for i in range(args.runs)]
        with httpx.Client(base_url=slots[0].url, timeout=10) as c:
            for run in runs:
                c.post("/v1/runs", json={"job": "failover-job", "run": run, "world_size": 1,
                                         "ranks": [{"rank": 0, "local_rank": 0, "host": _LOOPBACK, "port": 9000}]}).raise_for_status()
            paused = c.post(f"/v1/runs/{runs[0]}/pause", json={"reason": "acknowledged before the failovers"}).json()["desired"]
        stop_file = tmp / "stop"
        job = _start_job(",".join(c.url for c in slots), tmp / "job", stop_file, args.device_ms)
        _wait_for_job(slots[0].url, [proc for proc in job])
        load = _Load(slots, runs, args.rate)
        load.thread.start()
        for kind in ["kill"] * args.kills + ["cut"] * args.cuts:
            time.sleep(args.settle_s)
            start, took, unanswered, end = _round(kind, slots, cluster, db, load)
            rows.append((kind, took, unanswered, start, end))
        time.sleep(args.settle_s)
        stop_file.touch()
        for proc in job:
            proc.wait(120)
        load.stop.set()
        load.thread.join(10)
        active = next(c for c in slots if c.active)
        import psycopg

        with psycopg.connect(db) as raw:
            stored = set(raw.execute("SELECT r.run, p.step_last FROM reports p JOIN runs r ON r.id = p.run_id").fetchall())
            job_stored = raw.execute("SELECT count(*) FROM reports p JOIN runs r ON r.id = p.run_id WHERE r.run = %s",
                                     (_JOB_RUN,)).fetchone()[0]
        lost = [a for a in load.acked if a not in stored]
        after_cut = sum(1 for run, step in stored if step == 10**9)
        desired = httpx.get(f"{active.url}/v1/runs/{runs[0]}", timeout=10).json()["desired"]
        ranks = [json.loads((tmp / f"job.{r}.json").read_text()) for r in range(2)]
    finally:
        for proc in job:
            if proc.poll() is None:
                proc.kill()
        for c in slots:
            c.stop()
        cluster.stop()
    print(f"controller failover: {args.kills} SIGKILLs and {args.cuts} database cuts of the active; "
          f"{args.rate:.0f} reports/s offered over {args.runs} runs; a 2-rank gloo job (device time {args.device_ms:g} ms/step) "
          f"given both controllers' URLs; PostgreSQL {cluster.bindir.parent.name} (private, fsync on)")
    print(f"  {'round':>5} {'fault':>5} {'serving again':>14} {'reports unanswered meanwhile':>29}")
    for i, (kind, took, unanswered, _, _) in enumerate(rows, 1):
        print(f"  {i:>5} {kind:>5} {took:>12.2f} s {unanswered:>29}")
    times = sorted(r[1] for r in rows)
    print(f"  serving again: median {times[len(times) // 2]:.2f} s, max {times[-1]:.2f} s (target <= 10 s: "
          f"{'PASS' if times[-1] <= 10 else 'FAIL'})")
    print(f"  load reports acknowledged {len(load.acked)}, acknowledged and then lost {len(lost)} (must be 0)")
    same = desired == paused
    print(f"  the pause acknowledged before the rounds: {'kept' if same else 'CHANGED'} (generation {desired['generation']})")
    print(f"  reports a deposed controller stored after its cut: {after_cut} (must be 0)")
    steps = [d for _, d in ranks[0]["steps"]]
    windows = [(s, e) for *_, s, e in rows]
    during = [d for t, d in ranks[0]["steps"] if any(s <= t <= e + 1.0 for s, e in windows)]
    outside = [d for t, d in ranks[0]["steps"] if not any(s <= t <= e + 1.0 for s, e in windows)]
    print(f"  training job: {len(steps)} steps; reports its leader had acknowledged {ranks[0]['reports_sent']}, stored "
          f"{job_stored} (more: a report stored whose answer a kill cut off, sent again)")
    for name, part in (("inside the failover windows", during), ("outside them", outside)):
        part = sorted(part) or [0.0]
        print(f"  step time {name}: {len(part)} steps, median {statistics.median(part) * 1e3:.1f} ms, "
              f"p99 {part[int(0.99 * (len(part) - 1))] * 1e3:.1f} ms, longest {part[-1] * 1e3:.1f} ms")
    ok = not lost and same and after_cut == 0 and job_stored >= ranks[0]["reports_sent"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

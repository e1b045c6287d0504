"""Controller ingest benchmark: reports/s, latency and server CPU per report of
``POST /v1/runs/{run}/reports``.

Starts one ``trainguard serve`` process (one uvicorn worker, a temporary SQLite file in WAL mode,
the built-in rules, or ``--rules FILE``) on loopback for each ``--db`` (default ``sqlite``; ``--db
sqlite --db postgresql`` measures both side by side in one run: ``postgresql`` starts a private
PostgreSQL server with its durable defaults, fsync and synchronous_commit on, from Debian's
binaries; ``--db postgresql://...`` uses a database you name, whose tables it writes), registers ``--runs`` runs of a ``--world-size``-rank job, then
starts ``--clients`` load generator processes. Each opens ``--connections`` keep-alive HTTP/1.1
connections (raw asyncio streams, uvloop when installed) and posts pre-serialised requests
round-robin over the runs, one request in flight per connection, reading every full response and
checking its status, until ``--reports`` were sent or ``--seconds`` passed. Every report carries
28 job-level values and the five per-rank vectors (~8 KB of JSON), so each request pays for
parsing, the ring buffer, every default rule and the group-committed SQLite write.

Two modes: closed loop (default: each connection sends its next request as soon as the answer
arrives; measures the most the worker sustains) and open loop (``--rate R``: requests are due at
a fixed total rate R and latency counts from the time a request was *due*, so a stalled server is
not hidden by the load generator waiting for it).

Printed: reports/s, client-side latency percentiles (p50/p99/p99.9/max), the server's CPU time per
report (user + system time of the worker process from /proc, divided by the reports answered:
unlike reports/s, this does not depend on how many cores are free on a shared machine), the load
generator's CPU per report, the single-core capacity that the server CPU implies (an *estimate*:
1 / CPU per report, assuming a core of its own and no waiting; the CPU per report falls as the
load grows, since group commit then puts more reports in each SQLite transaction, so an open-loop
run at a modest rate understates it), reports per SQLite transaction, and the controller's own
ingest-latency histogram.

    .venv/bin/python bench/controller_ingest.py --reports 30000 --seconds 20 --connections 16
    .venv/bin/python bench/controller_ingest.py --rate 1500 --seconds 20 --connections 32
    .venv/bin/python bench/controller_ingest.py --db sqlite --db postgresql --reports 20000 --seconds 15

On a machine with cores to spare, ``--pin`` gives the worker a core of its own (and the load
generators the others), which makes the figures repeatable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from trainguard.service.store import shown_db

TARGET_RATE, TARGET_P99_MS = 1500.0, 50.0
_HEADER_END = b"\r\n\r\n"
_LOOPBACK = "127.0.0.1"


def _values(rng: random.Random, step: int) -> dict[str, float]:
    return {
        "trainguard_step": float(step), "trainguard_loss": 3.0 * math.exp(-step / 5000) + rng.gauss(0, 0.01),
        "trainguard_grad_norm": 1.0 + abs(rng.gauss(0, 0.05)), "trainguard_grad_norm_max": 1.1 + abs(rng.gauss(0, 0.05)), "trainguard_param_norm": 1000.0, "trainguard_param_scale": 0.02,
        "trainguard_update_ratio": 1e-3, "trainguard_effective_lr": 3e-4, "trainguard_grad_noise_scale": 1200.0,
        "trainguard_grad_variance": 2.0, "trainguard_nonfinite_grads": 0.0, "trainguard_optimizer_state_nonfinite": 0.0,
        "trainguard_loss_scale": 65536.0, "trainguard_step_duration_seconds": 0.5, "trainguard_tokens_per_second": 1.2e5,
        "trainguard_memory_allocated_bytes": 4e10 + rng.gauss(0, 1e7), "trainguard_memory_reserved_bytes": 5e10,
        "trainguard_memory_peak_bytes": 4.5e10, "trainguard_agent_overhead_seconds": 0.001,
        "trainguard_data_duplicate_ratio": 0.01, "trainguard_data_near_duplicate_ratio": 0.02,
        "trainguard_data_token_kl_divergence": 0.02, "trainguard_data_special_token_ratio": 1e-6,
        "trainguard_data_length_shift_pvalue": 0.5, "trainguard_paused": 0.0, "trainguard_lr_scale": 1.0,
        "trainguard_applied_generation": 0.0, "trainguard_agent_controller_up": 1.0,
    }


def _body(rng: random.Random, job: str, step: int, world: int) -> bytes:
    ranks = {
        "step_time_s": [0.5 + rng.random() * 0.01 for _ in range(world)],
        "loss": [3.0 + rng.random() * 0.01 for _ in range(world)],
        "grad_norm": [1.0 + rng.random() * 0.01 for _ in range(world)],
        "grad_fingerprint": [rng.random() for _ in range(world)],
        "param_fingerprint": [12345.678] * world,
    }
    return json.dumps({"job": job, "step_first": step, "step_last": step, "time": time.time(), "values": _values(rng, step),
                       "ranks": ranks, "applied_generation": 0}).encode()


class _Http:
    """One keep-alive HTTP/1.1 connection that sends ready-made requests and reads whole answers
    (``Content-Length`` bodies, which is what the controller sends)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        self.writer.write(request)
        head = await self.reader.readuntil(_HEADER_END)
        status = int(head[9:12])
        length = None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
                break
        if length is None:
            raise RuntimeError(f"answer without Content-Length: {head[:200]!r}")
        return status, await self.reader.readexactly(length) if length else b""


async def _load(port: int, runs: list[str], bodies: list[bytes], count: int, seconds: float, connections: int,
                rate: float | None, first: int) -> tuple[list[float], int, str]:
    # Requests are assembled from pre-serialised parts: the load generator spends its CPU on I/O.
    prefixes = [f"POST /v1/runs/{run}/reports HTTP/1.1\r\nHost: {_LOOPBACK}:{port}\r\n".encode() for run in runs]
    tails = [b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b) for b in bodies]
    conns = [_Http(*await asyncio.open_connection(_LOOPBACK, port)) for _ in range(connections)]
    latencies: list[float] = []
    errors = 0
    first_error = ""
    sent = 0
    clock = time.perf_counter
    t_start = clock()
    deadline = t_start + seconds

    async def worker(http: _Http) -> None:
        nonlocal sent, errors, first_error
        while sent < count:
            i = sent
            sent += 1
            if rate is None:
                t0 = clock()
            else:
                t0 = t_start + i / rate  # when this request is due: latency counts from here
                delay = t0 - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
            if t0 >= deadline:
                break
            k = first + i
            status, body = await http.exchange(prefixes[k % len(prefixes)] + tails[k % len(tails)])
            latencies.append(clock() - t0)
            if status != 200 or not body.startswith(b'{"desired":'):
                errors += 1
                first_error = first_error or f"HTTP {status}: {body[:300]!r}"

    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        for c in conns:
            c.writer.close()
    return latencies, errors, first_error


def _client_proc(args: tuple) -> tuple[list[float], int, str, float, float, float]:
    port, runs, job, world, count, seconds, connections, rate, seed, start_at, cpus = args
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        from uvloop import run
    except ImportError:  # plain asyncio works too, at a higher CPU cost per request
        run = asyncio.run
    rng = random.Random(seed)
    bodies = [_body(rng, job, i, world) for i in range(min(count, 1000))]
    while time.time() < start_at:
        time.sleep(0.001)
    cpu0, t0 = time.process_time(), time.perf_counter()
    lat, err, first_error = run(_load(port, runs, bodies, count, seconds, connections, rate, seed * 7919))
    return lat, err, first_error, t0, time.perf_counter(), time.process_time() - cpu0


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return math.nan
    k = min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))
    return sorted_vals[k]


def _server_latency(metrics_text: str) -> tuple[float, float, list[tuple[float, float]]]:
    buckets, total, count = [], 0.0, 0.0
    for line in metrics_text.splitlines():
        if line.startswith("trainguard_controller_ingest_latency_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((math.inf if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith("trainguard_controller_ingest_latency_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("trainguard_controller_ingest_latency_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total, count, buckets


def _wait_ready(url: str, timeout: float = 30.0) -> None:
    """Until the controller answers (an older one printed its address before listening)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(f"{url}/metrics", timeout=5).raise_for_status()
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _commits(metrics_text: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith("trainguard_controller_store_commits_total "):
            return float(line.split()[1])
    return math.nan


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200, help="runs registered (reports go round-robin)")
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--reports", type=int, default=30000, help="stop after this many reports")
    p.add_argument("--seconds", type=float, default=20.0, help="or after this long")
    p.add_argument("--clients", type=int, default=1, help="load generator processes")
    p.add_argument("--connections", type=int, default=16, help="keep-alive connections per load generator")
    p.add_argument("--rate", type=float, default=None, help="open loop: total reports/s to offer (default: closed loop, as fast as answered)")
    p.add_argument("--console-streams", type=int, default=0,
                   help="operator-console pages kept open meanwhile: live run streams (/ui/api/runs/RUN/stream) read to the end, one per run")
    p.add_argument("--rules", type=Path, default=None,
                   help="a rules file for the controller (default: the built-in rules), e.g. an older rule set to compare like with like")
    p.add_argument("--pin", action="store_true", help="pin the server to the first allowed core and the load generators to the others")
    p.add_argument("--db", action="append", default=None,
                   help="the store, repeatable (one run each, side by side): 'sqlite' (a temporary file, the default), "
                        "'postgresql' (a private PostgreSQL server started for the run) or a postgresql:// URL")
    args = p.parse_args()
    args.db = args.db or ["sqlite"]
    for db in args.db:
        if db not in ("sqlite", "postgresql") and not db.startswith(("postgresql://", "postgres://")):
            p.error(f"--db {db!r}: expected sqlite, postgresql or a postgresql:// URL")
    for name in ("runs", "world_size", "reports", "clients", "connections"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not (0 < args.seconds <= 3600):
        p.error("--seconds must be in (0, 3600]")
    if args.rate is not None and not (0 < args.rate < 1e6):
        p.error("--rate must be in (0, 1e6)")
    return args


def main() -> int:
    args = _args()
    summary: list[tuple[str, dict[str, float]]] = []
    for db in args.db:
        if db == "postgresql":
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.service.postgres
            from tests.service.postgres import PostgresCluster

            cluster = PostgresCluster(durable=True)
            try:
                summary.append((f"PostgreSQL {cluster.bindir.parent.name} (private, fsync on)", _bench(args, cluster.create_database("bench"))))
            finally:
                cluster.stop()
        else:
            summary.append(("SQLite (WAL)" if db == "sqlite" else shown_db(db), _bench(args, None if db == "sqlite" else db)))
    if len(summary) > 1:
        base = summary[0][1]
        print(f"side by side (ratios to {summary[0][0]}):")
        print(f"  {'store':<40} {'reports/s':>10} {'p99 ms':>8} {'CPU us/report':>14} {'reports/commit':>15}")
        for name, m in summary:
            print(f"  {name:<40} {m['rate']:>10,.0f} {m['p99_ms']:>8.2f} {m['cpu_us']:>14.0f} {m['per_commit']:>15.1f}"
                  f"   x{m['rate'] / base['rate']:.2f} throughput, x{m['cpu_us'] / base['cpu_us']:.2f} CPU")
    return 0


def _bench(args: argparse.Namespace, db_url: str | None) -> dict[str, float]:
    """One controller on ``db_url`` (``None``: a temporary SQLite file) under the load: printed, and
    the headline figures returned."""
    cores = sorted(os.sched_getaffinity(0))
    server_cpus, client_cpus = (cores[:1], cores[1:]) if args.pin and len(cores) > 1 else ([], [])
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRAINGUARD_OPERATOR_TOKENS="", TRAINGUARD_AGENT_TOKENS="")
        server = subprocess.Popen(
            [sys.executable, "-m", "trainguard.cli", "serve", "--host", _LOOPBACK, "--port", "0", "--db", db_url or str(Path(tmp) / "bench.db"),
             "--log-level", "warning", *(["--rules", str(args.rules.resolve())] if args.rules else [])],
            stdout=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).resolve().parent.parent,
        )
        try:
            if server_cpus:
                os.sched_setaffinity(server.pid, server_cpus)
            line = server.stdout.readline()
            if "listening on " not in line:
                raise SystemExit(f"the controller did not start: {line!r}")
            url = line.split("listening on ")[1].split()[0]
            port = int(url.rsplit(":", 1)[1])
            # drain what it prints from now on: a full pipe would block the server mid-benchmark
            threading.Thread(target=lambda out=server.stdout: [None for _ in out], daemon=True).start()
            runs = [f"bench-run-{i:04d}" for i in range(args.runs)]
            _wait_ready(url)
            with httpx.Client(base_url=url, timeout=30) as c:
                for run in runs:
                    reg = {"job": "bench-job", "run": run, "world_size": args.world_size,
                           "ranks": [{"rank": r, "local_rank": r % 8, "host": _LOOPBACK, "port": 9000 + r} for r in range(args.world_size)]}
                    c.post("/v1/runs", json=reg).raise_for_status()
            watchers = _ConsoleWatchers(url, runs[: args.console_streams])
            per = math.ceil(args.reports / args.clients)
            rate = args.rate / args.clients if args.rate else None
            start_at = time.time() + 2.0  # every load generator has built its bodies and connected by then
            jobs = [(port, runs, "bench-job", args.world_size, per, args.seconds, args.connections, rate, i + 1, start_at, client_cpus)
                    for i in range(args.clients)]
            with mp.get_context("spawn").Pool(args.clients) as pool:
                pending = pool.map_async(_client_proc, jobs)
                with httpx.Client(base_url=url, timeout=30) as c:
                    commits0 = _commits(c.get("/metrics").text)
                while time.time() < start_at:
                    time.sleep(0.01)
                cpu0 = _cpu_seconds(server.pid)
                results = pending.get()
            cpu = _cpu_seconds(server.pid) - cpu0
            watchers.close()
            with httpx.Client(base_url=url, timeout=30) as c:
                metrics = c.get("/metrics").text
                commits = _commits(metrics) - commits0
                alerts = len(c.get("/v1/alerts", params={"limit": 1000}).json())
        finally:
            server.terminate()
            server.wait(30)
    print(f"store: {shown_db(db_url) if db_url else 'SQLite (WAL), a temporary file'}")
    figures = _print(args, results, cpu, metrics, alerts, commits)
    if args.console_streams:
        print(f"  console streams  {args.console_streams} open, {watchers.bytes / 1e6:.1f} MB of events read")
    return figures


class _ConsoleWatchers:
    """Console run pages kept open: one thread per run reading its live event stream."""

    def __init__(self, url: str, runs: list[str]) -> None:
        import threading

        self.bytes = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, args=(url, run), daemon=True) for run in runs]
        for t in self._threads:
            t.start()

    def _watch(self, url: str, run: str) -> None:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(30, read=60)) as c:
            c.get("/ui/api/session").raise_for_status()  # no tokens: an anonymous console session
            with c.stream("GET", f"/ui/api/runs/{run}/stream") as resp:
                resp.raise_for_status()
                for chunk in resp.iter_bytes():
                    self.bytes += len(chunk)
                    if self._stop.is_set():
                        return

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(70)


def _print(args: argparse.Namespace, results: list[tuple], cpu: float, metrics: str, alerts: int, commits: float) -> dict[str, float]:
    lat = sorted(x for r in results for x in r[0])
    errors = sum(r[1] for r in results)
    first_error = next((r[2] for r in results if r[2]), "")
    elapsed = max(r[4] for r in results) - min(r[3] for r in results)
    client_cpu = sum(r[5] for r in results)
    n = max(len(lat), 1)
    rate = len(lat) / elapsed
    mode = f"open loop at {args.rate:,.0f} reports/s offered" if args.rate else "closed loop"
    print(f"controller ingest: {args.runs} runs x {args.world_size} ranks, {args.clients} load generator(s) x "
          f"{args.connections} connections, {mode}, one uvicorn worker{', pinned' if args.pin else ''}")
    print(f"  reports          {len(lat)} in {elapsed:.2f} s, errors {errors}, alerts fired {alerts}" + (f"  first error: {first_error}" if errors else ""))
    if args.rate:  # open loop: the question is whether the offered rate was kept up with
        kept = rate >= 0.98 * args.rate
        ok = kept and args.rate >= TARGET_RATE
        print(f"  throughput       {rate:,.0f} reports/s of {args.rate:,.0f} offered ({'kept up' if kept else 'FELL BEHIND'};"
              f" target >= {TARGET_RATE:,.0f}: {'PASS' if ok else 'FAIL'})")
    else:
        print(f"  throughput       {rate:,.0f} reports/s   (target >= {TARGET_RATE:,.0f}: {'PASS' if rate >= TARGET_RATE else 'FAIL'})")
    p50, p99, p999 = (_pct(lat, q) * 1e3 for q in (0.5, 0.99, 0.999))
    print(f"  client latency   p50 {p50:.2f} ms  p99 {p99:.2f} ms  p99.9 {p999:.2f} ms  max {lat[-1] * 1e3:.2f} ms"
          f"   (target p99 < {TARGET_P99_MS:.0f} ms: {'PASS' if p99 < TARGET_P99_MS else 'FAIL'})")
    per_report = cpu / n
    print(f"  server CPU       {per_report * 1e6:.0f} us per report (user+sys of the worker process / reports answered)")
    print(f"  capacity (est.)  ~{1 / per_report:,.0f} reports/s on one dedicated core = 1 / server CPU per report at this load"
          f"   (an estimate, not a measurement; target {TARGET_RATE:,.0f}: {'PASS' if 1 / per_report >= TARGET_RATE else 'FAIL'})")
    print(f"  load generator   {client_cpu / n * 1e6:.0f} us CPU per report")
    s_sum, s_count, buckets = _server_latency(metrics)
    s_p99 = next((le for le, k in buckets if k >= 0.99 * s_count), math.nan)
    print(f"  group commit     {len(lat) / max(commits, 1):.1f} reports per database transaction ({commits:.0f} commits)")
    print(f"  server ingest    mean {s_sum / max(s_count, 1) * 1e3:.3f} ms, p99 <= {s_p99 * 1e3:g} ms "
          "(controller histogram: parse + rules + commit, excludes HTTP)")
    return {"rate": rate, "p99_ms": p99, "cpu_us": per_report * 1e6, "per_commit": len(lat) / max(commits, 1)}


if __name__ == "__main__":
    sys.exit(main())

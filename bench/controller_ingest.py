"""Controller ingest benchmark: reports/s and latency of POST /v1/runs/{run}/reports.

Starts one ``trainguard serve`` process (one uvicorn worker, a temporary SQLite file, the default
rules) on loopback, registers ``--runs`` runs of a ``--world-size``-rank job, then load generator
processes (asyncio + httpx, ``--connections`` keep-alive connections each) post reports round-robin
over the runs until ``--reports`` were sent or ``--seconds`` passed. Every report carries ~30
job-level values and the five per-rank vectors, so each request pays for parsing, the ring buffer,
every default rule and the group-committed SQLite write.

Printed: reports/s, client-observed latency percentiles (p50/p99/max, including the load
generator's own HTTP overhead), and the server-side ingest latency from the controller's own
histogram (parse -> rules -> commit -> answer). The load generator shares the machine's cores with
the controller; on a 2-core machine the figures are a lower bound of what one worker does.

    .venv/bin/python bench/controller_ingest.py --reports 30000 --seconds 30
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
import time
from pathlib import Path

import httpx

TARGET_RATE, TARGET_P99_MS = 1500.0, 50.0


def _values(rng: random.Random, step: int) -> dict[str, float]:
    v = {
        "trainguard_step": float(step), "trainguard_loss": 3.0 * math.exp(-step / 5000) + rng.gauss(0, 0.01),
        "trainguard_grad_norm": 1.0 + abs(rng.gauss(0, 0.05)), "trainguard_param_norm": 1000.0, "trainguard_param_scale": 0.02,
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
    return v


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


async def _load(url: str, runs: list[str], job: str, world: int, count: int, seconds: float, connections: int, seed: int) -> tuple[list[float], int]:
    rng = random.Random(seed)
    # Bodies are built before timing starts: the load generator should spend its CPU on HTTP.
    bodies = [_body(rng, job, i, world) for i in range(min(count, 2000))]
    latencies: list[float] = []
    errors = 0
    sent = 0
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30, headers={"content-type": "application/json"}) as client:

        async def worker() -> None:
            nonlocal sent, errors
            while sent < count and time.perf_counter() < deadline:
                i = sent
                sent += 1
                run = runs[i % len(runs)]
                t0 = time.perf_counter()
                resp = await client.post(f"/v1/runs/{run}/reports", content=bodies[i % len(bodies)])
                latencies.append(time.perf_counter() - t0)
                if resp.status_code != 200:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(connections)))
    return latencies, errors


def _client_proc(args: tuple) -> tuple[list[float], int, float, float]:
    url, runs, job, world, count, seconds, connections, seed, start_at = args
    while time.time() < start_at:
        time.sleep(0.001)
    t0 = time.perf_counter()
    lat, err = asyncio.run(_load(url, runs, job, world, count, seconds, connections, seed))
    return lat, err, t0, time.perf_counter()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), to measure the server's cost per report
    independently of how busy the shared cores are."""
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200, help="runs registered (reports go round-robin)")
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--reports", type=int, default=30000, help="stop after this many reports")
    p.add_argument("--seconds", type=float, default=30.0, help="or after this long")
    p.add_argument("--clients", type=int, default=1, help="load generator processes")
    p.add_argument("--connections", type=int, default=32, help="concurrent connections per load generator")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.db"
        env = dict(os.environ, TRAINGUARD_OPERATOR_TOKENS="", TRAINGUARD_AGENT_TOKENS="")
        server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", "0", "--db", str(db), "--log-level", "warning"],
                                  stdout=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
        try:
            line = server.stdout.readline()
            url = line.split("listening on ")[1].split()[0]
            runs = [f"bench-run-{i:04d}" for i in range(args.runs)]
            with httpx.Client(base_url=url, timeout=30) as c:
                for run in runs:
                    reg = {"job": "bench-job", "run": run, "world_size": args.world_size,
                           "ranks": [{"rank": r, "local_rank": r % 8, "host": "127.0.0.1", "port": 9000 + r} for r in range(args.world_size)]}
                    c.post("/v1/runs", json=reg).raise_for_status()
            per = math.ceil(args.reports / args.clients)
            cpu0 = _cpu_seconds(server.pid)
            start_at = time.time() + 1.0
            jobs = [(url, runs, "bench-job", args.world_size, per, args.seconds, args.connections, i, start_at) for i in range(args.clients)]
            with mp.get_context("spawn").Pool(args.clients) as pool:
                results = pool.map(_client_proc, jobs)
            cpu = _cpu_seconds(server.pid) - cpu0
            with httpx.Client(base_url=url, timeout=30) as c:
                metrics = c.get("/metrics").text
                alerts = len(c.get("/v1/alerts", params={"limit": 1000}).json())
        finally:
            server.terminate()
            server.wait(30)
    lat = sorted(x for r in results for x in r[0])
    errors = sum(r[1] for r in results)
    elapsed = max(r[3] for r in results) - min(r[2] for r in results)
    rate = len(lat) / elapsed
    s_sum, s_count, buckets = _server_latency(metrics)
    s_p99 = next((le for le, n in buckets if n >= 0.99 * s_count), math.nan)
    print(f"controller ingest: {args.runs} runs x {args.world_size} ranks, {args.clients} load generator(s) x {args.connections} connections, one uvicorn worker")
    print(f"  reports        {len(lat)} in {elapsed:.2f} s, errors {errors}, alerts fired {alerts}")
    print(f"  throughput     {rate:,.0f} reports/s   (target >= {TARGET_RATE:,.0f}: {'PASS' if rate >= TARGET_RATE else 'FAIL'})")
    p50, p99 = _pct(lat, 0.50) * 1e3, _pct(lat, 0.99) * 1e3
    print(f"  client latency p50 {p50:.2f} ms  p99 {p99:.2f} ms  max {lat[-1] * 1e3:.2f} ms   (target p99 < {TARGET_P99_MS:.0f} ms: {'PASS' if p99 < TARGET_P99_MS else 'FAIL'})")
    per_report = cpu / max(len(lat), 1)
    print(f"  server CPU     {per_report * 1e6:.0f} us per report (user+sys of the one worker) -> one core sustains ~{1 / per_report:,.0f} reports/s")
    print(f"  server ingest  mean {s_sum / max(s_count, 1) * 1e3:.3f} ms, p99 <= {s_p99 * 1e3:g} ms (histogram bucket; parse + rules + commit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

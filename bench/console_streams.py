"""Console live-update streams against the controller's event loop: report and ``/healthz``
latency with no stream open, then with ``--streams`` streams open, side by side.

Starts one ``trainguard serve`` process per configuration (no tokens: every console session is
anonymous, one per ``GET /ui/api/session``) on loopback, registers ``--runs`` runs of
``--world-size`` ranks and posts one report to each, then measures twice for ``--seconds``
each: one client posts reports round-robin over the runs at ``--rate`` per second (open loop:
latency counts from when a report was due, so a stalled loop is not hidden by the client
waiting) while another asks ``/healthz`` every 50 ms; the second time, ``--streams`` streams
(``/ui/api/stream``, the runs list; ``--kind run`` for run pages) are held open meanwhile,
``--per-session`` to a console session, each read to the end. Printed per configuration and
phase: report and ``/healthz`` latency (median, p95, max; errors count refusals and reports still
unanswered 30 s after the phase), the server's CPU time per second of the phase (user + system
from /proc; on a loaded machine a server that cannot keep up gets only its share of the cores, so
read it beside the latency), streams served and refused (429), and the bytes they delivered.

    .venv/bin/python bench/console_streams.py --runs 500 --world-size 256 --streams 20 --seconds 15
    # against another checkout (which must hold .venv/bin/python), e.g. an older commit:
    .venv/bin/python bench/console_streams.py --config now= --config before@/tmp/old=

A configuration is ``LABEL[@CHECKOUT]=``; CHECKOUT defaults to this one. Latency on a shared
machine moves from run to run; compare the two phases of one configuration, and configurations
run one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from controller_ingest import _body  # noqa: E402 - the same report bodies as the ingest benchmark

ROOT = Path(__file__).resolve().parent.parent
_LOOPBACK = "127.0.0.1"
_HEALTH_EVERY_S = 0.05
#: How long a phase waits for its last reports' answers; those still unanswered count as errors.
_LATE_S = 30.0


def _config(text: str) -> tuple[str, Path]:
    label, _, _ = text.partition("=")
    label, _, checkout = label.partition("@")
    return label or "this", Path(checkout).resolve() if checkout else ROOT


def _start(checkout: Path, tmp: str) -> tuple[subprocess.Popen[bytes], str]:
    env = dict(os.environ, TRAINGUARD_OPERATOR_TOKENS="", TRAINGUARD_AGENT_TOKENS="", OMP_NUM_THREADS="1")
    cmd = [str(checkout / ".venv" / "bin" / "python"), "-m", "trainguard.cli", "serve", "--host", _LOOPBACK, "--port", "0",
           "--db", f"{tmp}/bench.db", "--log-level", "warning"]
    log = Path(tmp) / "serve.log"
    with log.open("wb") as out:  # a file, not a pipe: a server logging while nobody reads never blocks
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=checkout)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        if m := re.search(r"listening on (http://[\d.]+:\d+)", log.read_text(errors="replace")):
            return server, m.group(1)
        time.sleep(0.2)
    server.kill()
    raise SystemExit(f"the controller in {checkout} did not start: {log.read_text(errors='replace')[-2000:]}")


class _Streams:
    """``count`` console streams, ``per_session`` to an anonymous session, each read to the end."""

    def __init__(self, url: str, count: int, per_session: int, path: str) -> None:
        self.url, self.count, self.per_session, self.path = url, count, per_session, path
        self.bytes = self.served = self.refused = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._clients: list[httpx.AsyncClient] = []
        self._ready = asyncio.Event()
        self._started = 0

    async def open(self) -> None:
        for i in range(self.count):
            if i % self.per_session == 0:
                c = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(60, read=None))
                (await c.get("/ui/api/session")).raise_for_status()
                self._clients.append(c)
            self._tasks.append(asyncio.create_task(self._read(self._clients[-1])))
        await asyncio.wait_for(self._ready.wait(), 120)

    def _started_one(self) -> None:
        self._started += 1
        if self._started == self.count:
            self._ready.set()

    async def _read(self, c: httpx.AsyncClient) -> None:
        async with c.stream("GET", self.path) as resp:
            if resp.status_code == 429:
                self.refused += 1
                self._started_one()
                return
            resp.raise_for_status()
            self.served += 1
            first = True
            async for chunk in resp.aiter_raw():
                self.bytes += len(chunk)
                if first:
                    first = False
                    self._started_one()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in self._clients:
            await c.aclose()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _phase(pid: int, url: str, runs: list[str], bodies: list[bytes], *, rate: float, seconds: float,
                 streams: _Streams | None) -> dict[str, Any]:
    if streams is not None:
        await streams.open()
    reports: list[float] = []
    health: list[float] = []
    errors = unanswered = 0
    stop = time.monotonic() + seconds
    headers = {"content-type": "application/json"}

    async def post_one(c: httpx.AsyncClient, i: int, due: float) -> None:
        nonlocal errors
        try:
            r = await c.post(f"/v1/runs/{runs[i % len(runs)]}/reports", content=bodies[i % len(bodies)], headers=headers)
        except httpx.HTTPError:  # (a keep-alive connection the server closed as it was reused)
            errors += 1
            return
        reports.append(time.monotonic() - due)
        errors += r.status_code != 200

    async def post_reports(c: httpx.AsyncClient) -> None:
        # open loop: each report is sent when due, whether or not the earlier ones were answered
        nonlocal unanswered
        start, pending = time.monotonic(), set()
        i = 0
        while (due := start + i / rate) < stop:
            if (wait := due - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            task = asyncio.create_task(post_one(c, i, due))
            pending.add(task)
            task.add_done_callback(pending.discard)
            i += 1
        if pending:
            done, late = await asyncio.wait(pending, timeout=_LATE_S)
            unanswered = len(late)
            for task in late:
                task.cancel()

    async def ask_health(c: httpx.AsyncClient) -> None:
        nonlocal errors
        while time.monotonic() < stop:
            t = time.monotonic()
            r = await c.get("/healthz")
            health.append(time.monotonic() - t)
            errors += r.status_code != 200
            await asyncio.sleep(_HEALTH_EVERY_S)

    cpu, began = _cpu_s(pid), time.monotonic()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as a, httpx.AsyncClient(base_url=url, timeout=120) as b:
        await asyncio.gather(post_reports(a), ask_health(b))
    out = {"reports": reports, "health": health, "errors": errors + unanswered, "cpu": (_cpu_s(pid) - cpu) / (time.monotonic() - began)}
    if streams is not None:
        out |= {"served": streams.served, "refused": streams.refused, "bytes": streams.bytes}
        await streams.close()
    return out


def _ms(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return (f"{statistics.median(xs) * 1e3:8.1f} {xs[min(len(xs) - 1, int(0.95 * len(xs)))] * 1e3:8.1f} "
            f"{xs[-1] * 1e3:8.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", default=[], help="LABEL[@CHECKOUT]= (repeat; default: this checkout)")
    p.add_argument("--runs", type=int, default=500)
    p.add_argument("--world-size", type=int, default=256)
    p.add_argument("--streams", type=int, default=20)
    p.add_argument("--per-session", type=int, default=5, help="streams per console session")
    p.add_argument("--kind", choices=("runs", "run"), default="runs",
                   help="runs: the runs list (/ui/api/stream); run: one run's page (/ui/api/runs/RUN/stream)")
    p.add_argument("--rate", type=float, default=20.0, help="reports per second offered")
    p.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    args = p.parse_args()
    configs = [_config(c) for c in args.config] or [("this", ROOT)]
    rng = random.Random(0)
    bodies = [_body(rng, "bench-job", step, args.world_size) for step in range(1, 9)]
    print(f"console streams: {args.runs} runs x {args.world_size} ranks, reports at {args.rate:g}/s, /healthz every "
          f"{_HEALTH_EVERY_S * 1e3:.0f} ms, {args.seconds:g} s per phase; {args.streams} {args.kind} streams, "
          f"{args.per_session} per session")
    print(f"  {'config':<10} {'streams':>16}  {'report ms: p50      p95      max':>33}  {'/healthz ms: p50      p95      max':>35}  "
          f"{'CPU s/s':>7}  {'MB sent':>8}  errors")
    for label, checkout in configs:
        with tempfile.TemporaryDirectory() as tmp:
            server, url = _start(checkout, tmp)
            try:
                runs = [f"bench-run-{i:04d}" for i in range(args.runs)]
                with httpx.Client(base_url=url, timeout=600) as c:
                    for run in runs:
                        c.post("/v1/runs", json={"job": "bench-job", "run": run, "world_size": args.world_size, "ranks": [
                            {"rank": r, "local_rank": r % 8, "host": _LOOPBACK, "port": 9000 + r} for r in range(args.world_size)],
                        }).raise_for_status()
                        c.post(f"/v1/runs/{run}/reports", content=bodies[0], headers={"content-type": "application/json"}
                               ).raise_for_status()
                path = "/ui/api/stream" if args.kind == "runs" else f"/ui/api/runs/{runs[0]}/stream"
                for streams in (None, _Streams(url, args.streams, args.per_session, path)):
                    r = asyncio.run(_phase(server.pid, url, runs, bodies[1:], rate=args.rate, seconds=args.seconds, streams=streams))
                    opened = "none" if streams is None else f"{r['served']} served, {r['refused']} refused"
                    sent = f"{r['bytes'] / 1e6:8.1f}" if streams is not None else f"{'-':>8}"
                    print(f"  {label:<10} {opened:>16}  {_ms(r['reports']):>33}  {_ms(r['health']):>35}  {r['cpu']:7.2f}  {sent}  {r['errors']}",
                          flush=True)
            finally:
                server.terminate()
                server.wait(60)


if __name__ == "__main__":
    main()

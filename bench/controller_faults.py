"""Controller fault replays: each reproduction of a failure-isolation defect, run against a real
``trainguard serve`` process on loopback, with an innocent run reporting every 20 ms throughout.

For each fault it prints what happened to the innocent run (reports lost = answers other than 200,
worst report latency), what happened to the fault's own requests, alerts lost where the fault is
about one, the server's RSS after it, and for the shutdown case the time from SIGTERM to exit.

    .venv/bin/python bench/controller_faults.py
    .venv/bin/python bench/controller_faults.py --only lock,series

Faults: lock (another connection holds the SQLite write lock 5 s while a NaN report arrives),
series (one agent posts 140 reports of 4,096 fresh metric names), conns (1,000 connections that
send nothing, half a request line or half a body), simulate (3 callers replaying 10,000 reports
through /v1/rules/test, 4 times each), unauth (20 unauthenticated 3.5 MB bodies), bad (the inputs
that used to answer 500), sigterm (SIGTERM with an idle event stream, a long-poll and a half-sent
body open).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx

OP, AGENT, EVIL = "bench-operator-token", "bench-agent-token-1", "bench-agent-token-2"


class Server:
    def __init__(self, tmp: Path) -> None:
        self.db = tmp / "tg.db"
        env = dict(os.environ, TRAINGUARD_OPERATOR_TOKENS=OP, TRAINGUARD_AGENT_TOKENS=f"{AGENT}:innocent,{EVIL}:evil")
        self.log = open(tmp / "serve.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "serve", "--port", "0", "--db", str(self.db),
                                      "--log-level", "error"], stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            raise SystemExit(f"serve did not start: {line}")
        self.url = line.split("listening on ")[1].split()[0]
        host, port = self.url.removeprefix("http://").split(":")
        self.addr = (host, int(port))
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        for run, token in (("innocent", AGENT), ("evil", EVIL)):
            r = httpx.post(self.url + "/v1/runs", json={"job": "bench", "run": run, "world_size": 1, "ranks": []},
                           headers={"authorization": f"Bearer {token}"}, timeout=30)
            r.raise_for_status()

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


class Innocent:
    """A run posting a report every 20 ms: worst latency and answers other than 200."""

    def __init__(self, url: str) -> None:
        self.url, self.stop_flag = url, threading.Event()
        self.worst, self.lost, self.sent, self.step = 0.0, 0, 0, 0
        self.latencies: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {AGENT}"}, timeout=60) as c:
            while not self.stop_flag.is_set():
                self.step += 1
                body = {"job": "bench", "step_first": self.step, "step_last": self.step, "time": time.time(),
                        "values": {"trainguard_loss": 2.0}}
                t0 = time.perf_counter()
                try:
                    ok = c.post("/v1/runs/innocent/reports", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append(time.perf_counter() - t0)
                self.worst = max(self.worst, self.latencies[-1])
                self.sent += 1
                self.lost += not ok
                self.stop_flag.wait(0.02)

    def __enter__(self) -> "Innocent":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_flag.set()
        self.thread.join(120)


def _h(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def fault_lock(srv: Server) -> dict[str, Any]:
    out: dict[str, Any] = {}
    nan = {"job": "bench", "step_first": 1, "step_last": 1, "time": 1.0, "values": {"trainguard_loss": "NaN"}}
    with Innocent(srv.url) as inn, httpx.Client(base_url=srv.url, timeout=60) as c:
        lock = sqlite3.connect(srv.db, isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")
        reads = []
        t0 = time.perf_counter()
        fut = ThreadPoolExecutor(1).submit(lambda: c.post("/v1/runs/evil/reports", json=nan, headers=_h(EVIL)))
        while time.perf_counter() - t0 < 5.0:
            t1 = time.perf_counter()
            c.get("/v1/runs", headers=_h(OP))
            reads.append(time.perf_counter() - t1)
            time.sleep(0.05)
        lock.execute("ROLLBACK")
        lock.close()
        first = fut.result()
        out["nan_report_status"] = first.status_code
        if first.status_code != 200:  # the agent retries
            first = c.post("/v1/runs/evil/reports", json=nan, headers=_h(EVIL))
        paused = c.get("/v1/runs/evil", headers=_h(OP)).json()["desired"]["paused"]
        out["alerts_lost"] = 0 if paused else 1
        out["worst_read_ms_during_lock"] = round(max(reads) * 1000, 1)
    return out | {"innocent": inn}


def fault_series(srv: Server) -> dict[str, Any]:
    refused = 0
    with Innocent(srv.url) as inn, httpx.Client(base_url=srv.url, timeout=60, headers=_h(EVIL)) as c:
        for i in range(140):
            body = {"job": "bench", "step_first": i + 2, "step_last": i + 2, "time": 1.0,
                    "values": {f"m_{i}_{k}": 1.0 for k in range(4096)}}
            refused += c.post("/v1/runs/evil/reports", json=body).status_code != 200
    return {"flood_reports_refused": refused, "innocent": inn}


def fault_conns(srv: Server) -> dict[str, Any]:
    socks = []
    with Innocent(srv.url) as inn:
        for i in range(1000):
            try:
                s = socket.create_connection(srv.addr, timeout=10)
            except OSError:
                break
            s.sendall([b"", b"GET /v1/ru", b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"][i % 3])
            socks.append(s)
        t0 = time.perf_counter()
        open_ = len(socks)
        for s in socks:
            s.settimeout(60)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
        closed_after = time.perf_counter() - t0
    for s in socks:
        s.close()
    return {"connections_opened": open_, "all_closed_by_server_s": round(closed_after, 1), "innocent": inn}


def fault_simulate(srv: Server) -> dict[str, Any]:
    reports = [{"job": "t", "step_first": i, "step_last": i, "time": float(i), "values": {"trainguard_loss": 2.0}}
               for i in range(10_000)]
    body = json.dumps({"reports": reports}).encode()
    codes: list[int] = []

    def caller() -> None:
        with httpx.Client(base_url=srv.url, timeout=600, headers=_h(OP) | {"content-type": "application/json"}) as c:
            for _ in range(4):
                codes.append(c.post("/v1/rules/test", content=body).status_code)

    with Innocent(srv.url) as inn:
        threads = [threading.Thread(target=caller) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return {"simulations": f"{codes.count(200)} ok, {codes.count(429)} x 429", "innocent": inn}


def fault_unauth(srv: Server) -> dict[str, Any]:
    body = b"[" * 3_500_000
    with Innocent(srv.url) as inn, httpx.Client(base_url=srv.url, timeout=60) as c:
        codes = [c.post("/v1/rules/test", content=body, headers={"content-type": "application/json"}).status_code for _ in range(20)]
    return {"unauthenticated_answers": sorted(set(codes)), "innocent": inn}


def fault_bad(srv: Server) -> dict[str, Any]:
    deep = "[" * 50_000 + "]" * 50_000
    with httpx.Client(base_url=srv.url, timeout=60, headers=_h(OP)) as c:
        codes = [
            c.put("/v1/rules", content=deep).status_code,
            c.post("/v1/rules/test", json={"rules": deep, "reports": []}).status_code,
            c.get("/v1/events/stream", headers={"Last-Event-ID": "9" * 5000}).status_code,
            c.get("/v1/events/stream", headers={"Last-Event-ID": "²".encode("latin-1")}).status_code,
            c.post("/v1/rules/test", json={"world_size": 2, "reports": [{"job": "t", "step_first": 1, "step_last": 1, "time": 1.0,
                                                                          "ranks": {"step_time_s": [1.0, 2.0, 3.0]}}]}).status_code,
        ]
    return {"answers": codes, "5xx": sum(c >= 500 for c in codes)}


def fault_sigterm(srv: Server) -> dict[str, Any]:
    stream = socket.create_connection(srv.addr)
    stream.sendall(f"GET /v1/events/stream HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {OP}\r\n\r\n".encode())
    stream.recv(4096)
    poll = socket.create_connection(srv.addr)
    poll.sendall(f"GET /v1/runs/innocent/desired?after=5&wait=600 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {AGENT}\r\n\r\n".encode())
    half = socket.create_connection(srv.addr)
    half.sendall(f"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {AGENT}\r\nContent-Length: 1000\r\n\r\n{{".encode())
    time.sleep(0.5)
    t0 = time.perf_counter()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(120)
        exit_s = round(time.perf_counter() - t0, 2)
    except subprocess.TimeoutExpired:
        exit_s = "did not exit within 120 s"
    for s in (stream, poll, half):
        s.close()
    return {"exit_after_sigterm_s": exit_s}


FAULTS: dict[str, Callable[[Server], dict[str, Any]]] = {
    "lock": fault_lock, "series": fault_series, "conns": fault_conns, "simulate": fault_simulate,
    "unauth": fault_unauth, "bad": fault_bad, "sigterm": fault_sigterm,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(FAULTS), help="comma-separated faults")
    args = ap.parse_args()
    for name in args.only.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            srv = Server(Path(tmp))
            try:
                result = FAULTS[name](srv)
                inn = result.pop("innocent", None)
                if inn is not None:
                    result |= {"innocent_reports": inn.sent, "innocent_lost": inn.lost,
                               "innocent_p50_ms": round(sorted(inn.latencies)[len(inn.latencies) // 2] * 1000, 1),
                               "innocent_worst_ms": round(inn.worst * 1000, 1)}
                if srv.proc.poll() is None:
                    result["rss_mb"] = round(srv.rss_mb(), 1)
                print(f"{name:<9} " + "  ".join(f"{k}={v}" for k, v in result.items()), flush=True)
            finally:
                srv.stop()


if __name__ == "__main__":
    main()

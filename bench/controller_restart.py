"""Controller restart: how soon a restarted ``trainguard serve`` accepts connections and serves,
and how many database rows it reads to get there, this code beside an older one.

For each size (N runs x M stored reports each, plus E audit events and A resolved alerts per run)
the database is written directly with SQL (seconds, not hours of real reports), in the schema of
the older code; the newer code's copy is migrated once beforehand (a restart of a running
controller finds its database migrated). Then, for each code, ``trainguard serve`` (the real CLI
process) is started on it and timed from the process start:

* ``tcp``: until a TCP connection to its port is accepted (the older code reads every run back
  before it listens: connections are refused meanwhile);
* ``ready``: until ``/readyz`` answers 200 (the runs are read back and the writer runs);
* ``rows``: rows the read-back fetched from SQLite and the SQLite VM instructions it ran (the
  work of the scans, whether or not their rows are fetched), measured in a separate process
  running the same read-back with a counting connection (``read-back s``: its time there);
* ``in serve``: the read-back's time as this code's ``trainguard serve`` logs it (the older code
  logs none).

    .venv/bin/python bench/controller_restart.py                       # 1,000 and 10,000 runs x 200 reports
    .venv/bin/python bench/controller_restart.py --runs 1000 --reports 400
    # the older code: a worktree of it, its packages visible as this checkout's are
    git worktree add /tmp/c_old a88213d
    ln -s ../service /tmp/c_old/trainguard/service; ln -s ../dashboards /tmp/c_old/trainguard/dashboards
    .venv/bin/python bench/controller_restart.py --old /tmp/c_old
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import random
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
#: The job-level values of one stored report (names an agent sends).
METRICS = ("trainguard_loss", "trainguard_grad_norm", "trainguard_grad_norm_max", "trainguard_update_ratio",
           "trainguard_step_time_s", "trainguard_tokens_per_s", "trainguard_scheduler_lr", "trainguard_mem_allocated_bytes")
WORLD = 8


def build(db: Path, code: Path | None, runs: int, reports: int, events: int, alerts: int, seed: int = 0) -> None:
    """The database of ``runs`` runs, written in ``code``'s schema (its ``Store`` creates it)."""
    subprocess.run([sys.executable, "-c", "import sys; from trainguard.service.store import Store; Store(sys.argv[1]).close()",
                    str(db)], env=_env(code), check=True, cwd=CWD)
    rng = random.Random(seed)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("BEGIN")
    ranks = json.dumps([{"rank": r, "local_rank": r, "host": "127.0.0.1", "port": 9100 + r} for r in range(WORLD)])
    t0 = 1.7e9
    blob = bytes(8 * WORLD)  # one per-rank vector (mask bit 0) of WORLD float64 zeros
    for run_id in range(1, runs + 1):
        conn.execute("INSERT INTO runs (id, run, job, world_size, ranks, agent_version, config, registered_at)"
                     " VALUES (?,?,?,?,?,?,?,?)", (run_id, f"run-{run_id}", f"job-{run_id % 50}", WORLD, ranks, "bench",
                                                   "{}", t0))
        rows = []
        for seq in range(1, reports + 1):
            vals = json.dumps({m: rng.uniform(0.5, 2.0) for m in METRICS})
            rows.append((run_id, seq, seq, seq, t0 + seq, t0 + seq, 0, vals, 1, blob))
        conn.executemany("INSERT INTO reports (run_id, seq, step_first, step_last, time, received, applied_generation,"
                         " vals, ranks_mask, ranks) VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
        conn.executemany("INSERT INTO events (run_id, time, kind, actor, reason, generation, data) VALUES (?,?,?,?,?,?,?)",
                         [(run_id, t0 + i, "ack", "agent", "", 0, '{"generation": 0}') for i in range(events)])
        conn.executemany(
            "INSERT INTO alerts (run_id, rule, severity, state, summary, vals, diagnosis, actions, generation, notify,"
            " starts_at, ends_at, fingerprint) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
            [(run_id, "loss_spike", "warning", "resolved", "s", "{}", "{}", "[]", None, 1, t0 - 86_400 * 30 + i,
              t0 - 86_400 * 30 + i + 1, f"{run_id}-{i}") for i in range(alerts)])
    conn.execute("COMMIT")
    conn.close()


#: Where the subprocesses run: not the checkout, whose own packages would shadow ``--old``'s.
CWD = tempfile.gettempdir()


def _env(code: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if code is not None:
        env["PYTHONPATH"] = str(code)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_times(db: Path, code: Path | None, timeout_s: float) -> dict[str, float]:
    """Start ``trainguard serve`` of ``code`` on ``db``: seconds to a TCP accept and to /readyz 200."""
    port = _free_port()
    t0 = time.monotonic()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "serve", "--port", str(port), "--db", str(db),
                             "--log-level", "warning"], env=_env(code), cwd=CWD, stdout=log, stderr=subprocess.STDOUT)
    out: dict[str, float] = {}
    try:
        while "tcp" not in out:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
                out["tcp"] = time.monotonic() - t0
            except OSError:
                if proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"trainguard serve did not listen (exit {proc.poll()})")
                time.sleep(0.01)
        with httpx.Client(timeout=5) as http:
            while "ready" not in out:
                try:
                    if http.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                        out["ready"] = time.monotonic() - t0
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError("trainguard serve did not get ready")
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
        log.seek(0)
        # this code says how long its read-back took ("N runs read back in X s: serving")
        said = re.search(r"runs read back in ([\d.]+) s", log.read())
        out["server_read_back"] = float(said.group(1)) if said else math.nan
        log.close()
    return out


_COUNT = r'''
import json, sqlite3, sys, time
fetched, steps = [0], [0]

class Cursor(sqlite3.Cursor):
    def fetchall(self):
        rows = super().fetchall(); fetched[0] += len(rows); return rows
    def fetchone(self):
        row = super().fetchone(); fetched[0] += row is not None; return row
    def __next__(self):
        row = super().__next__(); fetched[0] += 1; return row

class Connection(sqlite3.Connection):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.set_progress_handler(lambda: steps.__setitem__(0, steps[0] + 1), 1000)
    def execute(self, *a):
        return self.cursor(Cursor).execute(*a)

connect = sqlite3.connect
sqlite3.connect = lambda *a, **k: connect(*a, factory=Connection, **k)
from trainguard.service.app import create_app
from trainguard.service.config import Settings
t0 = time.perf_counter()
app = create_app(Settings(db=sys.argv[1]))
ctl = app.state.controller
if getattr(app.state, "startup", None) is not None:  # this code: the runs are read in the lifespan
    ctl.load()
print(json.dumps({"fetched": fetched[0], "vm_steps": steps[0] * 1000, "runs": len(ctl.runs),
                  "seconds": time.perf_counter() - t0}))
'''


def rows_read(db: Path, code: Path | None) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _COUNT, str(db)], env=_env(code), capture_output=True, text=True, check=True,
                         cwd=CWD)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="1000,10000", help="comma-separated run counts (default 1000,10000)")
    ap.add_argument("--reports", type=int, default=200, help="stored reports per run (default 200)")
    ap.add_argument("--events", type=int, default=20, help="audit events per run (default 20)")
    ap.add_argument("--alerts", type=int, default=5, help="resolved alerts per run, a month old (default 5)")
    ap.add_argument("--old", type=Path, default=None, help="a checkout of the older code (see the module docstring)")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    codes: list[tuple[str, Path | None]] = [("this code", None)] + ([("older code", args.old)] if args.old else [])
    print(f"{'runs':>7} {'reports/run':>11} {'code':<11} {'tcp s':>7} {'ready s':>8} {'rows fetched':>13} "
          f"{'VM steps':>13} {'read-back s':>11} {'in serve s':>10}")
    with tempfile.TemporaryDirectory(prefix="tg-restart-") as tmp:
        for runs in [int(n) for n in args.runs.split(",")]:
            base = Path(tmp) / f"old-{runs}.db"
            build(base, args.old, runs, args.reports, args.events, args.alerts)
            results = {}
            for name, code in codes:
                db = Path(tmp) / f"{name.split()[0]}-{runs}.db"
                subprocess.run(["cp", str(base), str(db)], check=True)
                if code is None:  # migrated once, before the restart that is timed
                    t = time.monotonic()
                    subprocess.run([sys.executable, "-c", "import sys; from trainguard.service.store import Store; "
                                    "Store(sys.argv[1]).close()", str(db)], env=_env(None), check=True, cwd=CWD)
                    print(f"  (this code's one-time migration of the {runs}-run database: {time.monotonic() - t:.1f} s)")
                counted = rows_read(db, code)
                times = serve_times(db, code, args.timeout)
                results[name] = (times, counted)
                print(f"{runs:>7} {args.reports:>11} {name:<11} {times['tcp']:>7.2f} {times['ready']:>8.2f} "
                      f"{counted['fetched']:>13,} {counted['vm_steps']:>13,} {counted['seconds']:>11.2f} "
                      f"{times['server_read_back']:>10.2f}", flush=True)
                db.unlink()
            if len(results) == 2:
                (tn, cn), (to, co) = results["this code"], results["older code"]
                print(f"{runs:>7} {'':>11} {'old / this':<11} {to['tcp'] / tn['tcp']:>7.1f} {to['ready'] / tn['ready']:>8.2f} "
                      f"{co['fetched'] / max(cn['fetched'], 1):>13.2f} {co['vm_steps'] / max(cn['vm_steps'], 1):>13.2f}")
            base.unlink()


if __name__ == "__main__":
    main()

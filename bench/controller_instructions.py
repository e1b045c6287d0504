"""Controller ingest cost in instructions per report: a figure a busy machine does not move.

Reports/s and CPU time per report (``bench/controller_ingest.py``) swing by 1.5-2x on a shared
machine between runs of the same code. This benchmark runs the controller under valgrind's
callgrind, which counts the instructions the process executes whatever else runs beside it, so two
versions (or two rule sets) compare within a few percent on any machine, loaded or not. (The same
code varies by up to ~3.5% from round to round: the controller's clock and the event loop's timers
run more often when a busy machine makes the counted stretch take longer. Compare the lowest of
interleaved rounds.)

Each configuration is one ``serve`` process under callgrind with instrumentation off while it starts
and while ``--warm-up`` reports fill every run's windows; then instrumentation is switched on
(``callgrind_control -i on``), ``--reports`` reports are posted one at a time over one keep-alive
connection (so every report is its own SQLite transaction), and the count is dumped. Printed:
instructions per report, and each configuration's ratio to the first. Instructions are not time
(cache misses, the GIL and the machine's load are not counted), and one report per commit costs
more than the group commits of a busy controller: use it to compare code, ``controller_ingest.py``
for throughput and latency.

    # this checkout with the built-in rules, and with another rule set
    .venv/bin/python bench/controller_instructions.py --config built-in= --config sixteen=--rules=/tmp/rules16.yaml
    # another checkout (e.g. an old commit in a git worktree with its own virtual environment)
    .venv/bin/python bench/controller_instructions.py --config now= --config then@/tmp/old=

A configuration is ``LABEL[@CHECKOUT]=[SERVE ARGUMENTS]``: CHECKOUT (default: this one) must hold
``.venv/bin/python``; serve arguments are comma-separated. Needs valgrind (Debian: ``valgrind``).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from callgrind_dump import dumped_instructions  # noqa: E402
from controller_ingest import _body  # noqa: E402 - the same report bodies as the throughput benchmark

ROOT = Path(__file__).resolve().parent.parent
_LOOPBACK = "127.0.0.1"


def _cli_module(checkout: Path) -> str:
    """The module that runs ``serve`` in ``checkout`` (older checkouts had it at ``service.cli``)."""
    cli = checkout / "trainguard"
    return "trainguard.cli" if (cli / "cli.py").exists() or (cli / "cli" / "__init__.py").exists() else "service.cli"


def feed(c: httpx.Client, *, runs: int, world: int, warm_up: int, reports: int, counted=None) -> None:
    """Register ``runs`` runs of ``world`` ranks, then post ``warm_up`` reports round-robin, call
    ``counted()`` (if given) and post ``reports`` more, one at a time."""
    run_ids = [f"bench-run-{i:04d}" for i in range(runs)]
    for run in run_ids:
        c.post("/v1/runs", json={
            "job": "bench-job", "run": run, "world_size": world,
            "ranks": [{"rank": r, "local_rank": r % 8, "host": _LOOPBACK, "port": 9000 + r} for r in range(world)],
        }).raise_for_status()
    rng = random.Random(0)
    bodies = [_body(rng, "bench-job", step, world) for step in range((warm_up + reports) // runs + 1)]
    for i in range(warm_up + reports):
        if i == warm_up and counted is not None:
            counted()
        r = c.post(f"/v1/runs/{run_ids[i % runs]}/reports", content=bodies[i // runs],
                   headers={"content-type": "application/json"})
        if r.status_code != 200:
            raise SystemExit(f"report {i}: {r.status_code} {r.text[:300]}")


def _measure(checkout: Path, serve_args: list[str], *, runs: int, world: int, warm_up: int, reports: int) -> float:
    """Instructions per report of one controller process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/callgrind.out"
        env = dict(os.environ, TRAINGUARD_OPERATOR_TOKENS="", TRAINGUARD_AGENT_TOKENS="")
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
               str(checkout / ".venv" / "bin" / "python"), "-m", _cli_module(checkout), "serve", "--host", _LOOPBACK,
               "--port", "0", "--db", f"{tmp}/bench.db", "--log-level", "warning", *serve_args]
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=checkout)
        try:
            assert server.stdout is not None
            url = None
            for line in server.stdout:
                if m := re.search(r"listening on (http://[\d.]+:\d+)", line):
                    url = m.group(1)
                    break
            if url is None:
                raise SystemExit(f"the controller in {checkout} did not start (exit {server.wait()})")
            with httpx.Client(base_url=url, timeout=600) as c:
                feed(c, runs=runs, world=world, warm_up=warm_up, reports=reports,
                     counted=lambda: subprocess.run(["callgrind_control", "-i", "on", str(server.pid)], check=True,
                                                    capture_output=True))
                subprocess.run(["callgrind_control", "-d", str(server.pid)], check=True, capture_output=True)
        finally:
            server.terminate()
            server.wait(120)
        return dumped_instructions(out) / reports


def _config(text: str) -> tuple[str, Path, list[str]]:
    label, _, args = text.partition("=")
    label, _, checkout = label.partition("@")
    if not label:
        raise argparse.ArgumentTypeError(f"{text!r}: LABEL[@CHECKOUT]=[SERVE ARGUMENTS]")
    path = Path(checkout).resolve() if checkout else ROOT
    if not (path / ".venv" / "bin" / "python").exists():
        raise argparse.ArgumentTypeError(f"{path} has no .venv/bin/python")
    return label, path, [a for a in args.split(",") if a]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=_config, action="append", default=[],
                   help="LABEL[@CHECKOUT]=[SERVE ARGUMENTS] (repeat; default: this checkout with the built-in rules)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved measurements of each configuration (the lowest is compared)")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--warm-up", type=int, default=1400, help="reports before counting (fills every run's windows)")
    p.add_argument("--reports", type=int, default=600, help="reports counted")
    args = p.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("needs valgrind and callgrind_control (Debian: apt-get install valgrind)")
    if min(args.rounds, args.runs, args.world_size, args.reports) < 1 or args.warm_up < 0:
        raise SystemExit("--rounds, --runs, --world-size and --reports must be >= 1, --warm-up >= 0")
    configs = args.config or [("built-in", ROOT, [])]
    print(f"controller instructions per report: {args.runs} runs x {args.world_size} ranks, {args.warm_up} reports of "
          f"warm-up, {args.reports} counted, one at a time")
    results: dict[str, list[float]] = {label: [] for label, _, _ in configs}
    for _ in range(args.rounds):  # interleaved, as the throughput benchmarks are
        for label, checkout, serve_args in configs:
            t0 = time.monotonic()
            ir = _measure(checkout, serve_args, runs=args.runs, world=args.world_size, warm_up=args.warm_up, reports=args.reports)
            results[label].append(ir)
            print(f"  {label:<16} {ir / 1e6:7.3f} M instructions/report   ({checkout}, {' '.join(serve_args) or 'built-in rules'}; "
                  f"{time.monotonic() - t0:.0f} s)", flush=True)
    first = min(results[configs[0][0]])
    print("summary (lowest of the rounds; ratio to the first configuration):")
    for label, _, _ in configs:
        best = min(results[label])
        print(f"  {label:<16} {best / 1e6:7.3f} M   {best / first:5.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the controller's time per report goes, by source file, for one or more checkouts side by side.

    .venv/bin/python bench/controller_profile.py --config now= --config "then@/work/ci/old="
    .venv/bin/python bench/controller_profile.py --config now= --reports 3000 --top 30

``bench/controller_instructions.py`` says how many instructions a report costs, not where they go:
callgrind sees the interpreter's C functions, not the controller's Python. This runs each
configuration's ``serve`` under ``cProfile``, timed by the main thread's CPU time, registers ``--runs`` runs
of ``--world-size`` ranks, posts ``--warm-up`` reports (start-up, imports and the first windows
are then a small share), then ``--reports`` more, one at a time over one keep-alive connection,
stops the server with SIGINT (it writes its profile on the way out) and prints the time spent
*inside* each file's functions (``tottime``, summed per source file; third-party packages
per package) per counted report, one column per configuration, largest difference first.

Profiled time is not plain time: ``cProfile`` charges a fixed cost to every Python call, so code
made of many small calls reads slower than it runs. Use the columns to find which file a change
in ``controller_instructions.py``'s figure belongs to, not as a throughput. The whole process is
profiled (start-up included), so a file's figure per report includes its one-time cost divided
by the reports; warm-up reports dilute it.

A configuration is ``LABEL[@CHECKOUT]=[SERVE ARGUMENTS]`` as in ``controller_instructions.py``.
"""

from __future__ import annotations

import argparse
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from controller_instructions import _LOOPBACK, _cli_module, _config, feed  # noqa: E402


#: Runs the controller's CLI module under cProfile with the main thread's CPU time as its clock (a
#: wall clock would charge the server's idle waits to whichever coroutine frame is suspended), and
#: writes the profile when ``serve`` returns (SIGINT stops it cleanly).
_RUNNER = """
import cProfile, runpy, sys, time
out, module = sys.argv[1], sys.argv[2]
sys.argv = [module, *sys.argv[3:]]
profile = cProfile.Profile(time.thread_time)
try:
    profile.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
except SystemExit:
    pass
finally:
    profile.dump_stats(out)
"""


def _profile(checkout: Path, serve_args: list[str], out: str, *, runs: int, world: int, warm_up: int,
             reports: int) -> None:
    """One ``serve`` of ``checkout`` under cProfile, fed the reports; its profile written to ``out``."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRAINGUARD_OPERATOR_TOKENS="", TRAINGUARD_AGENT_TOKENS="")
        argv = ["serve", "--host", _LOOPBACK, "--port", "0", "--db", f"{tmp}/bench.db", "--log-level", "warning",
                *serve_args]
        cmd = [str(checkout / ".venv" / "bin" / "python"), "-c", _RUNNER, out, _cli_module(checkout), *argv]
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=checkout)
        try:
            assert server.stdout is not None
            url = next((m.group(1) for line in server.stdout
                        if (m := re.search(r"listening on (http://[\d.]+:\d+)", line))), None)
            if url is None:
                raise SystemExit(f"the controller in {checkout} did not start (exit {server.wait()})")
            with httpx.Client(base_url=url, timeout=600) as c:
                feed(c, runs=runs, world=world, warm_up=warm_up, reports=reports)
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(120)


def by_file(path: str, checkout: Path) -> dict[str, float]:
    """Seconds spent inside each source file's functions (third-party code per package)."""
    root = str(checkout.resolve()) + "/"
    out: dict[str, float] = {}
    for (file, _line, name), (_cc, _nc, tottime, _ct, _callers) in pstats.Stats(path).stats.items():
        package = re.search(r"site-packages/([^/]+)", file)
        key = package.group(1) if package else file.replace(root, "") if file != "~" else name
        out[key] = out.get(key, 0.0) + tottime
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=_config, action="append", default=[], help="LABEL[@CHECKOUT]=[SERVE ARGUMENTS]")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--warm-up", type=int, default=1400)
    p.add_argument("--reports", type=int, default=1500, help="reports counted (the profile covers the warm-up too)")
    p.add_argument("--top", type=int, default=25, help="files printed")
    args = p.parse_args()
    configs = args.config or [_config("now=")]
    columns: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, (label, checkout, serve_args) in enumerate(configs):
            out = f"{tmp}/profile{k}.prof"
            _profile(checkout, serve_args, out, runs=args.runs, world=args.world_size, warm_up=args.warm_up,
                     reports=args.reports)
            columns.append(by_file(out, checkout))
    per = args.warm_up + args.reports
    files = set().union(*columns)
    spread = {f: max(c.get(f, 0.0) for c in columns) - min(c.get(f, 0.0) for c in columns) for f in files}
    order = sorted(files, key=lambda f: (-spread[f], -columns[-1].get(f, 0.0))) if len(columns) > 1 else \
        sorted(files, key=lambda f: -columns[0].get(f, 0.0))
    print(f"profiled us per report ({per} reports: {args.warm_up} warm-up + {args.reports}; {args.runs} runs x "
          f"{args.world_size} ranks), time inside each file's functions")
    print(" | ".join(["file", *(label for label, _, _ in configs)]))
    for f in order[:args.top]:
        print(" | ".join([f, *(f"{c.get(f, 0.0) / per * 1e6:.1f}" for c in columns)]))
    print(" | ".join(["total", *(f"{sum(c.values()) / per * 1e6:.1f}" for c in columns)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

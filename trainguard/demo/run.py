"""``trainguard demo``: the whole story on one machine, no Docker.

1. Starts the controller (``trainguard serve``) on loopback with a fresh SQLite file and random
   tokens — unless ``--controller URL`` names one that already runs (the compose stack does).
2. Trains a small GPT-like model on the CPU in ``--world-size`` gloo ranks (default 2) on the
   Python standard library's source, tokenised at byte level, with the agent attached to every
   rank, and injects at known steps (see :class:`~trainguard.demo.model.FaultPlan`):
   a burst of duplicated and corrupted data, an LR schedule that jumps x100 and stays there, and a
   NaN loss. Beside it, one more process trains the same model on the same data without the faults
   and without trainguard: the healthy run to compare with.
3. Nobody intervenes. The controller's built-in rules notify on the data burst; the agent's spike
   guard skips the first blown-up steps, the controller's adaptive LR brings the update size back
   to its healthy level, and the NaN rolls every rank back to the newest good in-memory snapshot.
   Each incident's escalation ladder ends "recovered" (if one ever reaches its last rung, the run
   pauses and the demo, standing in for the human who was paged, resumes it).
4. Prints a one-line status per report while it trains, and a summary of every alert, action and
   incident with the step it happened at, and the final loss against the healthy run's.

With ``--prometheus`` and a ``prometheus`` binary on PATH it also starts Prometheus with the
generated configuration (ranks discovered through the controller) and prints the query URL.

The configuration and result are in ``config.py``, one rank's training in ``rank.py``, the
controller and Prometheus processes in ``processes.py``, the audit-log watcher in ``watch.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from trainguard.cli import format_incidents
from trainguard.demo.config import DemoConfig, DemoResult, say
from trainguard.demo.processes import Controller, start_prometheus
from trainguard.demo.rank import healthy_main, rank_main
from trainguard.demo.watch import collect, wait_acked, watch

__all__ = ["DemoConfig", "DemoResult", "run_demo", "main"]


def run_demo(cfg: DemoConfig) -> DemoResult:
    """Run the demo; returns what happened. Raises on a rank that failed or on the timeout."""
    workdir = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="trainguard-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = cfg.run or f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    ctl = Controller(cfg, workdir)
    prom = None
    procs: list[Any] = []
    try:
        _announce(cfg, ctl, run, workdir)
        if cfg.prometheus:
            prom = start_prometheus(cfg, ctl, workdir)
        healthy = _start_training(cfg, ctl, run, workdir, procs)
        watch(cfg, ctl, run, procs)
        result = _result(cfg, ctl, run, workdir, procs, healthy)
        _print_summary(cfg, result)
        if cfg.keep_running:
            say(cfg, f"\nthe controller ({ctl.url}){' and Prometheus' if prom else ''} keep running: Ctrl-C to stop")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
        return result
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        ctl.close()


def _announce(cfg: DemoConfig, ctl: Controller, run: str, workdir: Path) -> None:
    """Where the controller and the console are, and the faults the run will meet."""
    say(cfg, f"controller: {ctl.url}  (SQLite: {workdir / 'trainguard.db'})" if ctl.proc else f"controller: {ctl.url}")
    if ctl.proc and ctl.operator_token:
        say(cfg, f"operator token for this demo: {ctl.operator_token}  (e.g. trainguard status {run} --url {ctl.url} --token ...)")
    # the console takes the operator token on its sign-in page (never in the URL)
    say(cfg, f"console: {ctl.url}/ui/runs/{run}  (sign in with the operator token{' above' if ctl.proc else ''})"
         if ctl.operator_token else f"console: {ctl.url}/ui/runs/{run}")


def _start_training(cfg: DemoConfig, ctl: Controller, run: str, workdir: Path, procs: list[Any]) -> Any:
    """Start the ranks (appended to ``procs``) and the healthy run (returned; None without one)."""
    import torch.multiprocessing as mp

    blowup = (f"from step {cfg.lr_blowup[0]} on" if cfg.lr_blowup[1] is None
              else f"at steps {cfg.lr_blowup[0]}-{cfg.lr_blowup[1] - 1}")
    say(cfg, f"run {run}: {cfg.world_size} gloo ranks, {cfg.steps} steps; faults: data burst at steps "
              f"{cfg.burst[0]}-{cfg.burst[1] - 1}, LR x{cfg.lr_blowup_factor:g} {blowup}, "
              f"NaN loss at step {cfg.nan_step}")
    ctx = mp.get_context("spawn")
    store = workdir / f"gloo-store-{run}"  # the ranks meet through a file: no port to pick
    store.unlink(missing_ok=True)
    cfg_dict = asdict(cfg)
    for rank in range(cfg.world_size):
        p = ctx.Process(target=rank_main, daemon=True,
                        args=(rank, cfg_dict, f"file://{store}", ctl.url, ctl.agent_token, run, str(workdir)))
        p.start()
        procs.append(p)
    healthy = None
    if cfg.healthy_reference:
        healthy = ctx.Process(target=healthy_main, daemon=True, args=(cfg_dict, str(workdir)))
        healthy.start()
    return healthy


def _result(cfg: DemoConfig, ctl: Controller, run: str, workdir: Path, procs: list[Any],
            healthy: Any) -> DemoResult:
    """Wait for the processes (the healthy run is appended to ``procs``), then read their logs and
    the controller's records."""
    for p in procs:
        p.join(30)
    if healthy is not None:
        healthy.join(max(cfg.timeout_s, 30))
        procs.append(healthy)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"process(es) {failed} failed (exit codes {[procs[r].exitcode for r in failed]}; "
                           f"the last one is the healthy run when there is one)")
    logs = [json.loads(Path(workdir, f"rank{r}.json").read_text()) for r in range(cfg.world_size)]
    healthy_losses = json.loads(Path(workdir, "healthy.json").read_text()) if healthy is not None else []
    if ctl.operator_token:
        wait_acked(ctl, run, max((e["generation"] for log in logs for e in log), default=0))
    alerts, actions, incidents = collect(ctl, run) if ctl.operator_token else ([], [], [])
    return DemoResult(run=run, steps_completed=[log[-1]["step"] if log else 0 for log in logs],
                      alerts=alerts, actions=actions, rank_logs=logs, incidents=incidents,
                      healthy_losses=healthy_losses)


def _print_summary(cfg: DemoConfig, result: DemoResult) -> None:
    if cfg.quiet:
        return
    print(f"\nsummary of run {result.run}: every rank completed step {min(result.steps_completed)}")
    print("alerts:")
    for a in result.alerts:
        print(f"  step {a['step']!s:>5}  {a['severity']:<8} {a['rule']:<28} {a['summary']}")
        diag = a.get("diagnosis") or {}
        if a["generation"] is not None and diag:  # the alerts that acted: their diagnosis
            print(f"{'':14}likely: {'; '.join(diag.get('likely_causes', []))}")
            print(f"{'':14}try:    {'; '.join(diag.get('suggested_actions', []))}")
    print("actions (changes of desired state):")
    for a in result.actions:
        print(f"  gen {a['generation']:>3}  applied at step {a['applied_step']!s:>5}  by {a['actor']:<28} {a['change']}")
    print("incidents (the cause decided before the first action, its evidence, then the ladder rung by rung):")
    print(textwrap.indent(format_incidents(result.incidents), "  "))
    humans = sum(1 for a in result.actions if a["actor"].startswith("operator:"))
    final, healthy = result.final_loss(), result.healthy_final_loss()
    line = f"final loss (mean of the last 10 steps over every rank): {final:.3f}"
    if healthy is not None:
        line += f"; the same run without the faults: {healthy:.3f} ({final / healthy:.2f}x)"
    print(line)
    print(f"human interventions: {humans}")


def main(argv: Sequence[str] | None = None) -> int:
    defaults = DemoConfig()
    p = argparse.ArgumentParser(prog="trainguard demo", description=(
        "The whole story on one machine, no Docker: a controller, a small model trained on the CPU in "
        "gloo ranks with faults injected (bad data, an LR that jumps x100, a NaN loss) and recovered "
        "without anyone, beside the same run without faults; then a summary."))
    p.add_argument("--steps", type=int, default=defaults.steps, help=f"optimizer steps (default {defaults.steps})")
    p.add_argument("--world-size", type=int, default=defaults.world_size,
                   help=f"training ranks, one process each (default {defaults.world_size})")
    p.add_argument("--report-every", type=int, default=defaults.report_every,
                   help=f"steps per report to the controller (default {defaults.report_every})")
    p.add_argument("--controller", default=None, help="URL of a running controller (default: start one)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of the ranks' /metrics (default 127.0.0.1)")
    p.add_argument("--metrics-port", type=int, default=0, help="base port of the ranks' /metrics (0: free ports)")
    p.add_argument("--prometheus", action="store_true", help="also start Prometheus (binary on PATH)")
    p.add_argument("--keep-running", action="store_true",
                   help="keep the controller (and Prometheus) running after the summary, until Ctrl-C "
                        "(the default with --prometheus on a terminal)")
    p.add_argument("--workdir", default=None,
                   help="folder for the controller's database and the processes' logs (default: a new temporary one)")
    args = p.parse_args(argv)
    try:
        cfg = DemoConfig(steps=args.steps, world_size=args.world_size, report_every=args.report_every,
                         controller=args.controller, metrics_host=args.metrics_host,
                         metrics_port=args.metrics_port, prometheus=args.prometheus, workdir=args.workdir,
                         keep_running=args.keep_running or (args.prometheus and sys.stdin.isatty()))
    except ValueError as e:
        p.error(str(e))
    run_demo(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The straggler rules against a real 2-rank gloo job and synthetic jitter, and their cost per report.

``job``: a real data-parallel job of 2 CPU ranks (gloo, one process and one thread per rank, a
forward of about 20 ms), each rank's forward wall time per step saved to ``--out``; ``--slow F``
makes rank 1 slow from step 10 on: a real sleep of (F - 1) x its own forward of that step.
``replay``: those per-step rows (or ``--synthetic``: lognormal jitter with bursts of 3-5 slow steps
on a random rank, or a rank slow by ``--slow``) through the built-in ``forward_time_straggler``,
one report every ``--every`` steps (the report carries its last step's forward, as the agent's
does), printing the reports in which the rule finds a rank, the alerts (the finding turning on)
and the report that first names the slow rank. ``cost``: the straggler rules' evaluation per
report at ``--world`` ranks of healthy jitter. Compare two trees by running ``replay`` and ``cost``
with each tree on ``PYTHONPATH`` (the same saved rows):

    python bench/stragglers.py job --steps 200 --out healthy.json
    python bench/stragglers.py job --steps 200 --slow 2 --out slow2.json
    python bench/stragglers.py replay healthy.json --every 1
    python bench/stragglers.py replay --synthetic 8 --slow 1.5 --every 10
    python bench/stragglers.py cost --world 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

RULE = "forward_time_straggler"
STRAGGLERS = ("step_time_straggler", "forward_time_straggler", "input_wait_straggler")


def _rank(rank: int, init: str, steps: int, slow: float, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(384, 384) for _ in range(6)])
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    times: list[float] = []
    for step in range(steps):
        x = torch.randn(384, 384)
        t0 = time.perf_counter()
        y = ddp(x)
        if rank == 1 and slow > 1 and step >= 10:  # this rank's work is slow x the others' (not a synchronisation)
            time.sleep((slow - 1) * (time.perf_counter() - t0))
        times.append(time.perf_counter() - t0)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    got: list[list[float]] = [[], []]
    dist.all_gather_object(got, times)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"slow": slow, "forward_s": [list(r) for r in zip(*got)]}, f)
    dist.destroy_process_group()


def job(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(f"file://{tmp}/store", args.steps, args.slow, os.path.abspath(args.out)), nprocs=2)
    rows = np.array(json.load(open(args.out))["forward_s"])
    print(f"{len(rows)} steps; median forward per rank (s): {np.median(rows[10:], axis=0).round(4).tolist()}")


def _synthetic(world: int, steps: int, slow: float, rng: np.random.Generator) -> np.ndarray:
    """Forwards of 20 ms with lognormal jitter (sigma 0.1), and every ~40 steps a burst of 3-5
    steps on a random rank, 1.6-3x slower (a process that got less CPU); rank 1 ``slow`` x."""
    rows = 0.02 * rng.lognormal(0.0, 0.1, (steps, world))
    step = int(rng.integers(5, 40))
    while step < steps:
        length = int(rng.integers(3, 6))
        rows[step:step + length, int(rng.integers(0, world))] *= rng.uniform(1.6, 3.0, min(length, steps - step))
        step += length + int(rng.integers(20, 60))
    rows[10:, 1] *= slow
    return rows


def _verdicts(rows: np.ndarray, every: int) -> list[tuple[int, set[int]]]:
    """(step, ranks named) of each report of ``rows`` (steps x ranks), one every ``every`` steps."""
    from trainguard.service.evaluate import evaluate
    from trainguard.service.rules import default_rules_text, load_rules
    from trainguard.service.window import RunWindow

    rule = next(r for r in load_rules(default_rules_text()).for_job("bench") if r.name == RULE)
    window = RunWindow(capacity=128, rank_capacity=12, world_size=rows.shape[1], created=0.0)
    out = []
    for step in range(every, len(rows), every):  # (step 0: the warm-up, absent from the agent's reports)
        window.append_raw({}, {"forward_s": rows[step]}, step, float(step))
        (finding,) = evaluate((rule,), window, float(step))
        out.append((step, set(finding.values.get("ranks", ())) if finding.active else set()))
    return out


def replay(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.seed)
    runs = ([np.array(json.load(open(p))["forward_s"]) for p in args.rows] if args.rows else
            [_synthetic(args.synthetic, args.steps, args.slow, rng) for _ in range(args.runs)])
    active = alerts = reports = 0
    first: list[int] = []
    wrong = 0
    for rows in runs:
        seen = _verdicts(rows, args.every)
        caught = [step for step, named in seen if 1 in named]
        if args.slow > 1:
            first.append(caught[0] if caught else -1)
        reports += len(seen)
        before: set[int] = set()
        for step, named in seen:
            active += bool(named)
            alerts += bool(named - before)
            wrong += bool(named - {1}) if args.slow > 1 else 0
            before = named
    named_at = f"; rank 1 first named at step (median, max; -1: never) {statistics.median(first):g}, {max(first)}" if first else ""
    print(f"every {args.every}: {active} of {reports} reports name a rank, {alerts} alerts; "
          f"reports naming another rank: {wrong}{named_at}")


def cost(args: argparse.Namespace) -> None:
    from trainguard.service.evaluate import evaluate
    from trainguard.service.rules import default_rules_text, load_rules
    from trainguard.service.window import RunWindow

    rules = tuple(r for r in load_rules(default_rules_text()).for_job("bench") if r.name in STRAGGLERS)
    rng = np.random.default_rng(0)
    window = RunWindow(capacity=128, rank_capacity=12, world_size=args.world, created=0.0)
    base = {"step_time_s": 0.5, "forward_s": 0.05, "input_wait_s": 0.06}
    rows = [{v: b * rng.lognormal(0.0, 0.1, args.world) for v, b in base.items()} for _ in range(64)]
    per = []
    for rnd in range(5):
        t0 = time.process_time()
        for i, ranks in enumerate(rows):
            step = rnd * len(rows) + i
            window.append_raw({}, ranks, step, float(step))
            evaluate(rules, window, float(step))
        per.append((time.process_time() - t0) / len(rows))
    print(f"world {args.world}: the 3 straggler rules, CPU per report {min(per) * 1e6:.0f} us "
          f"(rounds: {', '.join(f'{p * 1e6:.0f}' for p in per)})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    j = sub.add_parser("job")
    j.add_argument("--steps", type=int, default=200)
    j.add_argument("--slow", type=float, default=1.0)
    j.add_argument("--out", required=True)
    r = sub.add_parser("replay")
    r.add_argument("rows", nargs="*")
    r.add_argument("--synthetic", type=int, default=0, help="ranks of synthetic jitter (instead of saved rows)")
    r.add_argument("--slow", type=float, default=1.0)
    r.add_argument("--steps", type=int, default=400)
    r.add_argument("--runs", type=int, default=20)
    r.add_argument("--every", type=int, default=1)
    r.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("cost")
    c.add_argument("--world", type=int, default=512)
    args = p.parse_args(argv)
    if args.what == "replay" and not (args.rows or args.synthetic):
        sys.exit("replay: give saved rows or --synthetic RANKS")
    if args.what == "replay" and args.rows:
        args.slow = max(json.load(open(path))["slow"] for path in args.rows)
    {"job": job, "replay": replay, "cost": cost}[args.what](args)


if __name__ == "__main__":
    main()

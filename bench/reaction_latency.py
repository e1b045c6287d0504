"""Reaction latency of the closed loop, and the control plane's cost per step.

Starts one ``trainguard serve`` (temporary SQLite file, the built-in rules with a NaN loss pausing the run) and a 2-rank gloo job
(DDP, CPU), both on loopback. Two parts, one process group:

1. **Reaction latency.** ``--trials`` runs; in each, every rank's batch holds a NaN at step
   ``--nan-step`` (``report_every=1``, ``sync_every=1``, ``skip_nonfinite=True`` so the weights stay
   finite). The controller's ``loss_nonfinite`` rule (set to pause, recovery off) answers that report with a paused desired state; the
   ranks apply it at a later step boundary. Printed per trial: the steps from the NaN step to the
   step at which the pause was applied on all ranks, the milliseconds from the NaN step's
   ``end_step`` call (the loss reaches the agent) to the pause applied on the last rank, and the
   controller round trip (report queued -> paused state known at the leader). The script resumes
   each run through the REST API as soon as it sees the pause.
2. **Overhead per step.** Configurations interleaved round by round, the same steps for each:
   the agent alone (the agent-metrics baseline, ``report_every=10`` and ``1``), the agent with the
   controller (agreement every step; report every 10, and every step), and the agent with
   ``skip_nonfinite`` (one sync + one all-reduce per step). Every step is CPU compute plus a fixed
   sleep standing for device time. Printed: median time inside ``agent.end_step`` (the agreement
   collective lives there; it also absorbs the ranks' skew, which the next DDP all-reduce would
   absorb otherwise) and median whole-step time (the honest total), each against its baseline;
   then the agreement collectives alone, both ranks ready, which is their pure cost.

    .venv/bin/python bench/reaction_latency.py [--trials 8] [--device-ms 45] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: name -> (config, the baseline it is compared with)
CONFIGS = {
    "agent only, report every 10 (baseline)": ({"report_every": 10}, None),
    "+ controller, report every 10": ({"report_every": 10, "controller": True}, "agent only, report every 10 (baseline)"),
    "+ skip_nonfinite, report every 10": ({"report_every": 10, "skip_nonfinite": True},
                                          "agent only, report every 10 (baseline)"),
    "agent only, report every step (baseline)": ({"report_every": 1}, None),
    "+ controller, report every step": ({"report_every": 1, "controller": True}, "agent only, report every step (baseline)"),
}


# ---------------------------------------------------------------------------------------------
# worker (one rank)
# ---------------------------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_agent as ta

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    out: dict = {"rank": rank, "latency": [], "overhead": {}}

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model, opt, agent, n: int, nan: bool = False) -> tuple[float, float, float, float]:  # type: ignore[no-untyped-def]
        """One training step; (seconds in end_step, seconds of the whole step, wall time at which
        end_step was called, CPU seconds of the whole process in the step: every thread, gloo's and
        the controller client's included, waits excluded)."""
        t0, c0 = time.perf_counter(), time.process_time()
        g = torch.Generator().manual_seed(rank * 7919 + n)
        x = torch.randn(32, 256, generator=g)
        if nan:
            x[0, 0] = math.nan
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(args.device_ms / 1e3)  # fixed emulated device time: every cost stays visible
        wall, t1 = time.time(), time.perf_counter()
        agent.end_step(loss)
        t2 = time.perf_counter()
        return t2 - t1, t2 - t0, wall, time.process_time() - c0

    # 1. reaction latency
    for k in range(args.trials):
        model, opt = make()
        agent = ta.attach(model, opt, job="bench-latency", run=f"{args.prefix}-lat-{k}",
                          config=ta.AgentConfig(controller=args.controller, report_every=1, metrics_port=None,
                                                skip_nonfinite=True))
        client = agent.control.client
        seen: dict[str, float] = {}
        if client is not None:  # the leader watches when its client learns of the pause
            def watch(c=client) -> None:  # type: ignore[no-untyped-def]
                while not (c.desired is not None and c.desired.paused):
                    time.sleep(0.0002)
                seen["t"] = time.time()
            threading.Thread(target=watch, daemon=True).start()
        nan_time = math.nan
        for n in range(1, args.nan_step + 12):
            _, _, wall, _ = step(model, opt, agent, n, nan=n == args.nan_step)
            if n == args.nan_step:
                nan_time = wall  # the NaN loss reaches the agent
        paused = [(a.step, a.time) for a in agent.control.history if a.paused]
        out["latency"].append({"nan_time": nan_time, "paused": paused[:1], "leader_knew": seen.get("t")})
        agent.close(5.0)

    # 2. overhead per step, interleaved
    for r in range(args.rounds):
        for i, (name, (cfg, _)) in enumerate(CONFIGS.items()):
            model, opt = make()
            agent = ta.attach(model, opt, job="bench-overhead", run=f"{args.prefix}-ovh-{r}-{i}",
                              config=ta.AgentConfig(controller=args.controller if cfg.get("controller") else None,
                                                    report_every=cfg["report_every"], metrics_port=None,
                                                    skip_nonfinite=cfg.get("skip_nonfinite", False)))
            for n in range(1, 11):
                step(model, opt, agent, n)  # warm-up
            times = [step(model, opt, agent, n) for n in range(11, 11 + args.steps)]
            out["overhead"].setdefault(name, []).append(times)
            agent.close(5.0)
    # 3. the agreement collectives alone, both ranks ready (after a barrier): their pure cost
    group = dist.new_group(backend="gloo")
    state = torch.zeros(5, dtype=torch.int64)
    row, rows = torch.zeros(11, dtype=torch.int64), torch.zeros(22, dtype=torch.int64)
    for name, op in (("broadcast of 5 int64", lambda: dist.broadcast(state, src=0, group=group)),
                     ("all-gather of 11 int64", lambda: dist.all_gather_into_tensor(rows, row, group=group)),
                     ("all-reduce of 1 int64 (skip flag)",
                      lambda: dist.all_reduce(state[:1], op=dist.ReduceOp.MAX, group=group))):
        samples = []
        for _ in range(300):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            op()
            samples.append(time.perf_counter() - t0)
        out.setdefault("collectives", {})[name] = statistics.median(samples[50:])
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------
def _pausing_rules(directory: Path) -> Path:
    """The built-in rules with a NaN loss pausing the run for a human and automatic recovery off:
    the built-in ladder answers a NaN the agent already skipped with nothing, or a rollback, so a
    pause is what gives one measurable, deterministic answer to time."""
    from importlib.resources import files

    import yaml

    rules = yaml.safe_load((files("trainguard.service") / "default_rules.yaml").read_text())
    rules["recovery"] = {"enabled": False}
    for r in rules["rules"]:
        if r["name"] == "loss_nonfinite":
            r["actions"] = ["pause", "notify"]
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    return path


def _start_controller(db: Path) -> tuple[subprocess.Popen[str], str]:
    exe = str(Path(sys.executable).with_name("trainguard"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.Popen([exe, "serve", "--host", "127.0.0.1", "--port", "0", "--db", str(db),
                             "--rules", str(_pausing_rules(db.parent))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, m.group(1)
    raise SystemExit("trainguard serve did not start")


def _resumer(url: str, runs: list[str], stop: threading.Event) -> None:
    """Resume each latency run once every rank has applied its pause (the leader's ack). A resume
    sent before that would supersede the pause: level-based, the ranks would never pause."""
    import httpx

    pending = list(runs)
    with httpx.Client(base_url=url, timeout=5.0) as http:
        while pending and not stop.is_set():
            run = pending[0]
            r = http.get(f"/v1/runs/{run}")
            d = r.json() if r.status_code == 200 else None
            if d and d["desired"]["paused"] and d["applied_generation"] >= d["desired"]["generation"]:
                http.post(f"/v1/runs/{run}/resume", json={"reason": "bench"})
                pending.pop(0)
            else:
                time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=8, help="NaN injections (one run each)")
    ap.add_argument("--nan-step", type=int, default=12)
    ap.add_argument("--device-ms", type=float, default=45.0,
                    help="emulated device time added to every step (a sleep), on top of the CPU compute")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the overhead part")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per configuration and round")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--controller", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", default="bench", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return

    tmp = Path(tempfile.mkdtemp(prefix="trainguard-bench-"))
    ctl, url = _start_controller(tmp / "trainguard.db")
    prefix = f"b{int(time.time())}"
    stop = threading.Event()
    resumer = threading.Thread(target=_resumer, args=(url, [f"{prefix}-lat-{k}" for k in range(args.trials)], stop),
                               daemon=True)
    resumer.start()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            cmd = [sys.executable, __file__, "--worker", "--controller", url, "--out", str(tmp), "--prefix", prefix,
                   "--trials", str(args.trials), "--nan-step", str(args.nan_step), "--device-ms", str(args.device_ms),
                   "--rounds", str(args.rounds), "--steps", str(args.steps)]
            procs.append(subprocess.Popen(cmd, env=env))
        codes = [p.wait(1800) for p in procs]
        if codes != [0, 0]:
            raise SystemExit(f"workers failed: {codes}")
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
        ctl.kill()
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    _print(args, ranks)


def _print(args: argparse.Namespace, ranks: list[dict]) -> None:
    print(f"2 gloo ranks (DDP, CPU), steps of CPU compute + {args.device_ms:g} ms emulated device time; latency "
          f"part: report_every=1, sync_every=1, NaN at step {args.nan_step}, NaN rule set to pause\n")
    print("trial  steps to pause (all ranks)  ms NaN end_step -> paused on last rank  controller round trip ms")
    print("       (the NaN loss reaches the agent in end_step of the NaN step; the round trip is from there to the")
    print("        moment the leader's client holds the paused state: report queued, sent, rules, answer)")
    lat_ms, steps, rtt = [], [], []
    for k in range(args.trials):
        t = [r["latency"][k] for r in ranks]
        if not all(x["paused"] for x in t):
            print(f"{k:5d}  not paused")
            continue
        at = {x["paused"][0][0] for x in t}
        assert len(at) == 1, f"ranks paused at different steps: {at}"  # never: agreement
        applied_last = max(x["paused"][0][1] for x in t)
        nan_time = t[0]["nan_time"]
        s = at.pop() - args.nan_step
        ms = (applied_last - nan_time) * 1e3
        knew = t[0]["leader_knew"]
        rt = (knew - nan_time) * 1e3 if knew else math.nan
        lat_ms.append(ms)
        steps.append(s)
        rtt.append(rt)
        print(f"{k:5d}  {s:26d}  {ms:38.1f}  {rt:24.1f}")
    if lat_ms:
        print(f"\nmedian: {statistics.median(steps):g} step(s), {statistics.median(lat_ms):.1f} ms "
              f"(max {max(lat_ms):.1f} ms); controller round trip median {statistics.median(rtt):.1f} ms")

    print("\noverhead per step (median over both ranks x rounds x steps; CPU = the whole process's CPU time")
    print("in the step, all threads, waits excluded: the measure that does not depend on how busy the cores are):")
    print(f"{'configuration':42s} {'end_step ms':>11s} {'vs base':>9s} {'step ms':>8s} {'vs base':>8s} "
          f"{'CPU ms':>7s} {'vs base':>9s}")
    medians = {}
    for name, (_, base) in CONFIGS.items():
        samples = [s for r in ranks for rnd in r["overhead"][name] for s in rnd]
        m = tuple(statistics.median(s[i] for s in samples) * 1e3 for i in (0, 1, 3))
        medians[name] = m
        end, whole, cpu = m
        if base is None:
            print(f"{name:42s} {end:11.3f} {'':>9s} {whole:8.2f} {'':>8s} {cpu:7.3f}")
        else:
            b_end, b_whole, b_cpu = medians[base]
            print(f"{name:42s} {end:11.3f} {end - b_end:+9.3f} {whole:8.2f} {100 * (whole - b_whole) / b_whole:+7.2f}% "
                  f"{cpu:7.3f} {cpu - b_cpu:+9.3f}")
    print("\nagreement collectives alone (side gloo group, CPU tensors, both ranks ready; median):")
    for name in ranks[0]["collectives"]:
        print(f"  {name:36s} {max(r['collectives'][name] for r in ranks) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()

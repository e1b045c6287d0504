"""Recovery without a human: faults injected into small training runs, and what trainguard did.

Starts one ``trainguard serve`` (temporary SQLite file, default rules) on loopback. Each case is a
small byte-level GPT (``trainguard.demo.model.TinyGPT``) trained on CPU with AdamW and the user's
own LR schedule (warm-up, then constant), one process, the agent attached with the controller
(``skip_spikes`` on by default with a controller; ``snapshot_every``/``snapshot_keep`` set). Cases:

- ``healthy-sN``: no fault, seeds N.
- ``sched-NAME``: no fault, the user's schedule is NAME (healthy schedules that move the LR a lot):
  ``warm_restarts`` (20-step linear warm-up, then cosine with warm restarts, T_0=60, eta_min=1e-5),
  ``onecycle`` (PyTorch's OneCycleLR shape), ``wsd`` (warm-up, stable, a linear decay over the last
  20 %), ``step`` (x0.3 every 80 steps).
- ``lr-xK``: the user's schedule multiplies the LR by K from ``--onset`` on, for good.
- ``lr-xK-N``: the same for N steps only (a transient fault), on the warm-restarts schedule.
- ``burst``: the batches of ``--burst`` steps from the onset are random bytes (corrupted data).
- ``poison``: one batch at the onset has its loss weighted x1e4 (a mis-scaled sample).
- ``nan``: one batch at the onset has a NaN loss.
- ``fp16-overflow``: mixed precision (float16 autocast on the CPU, a GradScaler); for 10 steps from
  the onset the loss is weighted x1e4, so the scaled gradients overflow float16, the GradScaler
  skips and halves its scale, and the steps it finally takes carry gradients 1e4x too large.

Printed per case: the detection lag (steps from the onset to the first action: a skipped step or
an applied desired-state change), the rungs the controller took (from ``GET
/v1/runs/{run}/incidents``), whether it recovered (final loss — mean of the last 20 steps — within
1.2x the healthy runs' median, and the run not paused), steps skipped by the spike guard, steps
lost to rollbacks (restore step - snapshot step, summed), the final lr_scale. For the healthy
runs: actions taken (should be 0).

Also printed: the final loss of the same case trained without trainguard (``plain``) and the ratio,
and for the transient faults the steps from the end of the fault until ``lr_scale`` is back within 2x
of the schedule (``back``).

    .venv/bin/python bench/recovery.py [--steps 400] [--onset 200] [--seeds 3] [--report-every 10] [--cases a,b]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import torch

import trainer_agent as ta
from trainguard.demo.model import ByteCorpus, TinyGPT, next_byte_loss, stdlib_source_bytes


def stop_when_paused(url: str, run: str, done: threading.Event, paused: list[bool]) -> None:
    """A pause blocks the loop in end_step (every rank waits there); the bench plays the human who
    ends the run, and counts it as not recovered (``paused`` gets True)."""
    with httpx.Client(base_url=url, timeout=5) as c:
        while not done.wait(0.2):
            r = c.get(f"/v1/runs/{run}")
            if r.status_code == 200 and r.json()["status"] == "paused":
                paused.append(True)
                c.post(f"/v1/runs/{run}/stop", json={"reason": "bench: paused for a human"})
                return


def _start_controller(db: Path) -> tuple[subprocess.Popen[str], str]:
    exe = str(Path(sys.executable).with_name("trainguard"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    proc = subprocess.Popen([exe, "serve", "--host", "127.0.0.1", "--port", "0", "--db", str(db)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, m.group(1)
    raise SystemExit("trainguard serve did not start")


def shape(name: str, step: int, steps: int) -> float:
    """The user's own schedule (a factor of the peak LR) at ``step``."""
    if name == "constant":  # warm-up, then constant
        return min(1.0, (step + 1) / 50)
    if name == "warm_restarts":  # as CosineAnnealingWarmRestarts(T_0=60, eta_min=1e-5) after a 20-step warm-up
        if step < 20:
            return 0.05 + 0.95 * step / 20
        t = (step - 20) % 60
        return 5e-3 + (1 - 5e-3) * (1 + math.cos(math.pi * t / 60)) / 2
    if name == "onecycle":  # OneCycleLR: cosine up from 1/25 over 30 %, cosine down to 1/1e4 of that
        up = int(0.3 * steps)
        if step < up:
            return 0.04 + 0.96 * (1 - math.cos(math.pi * step / up)) / 2
        return 4e-6 + (1 - 4e-6) * (1 + math.cos(math.pi * (step - up) / (steps - up))) / 2
    if name == "wsd":  # warm-up, stable, linear decay over the last 20 %
        decay = int(0.8 * steps)
        return min(1.0, (step + 1) / 20) if step < decay else max(0.0, (steps - step) / (steps - decay))
    if name == "step":
        return 0.3 ** (step // 80)
    raise SystemExit(f"unknown schedule {name!r}")


def run_case(name: str, url: str | None, args: argparse.Namespace, corpus: ByteCorpus, *, seed: int = 0,
             lr_mult: float = 1.0, burst: int = 0, poison: bool = False, nan: bool = False,
             fp16_overflow: bool = False, schedule_name: str = "constant", fault_steps: int | None = None) -> dict:
    """One case; ``url`` None: the same run without trainguard (no agent at all)."""
    torch.manual_seed(seed)
    model = TinyGPT(seq_len=args.seq_len, d_model=64, n_layers=2, n_heads=4)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    onset = args.onset
    fault_end = math.inf if fault_steps is None else onset + fault_steps

    def schedule(step: int) -> float:  # the user's own schedule, and the fault
        return shape(schedule_name, step, args.steps) * (lr_mult if onset <= step < fault_end else 1.0)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if url is None:
        return _run_plain(name, model, opt, sched, args, corpus, seed=seed, burst=burst, poison=poison, nan=nan,
                          fp16_overflow=fp16_overflow)
    scaler = torch.amp.GradScaler("cpu") if fp16_overflow else None
    run = f"{name}-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    agent = ta.attach(model, opt, job="recovery-bench", run=run, lr_scheduler=sched, controller=url, scaler=scaler,
                      config=ta.AgentConfig(metrics_port=None, report_every=args.report_every,
                                            snapshot_every=50, snapshot_keep=4))
    losses: list[float] = []
    first_action: int | None = None
    scales: list[float] = []  # lr_scale in force after each step
    done = threading.Event()
    was_paused: list[bool] = []

    watcher = threading.Thread(target=stop_when_paused, args=(url, run, done, was_paused), daemon=True)
    watcher.start()
    g = torch.Generator().manual_seed(seed + 7)
    faults = dict(burst=burst, poison=poison, nan=nan, fp16_overflow=fp16_overflow)
    for step in range(args.steps):
        skipped_before = agent.control.skip.skipped
        gens_before = agent.control.applied_generation
        loss, amp_skipped = _train_step(step, model, opt, sched, scaler, corpus, args, g, seed, **faults)
        agent.end_step(loss.detach())
        acted = (agent.control.skip.skipped > skipped_before or agent.control.applied_generation > gens_before
                 or amp_skipped)
        if acted and first_action is None:
            first_action = step
        scales.append(agent.control.lr_scale)
        losses.append(float(loss.detach()))
        if agent.should_stop:
            break
    done.set()
    watcher.join()
    back: int | None = None  # steps after a transient fault until lr_scale stays within 2x of the schedule
    if fault_steps is not None and len(scales) > fault_end:
        low = [k for k in range(int(fault_end), len(scales)) if scales[k] < 0.5]
        back = (low[-1] + 1 - int(fault_end)) if low else 0
        if low and low[-1] == len(scales) - 1:
            back = None  # never back
    history = list(agent.control.history)
    skipped = dict(agent.control.skip.skipped_by_reason)
    paused = bool(was_paused)
    scale = agent.control.lr_scale
    agent.close(5.0)
    with httpx.Client(base_url=url, timeout=10) as c:
        incidents = c.get(f"/v1/runs/{run}/incidents").json()["incidents"]
    lost = sum(h.step - h.restored_step for h in history if h.restored_step is not None)
    rungs = [r["rung"] for inc in reversed(incidents) for r in inc["rungs"]]
    finite = [x for x in losses[-20:] if x == x]
    print(f"  {name}: {len(losses)} steps, final loss {statistics.fmean(x for x in losses[-20:] if x == x):.3f}, "
          f"rungs {rungs}", file=sys.stderr, flush=True)
    for inc in reversed(incidents):
        print(f"    incident {inc['id']} onset {inc['onset_step']} cause {inc['cause']}: {inc['verdict'].get('summary', '')}",
              file=sys.stderr, flush=True)
        for r in inc["rungs"]:
            print(f"    step {r['step']} {r['rung']}: {r['reason'][:240]}", file=sys.stderr, flush=True)
    if args.trace:
        _print_alerts(url, run)
    return {"name": name, "final_loss": statistics.fmean(finite) if finite else float("nan"), "paused": paused,
            "first_action": first_action, "actions": len(history) + sum(skipped.values()), "skipped": skipped,
            "rungs": rungs, "lost": lost, "scale": scale, "steps": len(losses),
            "outcomes": [inc["outcome"] for inc in reversed(incidents)], "back": back}


def _print_alerts(url: str, run: str) -> None:
    """Every alert the run's reports raised, with the step of the report (``--trace``)."""
    with httpx.Client(base_url=url, timeout=10) as c:
        events = c.get(f"/v1/runs/{run}/events", params={"limit": 5000}).json()
    for ev in events:
        if ev["kind"] == "alert":
            print(f"    alert {ev['actor']}: {ev['reason'][:200]}", file=sys.stderr, flush=True)


def _train_step(step: int, model: TinyGPT, opt: torch.optim.Optimizer, sched: Any, scaler: Any, corpus: ByteCorpus,
                args: argparse.Namespace, g: torch.Generator, seed: int, *, burst: int, poison: bool, nan: bool,
                fp16_overflow: bool) -> tuple[torch.Tensor, bool]:
    """One training step with the case's faults: (its loss, whether the GradScaler skipped it)."""
    onset = args.onset
    ids, mask = corpus.batch(step + seed * 100_000, 0)
    if burst and onset <= step < onset + burst:
        ids = torch.randint(1, 256, ids.shape, generator=g)
    with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
        loss = next_byte_loss(model, ids, mask)
    weighted = loss
    if poison and step == onset:
        weighted = loss * 1e4
    if nan and step == onset:
        weighted = loss * float("nan")
    if fp16_overflow and onset <= step < onset + 10:
        weighted = loss * 1e4
    amp_skipped = False
    if scaler is not None:
        scaler.scale(weighted).backward()
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        amp_skipped = scaler.get_scale() < scale_before  # the GradScaler skipped the step
    else:
        weighted.backward()
        opt.step()
    opt.zero_grad()
    sched.step()
    return loss, amp_skipped


def _run_plain(name: str, model: TinyGPT, opt: torch.optim.Optimizer, sched: Any, args: argparse.Namespace,
               corpus: ByteCorpus, *, seed: int, **faults: Any) -> dict:
    """The same training loop and faults, without trainguard."""
    scaler = torch.amp.GradScaler("cpu") if faults["fp16_overflow"] else None
    g = torch.Generator().manual_seed(seed + 7)
    losses = [float(_train_step(step, model, opt, sched, scaler, corpus, args, g, seed, **faults)[0].detach())
              for step in range(args.steps)]
    finite = [x for x in losses[-20:] if x == x]
    return {"name": name, "final_loss": statistics.fmean(finite) if finite else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--onset", type=int, default=200)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--burst", type=int, default=30)
    p.add_argument("--report-every", type=int, default=10,
                   help="the agent's report interval: faults only the controller sees wait for a report")
    p.add_argument("--cases", default="",
                   help="comma-separated case names to run (default: all), e.g. sched-warm_restarts,lr-x1000-3")
    p.add_argument("--trace", action="store_true", help="also print every alert each run raised")
    args = p.parse_args()
    torch.set_num_threads(1)
    corpus = ByteCorpus(stdlib_source_bytes(1 << 20), seq_len=args.seq_len, batch_size=args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start_controller(Path(tmp) / "tg.db")
        try:
            t0 = time.monotonic()
            cases: dict[str, dict[str, Any]] = {f"healthy-s{s}": {"seed": s} for s in range(args.seeds)}
            cases.update({f"sched-{n}": {"schedule_name": n} for n in ("warm_restarts", "onecycle", "wsd", "step")})
            cases.update({f"lr-x{k}": {"lr_mult": k} for k in (10, 100, 1000)})
            cases.update({f"lr-x{k}-{n}": {"lr_mult": k, "fault_steps": n, "schedule_name": "warm_restarts"}
                          for k, n in ((1000, 3), (200, 5))})
            cases.update({"burst": {"burst": args.burst}, "poison": {"poison": True}, "nan": {"nan": True},
                          "fp16-overflow": {"fp16_overflow": True}})
            chosen = [c for c in args.cases.split(",") if c] or list(cases)
            unknown = [c for c in chosen if c not in cases]
            if unknown:
                raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(cases)}")
            results = []
            for c in chosen:
                r = run_case(c, url, args, corpus, **cases[c])
                r["plain"] = run_case(c, None, args, corpus, **cases[c])["final_loss"]
                results.append(r)
            healthy = [r for r in results if r["name"].startswith(("healthy", "sched"))]
            faulty = [r for r in results if r not in healthy]
            wall = time.monotonic() - t0
        finally:
            proc.terminate()
            proc.wait(10)
    ref = statistics.median(r["final_loss"] for r in healthy) if healthy else statistics.median(r["plain"] for r in results)
    print(f"healthy median final loss {ref:.3f} (mean of the last 20 steps); recovered = final loss <= "
          f"{1.2 * ref:.3f} and not paused\n")
    print(f"{'case':<20} {'first':>5} {'lag':>4} {'recovered':>9} {'final':>7} {'plain':>7} {'ratio':>6} {'scale':>9} "
          f"{'back':>5} {'skipped':>8} {'lost':>5} {'cost':>5}  rungs / outcome")
    for r in healthy + faulty:
        fault = r in faulty
        lag = "" if r["first_action"] is None or not fault else r["first_action"] - args.onset
        rec = r["final_loss"] <= 1.2 * ref and not r["paused"]
        sk = f"{r['skipped']['spike']}+{r['skipped']['nonfinite']}"
        cost = sum(r["skipped"].values()) + r["lost"]
        first = "-" if r["first_action"] is None else r["first_action"]
        back = "" if r["back"] is None else r["back"]
        print(f"{r['name']:<20} {first!s:>5} {lag!s:>4} {('yes' if rec else 'NO'):>9} {r['final_loss']:>7.3f} "
              f"{r['plain']:>7.3f} {r['final_loss'] / r['plain']:>6.3f} {r['scale']:>9.4g} {back!s:>5} "
              f"{sk:>8} {r['lost']:>5} {cost:>5}  {' > '.join(r['rungs']) or '-'} / {','.join(r['outcomes']) or '-'}")
    n_rec = sum(1 for r in faulty if r["final_loss"] <= 1.2 * ref and not r["paused"])
    false_actions = sum(r["actions"] for r in healthy)  # any skip or applied change on a healthy run
    print(f"\nfaulty runs recovered with no human: {n_rec}/{len(faulty)}; actions on healthy runs: {false_actions}; "
          f"wall {wall:.0f} s")
    print("first = step of the first action; plain = final loss of the same case without trainguard; ratio = final / "
          "plain; back = steps after a transient fault until lr_scale >= 0.5 (within 2x of the schedule)")
    print("skipped = spike+nonfinite steps skipped by the agent; lost = steps rolled back; cost = skipped + lost; "
          "lag = steps from the "
          "onset to the first action (a step skipped by the agent or the GradScaler, or a desired state applied)")


if __name__ == "__main__":
    main()

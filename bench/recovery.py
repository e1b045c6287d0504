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
- ``healthy-fp16-sum``: no fault; mixed precision as above and the loss summed over 4,096 tokens
  (weighted x4096 for the backward pass): the GradScaler skips the first steps until its scale
  fits, and the gradient norms are in the thousands from the first step taken.

Printed per case: the detection lag (steps from the onset to the first action: a skipped step or
an applied desired-state change), the rungs the controller took (from ``GET
/v1/runs/{run}/incidents``), whether it recovered (final loss — mean of the last 20 steps — within
1.2x the healthy runs' median, and the run not paused), steps skipped by the spike guard, steps
lost to rollbacks (restore step - snapshot step, summed), the final lr_scale. For the healthy
runs: actions taken (should be 0).

Also printed: the final loss of the same case trained without trainguard (``plain``) and the ratio,
and for the transient faults the steps from the end of the fault until ``lr_scale`` is back within 2x
of the schedule (``back``).

A second table: the same cases under OLMo-core's real ``SkipStepAdamW`` (PyPI ``ai2-olmo-core``) in
place of AdamW, no trainguard: the same model, seed, data, LR schedule (``LambdaLR`` on it) and fault
as ``plain``, the same LR, betas, eps and weight decay, and OLMo's defaults (``sigma_factor`` 6,
``rolling_interval_length`` 128, foreach). It is driven as OLMo-core's ``TransformerTrainModule``
drives it: after the backward pass ``latest_loss`` is the loss that was backpropagated (for ``poison``,
``nan`` and ``fp16-overflow`` the weighted one), then ``latest_grad_norm`` the total gradient norm
(``--olmo-max-grad-norm``: ``inf`` by default, the norm recorded and nothing clipped, so the run
differs from ``plain`` only by the skips; ``none``, the loss alone; a number, clipping), then
``step()``. No process group is needed. A step the GradScaler skips never reaches the optimizer and
records nothing. Per case: the final loss, the ratio to ``plain``, the steps ``SkipStepAdamW`` took with
a step factor of 0 (``skipped``), ``heals`` for a fault (the bench's recovered: final loss within
1.2x the healthy runs' median; it never pauses), ``harms`` for a healthy run or schedule (any
skipped step, or a final loss above 1.02x ``plain``), and trainguard's recovered or harms (any
action, or above 1.02x ``plain``) beside it. OLMo-core runs in a worker process that appends
``--olmo-core-path`` (default ``.bench-olmo`` beside the repo root; ``bash bench/olmo_core_env.sh``
installs it there, outside the venv, because ai2-olmo-core requires ``filelock<4.0`` and
constraints.txt pins 4.3.1) to its ``sys.path``; when it cannot import it the bench prints one line
saying so and skips the column (``--no-olmo-core`` skips it on purpose).

    .venv/bin/python bench/recovery.py [--steps 400] [--onset 200] [--seeds 3] [--report-every 10] [--cases a,b]
        [--olmo-core-path DIR] [--olmo-max-grad-norm inf|none|X] [--no-olmo-core]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import multiprocessing
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
             fp16_overflow: bool = False, schedule_name: str = "constant", fault_steps: int | None = None,
             olmo: Any = None, fp16: bool = False, loss_weight: float = 1.0) -> dict:
    """One case; ``url`` None: the same run without trainguard (no agent at all); ``olmo`` (a
    ``_SkipStepDriver``, with ``url`` None): that run with OLMo-core's ``SkipStepAdamW`` for AdamW."""
    torch.manual_seed(seed)
    model = TinyGPT(seq_len=args.seq_len, d_model=64, n_layers=2, n_heads=4)
    if olmo is None:
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    else:  # the same hyperparameters (betas 0.9/0.999, eps 1e-8 are both defaults), and OLMo's skip defaults
        opt = olmo.optimizer(model.parameters(), lr=2e-3, weight_decay=0.01)
    onset = args.onset
    fault_end = math.inf if fault_steps is None else onset + fault_steps

    def schedule(step: int) -> float:  # the user's own schedule, and the fault
        return shape(schedule_name, step, args.steps) * (lr_mult if onset <= step < fault_end else 1.0)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if url is None:
        return _run_plain(name, model, opt, sched, args, corpus, seed=seed, burst=burst, poison=poison, nan=nan,
                          fp16_overflow=fp16_overflow, olmo=olmo, fp16=fp16, loss_weight=loss_weight)
    scaler = torch.amp.GradScaler("cpu") if fp16_overflow or fp16 else None
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
    faults = dict(burst=burst, poison=poison, nan=nan, fp16_overflow=fp16_overflow, loss_weight=loss_weight)
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
                fp16_overflow: bool, olmo: Any = None, loss_weight: float = 1.0) -> tuple[torch.Tensor, bool]:
    """One training step with the case's faults: (its loss, whether the GradScaler skipped it).

    ``olmo`` (a ``_SkipStepDriver``): ``opt`` is OLMo-core's ``SkipStepAdamW``; the driver records the
    step's loss and gradient norm on it before ``opt.step()``, as OLMo-core's train module does."""
    onset = args.onset
    ids, mask = corpus.batch(step + seed * 100_000, 0)
    if burst and onset <= step < onset + burst:
        ids = torch.randint(1, 256, ids.shape, generator=g)
    with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
        loss = next_byte_loss(model, ids, mask)
    weighted = loss * loss_weight if loss_weight != 1.0 else loss
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
        if olmo is not None:
            scaler.unscale_(opt)  # what scaler.step does first anyway; the driver needs the true gradient norm
            olmo.before_step(opt, model, weighted, amp=True)
        scaler.step(opt)
        scaler.update()
        amp_skipped = scaler.get_scale() < scale_before  # the GradScaler skipped the step
    else:
        weighted.backward()
        if olmo is not None:
            olmo.before_step(opt, model, weighted, amp=False)
        opt.step()
    if olmo is not None and not amp_skipped and float(opt.step_skipped) > 0:
        olmo.skipped.append(step)  # SkipStepAdamW took this step with a step factor of 0
    opt.zero_grad()
    sched.step()
    return loss, amp_skipped


HARM_TOL = 1.02  # a healthy run is harmed when its final loss is above 1.02x plain (or any step was skipped)


class _SkipStepDriver:
    """Drives OLMo-core's ``SkipStepAdamW`` the way OLMo-core's ``TransformerTrainModule`` does.

    Its ``train_batch`` sets ``optim.latest_loss`` to the batch loss it backpropagated (detached), and
    its ``optim_step`` computes the total gradient norm (``nn.utils.get_total_norm``, then
    ``clip_grads_with_norm_``), sets ``optim.latest_grad_norm`` (only when ``max_grad_norm`` is set),
    sets the LR from the schedule and calls ``optim.step()``. The optimizer keeps the last 129 of each and
    takes the step with a factor of 0 when the loss, or the gradient norm, is more than ``sigma_factor``
    (6) standard deviations above the mean of the previous ones (from 64 recorded steps on). No process
    group is needed: it uses ``torch.distributed`` only to pick a device when it has no parameters.

    ``max_grad_norm`` inf (the default here): the norm is recorded and no gradient is scaled, so the run
    differs from ``plain`` only by the skips; None: OLMo's config default, the loss alone is recorded;
    a number: clipping as in OLMo's recipes (1.0). With a GradScaler (the fp16 case, which OLMo-core's
    trainer does not use), a step the GradScaler skips never reaches ``SkipStepAdamW.step()``, so
    nothing is recorded for it (an inf norm in the window would skip the next 128 steps)."""

    def __init__(self, optimizer_cls: Any, max_grad_norm: float | None) -> None:
        self.optimizer_cls = optimizer_cls
        self.max_grad_norm = max_grad_norm
        self.skipped: list[int] = []  # steps SkipStepAdamW took with a step factor of 0, this run

    def optimizer(self, params: Any, **kw: Any) -> torch.optim.Optimizer:
        self.skipped = []
        # SkipStepAdamWConfig's defaults: foreach=True, rolling_interval_length=128, sigma_factor=6
        return self.optimizer_cls(params, foreach=True, **kw)

    def before_step(self, opt: Any, model: torch.nn.Module, loss: torch.Tensor, *, amp: bool) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if amp and not all(bool(torch.isfinite(x).all()) for x in grads):
            return  # the GradScaler skips this step (its own inf/NaN check on the unscaled gradients)
        opt.latest_loss = loss.detach().float()
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
            if math.isfinite(self.max_grad_norm):
                torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), self.max_grad_norm, norm)
            opt.latest_grad_norm = norm


_OLMO: dict[str, Any] = {}  # the OLMo worker process's state


def _olmo_worker_init(path: str, args: argparse.Namespace, max_grad_norm: float | None) -> None:
    """In the worker process only: OLMo-core's directory is appended to ``sys.path`` there (after the
    venv's, so nothing in it can shadow a venv package), and its import side effects (environment
    variables, warning filters) stay out of the trainguard and plain runs."""
    torch.set_num_threads(1)
    try:
        sys.path.append(path)
        import importlib.metadata

        from olmo_core.optim import SkipStepAdamW  # type: ignore[import-not-found]

        _OLMO["version"] = importlib.metadata.version("ai2-olmo-core")
        _OLMO["driver"] = _SkipStepDriver(SkipStepAdamW, max_grad_norm)
    except Exception as e:  # noqa: BLE001 - any failure only skips the column
        _OLMO["error"] = f"{type(e).__name__}: {e}"
        return
    _OLMO["args"] = args
    _OLMO["corpus"] = ByteCorpus(stdlib_source_bytes(1 << 20), seq_len=args.seq_len, batch_size=args.batch)


def _olmo_probe() -> tuple[str | None, str | None]:
    return _OLMO.get("version"), _OLMO.get("error")


def _olmo_case(name: str, kwargs: dict[str, Any]) -> dict:
    return run_case(name, None, _OLMO["args"], _OLMO["corpus"], olmo=_OLMO["driver"], **kwargs)


def _start_olmo(args: argparse.Namespace) -> tuple[concurrent.futures.ProcessPoolExecutor | None, str | None]:
    """The worker for the OLMo column, or (None, None) after one line saying why it is skipped."""
    if args.no_olmo_core:
        return None, None
    max_norm = None if args.olmo_max_grad_norm.lower() == "none" else float(args.olmo_max_grad_norm)
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_olmo_worker_init,
                                                  initargs=(args.olmo_core_path, args, max_norm))
    try:
        version, err = pool.submit(_olmo_probe).result()
    except Exception as e:  # noqa: BLE001
        version, err = None, f"{type(e).__name__}: {e}"
    if err is None:
        return pool, version
    pool.shutdown(cancel_futures=True)
    print(f"OLMo-core column skipped: cannot import olmo_core.optim.SkipStepAdamW from {args.olmo_core_path} ({err}); "
          f"install it there with: bash bench/olmo_core_env.sh", flush=True)
    return None, None


def _ranges(steps: list[int], width: int = 24) -> str:
    """``[200, 201, 202, 250]`` -> ``200-202,250``, cut to ``width`` characters."""
    runs: list[list[int]] = []
    for k in steps:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    out = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return out if len(out) <= width else out[: width - 3] + "..."


def _run_plain(name: str, model: TinyGPT, opt: torch.optim.Optimizer, sched: Any, args: argparse.Namespace,
               corpus: ByteCorpus, *, seed: int, **faults: Any) -> dict:
    """The same training loop and faults, without trainguard."""
    fp16 = faults.pop("fp16")
    scaler = torch.amp.GradScaler("cpu") if faults["fp16_overflow"] or fp16 else None
    g = torch.Generator().manual_seed(seed + 7)
    losses = [float(_train_step(step, model, opt, sched, scaler, corpus, args, g, seed, **faults)[0].detach())
              for step in range(args.steps)]
    finite = [x for x in losses[-20:] if x == x]
    out = {"name": name, "final_loss": statistics.fmean(finite) if finite else float("nan")}
    if faults.get("olmo") is not None:
        out["skipped_steps"] = list(faults["olmo"].skipped)
    return out


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
    p.add_argument("--olmo-core-path", default=str(Path(__file__).resolve().parents[1] / ".bench-olmo"),
                   help="directory holding ai2-olmo-core for the SkipStepAdamW column (bash bench/olmo_core_env.sh "
                        "installs it); appended to sys.path in the OLMo worker process only")
    p.add_argument("--olmo-max-grad-norm", default="inf",
                   help="OLMo-core train module's max_grad_norm for the SkipStepAdamW runs: inf (default: the grad "
                        "norm is recorded, nothing clipped), none (the loss alone is recorded), or a number (clipping)")
    p.add_argument("--no-olmo-core", action="store_true", help="skip the SkipStepAdamW column")
    args = p.parse_args()
    torch.set_num_threads(1)
    corpus = ByteCorpus(stdlib_source_bytes(1 << 20), seq_len=args.seq_len, batch_size=args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start_controller(Path(tmp) / "tg.db")
        olmo_pool, olmo_version = _start_olmo(args)
        try:
            t0 = time.monotonic()
            cases: dict[str, dict[str, Any]] = {f"healthy-s{s}": {"seed": s} for s in range(args.seeds)}
            cases.update({f"sched-{n}": {"schedule_name": n} for n in ("warm_restarts", "onecycle", "wsd", "step")})
            cases.update({f"lr-x{k}": {"lr_mult": k} for k in (10, 100, 1000)})
            cases.update({f"lr-x{k}-{n}": {"lr_mult": k, "fault_steps": n, "schedule_name": "warm_restarts"}
                          for k, n in ((1000, 3), (200, 5))})
            cases.update({"burst": {"burst": args.burst}, "poison": {"poison": True}, "nan": {"nan": True},
                          "fp16-overflow": {"fp16_overflow": True},
                          "healthy-fp16-sum": {"fp16": True, "loss_weight": 4096.0}})
            chosen = [c for c in args.cases.split(",") if c] or list(cases)
            unknown = [c for c in chosen if c not in cases]
            if unknown:
                raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(cases)}")
            results = []
            for c in chosen:
                r = run_case(c, url, args, corpus, **cases[c])
                r["plain"] = run_case(c, None, args, corpus, **cases[c])["final_loss"]
                if olmo_pool is not None:
                    try:
                        r["olmo"] = olmo_pool.submit(_olmo_case, c, cases[c]).result()
                    except Exception as e:  # noqa: BLE001 - the column is an extra; never lose the others
                        print(f"  {c} (SkipStepAdamW): failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                        r["olmo"] = None
                    else:
                        o = r["olmo"]
                        print(f"  {c} (SkipStepAdamW): final loss {o['final_loss']:.3f}, skipped "
                              f"{len(o['skipped_steps'])} {_ranges(o['skipped_steps'], 60) or '-'}", file=sys.stderr, flush=True)
                results.append(r)
            healthy = [r for r in results if r["name"].startswith(("healthy", "sched"))]
            faulty = [r for r in results if r not in healthy]
            wall = time.monotonic() - t0
        finally:
            proc.terminate()
            proc.wait(10)
            if olmo_pool is not None:
                olmo_pool.shutdown(cancel_futures=True)
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
    if olmo_pool is not None:
        _print_olmo(results, healthy, faulty, ref, olmo_version, args)


def _print_olmo(results: list[dict], healthy: list[dict], faulty: list[dict], ref: float, version: str | None,
                args: argparse.Namespace) -> None:
    """The second table: the same cases under OLMo-core's SkipStepAdamW, beside ``plain``."""
    print(f"\nthe same cases under OLMo-core's SkipStepAdamW (ai2-olmo-core {version}; sigma_factor 6, "
          f"rolling_interval_length 128, foreach; max_grad_norm {args.olmo_max_grad_norm}; same model, seed, data, "
          f"LR schedule and fault as plain, no trainguard)\n")
    print(f"{'case':<20} {'final':>7} {'plain':>7} {'ratio':>6} {'skipped':>7}  {'skipped steps':<24} "
          f"{'heals':>5} {'harms':>5}   trainguard: recovered/harms")
    heal_n = {"olmo": 0, "tg": 0}
    heal_lr = {"olmo": 0, "tg": 0}
    harm_n = {"olmo": 0, "tg": 0}
    lr = [r for r in faulty if r["name"].startswith("lr-")]
    measured = [r for r in results if r.get("olmo") is not None]
    for r in healthy + faulty:
        o = r.get("olmo")
        fault = r in faulty
        tg_rec = r["final_loss"] <= 1.2 * ref and not r["paused"]
        tg_harm = r["actions"] > 0 or not r["final_loss"] <= HARM_TOL * r["plain"]
        tg = ("yes" if tg_rec else "NO") if fault else ("YES" if tg_harm else "no")
        if fault:
            heal_n["tg"] += tg_rec
            heal_lr["tg"] += tg_rec and r in lr
        else:
            harm_n["tg"] += tg_harm
        if o is None:
            print(f"{r['name']:<20} {'failed':>7} {r['plain']:>7.3f}{'':>53}   {tg}")
            continue
        final, skipped = o["final_loss"], o["skipped_steps"]
        heals = final <= 1.2 * ref  # the bench's recovered (SkipStepAdamW never pauses a run)
        harms = bool(skipped) or not final <= HARM_TOL * r["plain"]
        if fault:
            heal_n["olmo"] += heals
            heal_lr["olmo"] += heals and r in lr
        else:
            harm_n["olmo"] += harms
        print(f"{r['name']:<20} {final:>7.3f} {r['plain']:>7.3f} {final / r['plain']:>6.3f} {len(skipped):>7}  "
              f"{_ranges(skipped) or '-':<24} {('yes' if heals else 'NO') if fault else '':>5} "
              f"{'' if fault else ('YES' if harms else 'no'):>5}   {tg}")
    print(f"\nSkipStepAdamW: faulty runs healed {heal_n['olmo']}/{len(faulty)} (LR faults {heal_lr['olmo']}/{len(lr)}), "
          f"healthy runs harmed {harm_n['olmo']}/{len(healthy)} ({len(measured)} of {len(results)} cases measured); "
          f"trainguard: recovered {heal_n['tg']}/{len(faulty)} (LR faults {heal_lr['tg']}/{len(lr)}), "
          f"healthy runs harmed {harm_n['tg']}/{len(healthy)}")
    print(f"heals = final <= {1.2 * ref:.3f} (the bench's recovered: 1.2x the healthy median); harms (healthy runs "
          f"and schedules only) = any step skipped, or final > {HARM_TOL}x plain; for trainguard: recovered (faults) "
          f"or harms (healthy: any action, or final > {HARM_TOL}x plain); skipped = steps SkipStepAdamW took with a "
          f"step factor of 0 (not the GradScaler's)")


if __name__ == "__main__":
    main()

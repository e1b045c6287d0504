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
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import secrets
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx

from trainguard.cli import format_incidents
from trainguard.demo.model import FaultPlan

__all__ = ["DemoConfig", "DemoResult", "run_demo", "main"]

JOB = "demo"
#: The fault steps' single source: the demo's defaults are the FaultPlan's.
_FAULTS = FaultPlan()


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """Everything the demo does; the defaults are the README's demo."""

    steps: int = 150
    """Optimizer steps per rank."""
    world_size: int = 2
    """gloo ranks (processes) on this machine."""
    report_every: int = 5
    """Steps between reports to the controller (and status lines)."""
    seq_len: int = 128
    """Bytes per training sequence."""
    batch_size: int = 8
    """Sequences per rank per step."""
    lr: float = 2e-3
    """Peak AdamW learning rate."""
    burst: tuple[int, int] = _FAULTS.burst
    """Steps [start, end) with duplicated and corrupted data."""
    lr_blowup: tuple[int, int | None] = _FAULTS.lr_blowup
    """Steps [start, end) where the LR schedule overshoots by ``lr_blowup_factor`` (end None: for good)."""
    lr_blowup_factor: float = _FAULTS.lr_blowup_factor
    """How far the bad schedule overshoots."""
    nan_step: int = _FAULTS.nan_step
    """Step whose loss turns NaN on the last rank."""
    snapshot_every: int | None = 10
    """Steps between the agent's in-memory snapshots (what a rollback restores; None: none)."""
    snapshot_keep: int = 4
    """Snapshots kept per rank (spaced out: the oldest is 70 to 140 steps old)."""
    healthy_reference: bool = True
    """Also train the run without faults and without trainguard, to compare the final losses."""
    resume_after_s: float = 2.0
    """If the ladder ever pages a human (pauses the run), how long the demo, standing in for
    them, looks at it before resuming."""
    controller: str | None = None
    """URL of a running controller; None starts one on loopback."""
    agent_token: str | None = None
    """Agent token for an external controller (default: env TRAINGUARD_TOKEN)."""
    operator_token: str | None = None
    """Operator token for an external controller (default: env TRAINGUARD_OPERATOR_TOKEN); without
    one the demo cannot resume a paused run and says how to do it by hand."""
    metrics_host: str = "127.0.0.1"
    """Where the ranks serve /metrics (0.0.0.0 in a container)."""
    metrics_port: int = 0
    """Base port of the ranks' /metrics (0: free ports)."""
    prometheus: bool = False
    """Also start Prometheus (binary on PATH) with the generated configuration."""
    keep_running: bool = False
    """After the summary, keep the controller (and Prometheus) running until Ctrl-C."""
    workdir: str | None = None
    """Where the SQLite file and logs go (default: a temporary directory)."""
    run: str | None = None
    """Run id (default: demo-<time>)."""
    quiet: bool = False
    """No live output (the summary is still returned)."""
    timeout_s: float = 600.0
    """The demo gives up after this long."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.world_size < 1 or self.report_every < 1:
            raise ValueError("steps, world_size and report_every must be >= 1")
        if self.seq_len < 8 or self.batch_size < 4:
            raise ValueError("seq_len must be >= 8 and batch_size >= 4")
        if not self.lr > 0:
            raise ValueError("lr must be > 0")


@dataclass(slots=True)
class DemoResult:
    """What happened, from the controller's records."""

    run: str
    steps_completed: list[int]
    """Last step each rank completed."""
    alerts: list[dict[str, Any]] = field(default_factory=list)
    """Every alert: rule, severity, step (of the report that fired it), actions, summary."""
    actions: list[dict[str, Any]] = field(default_factory=list)
    """Every change of desired state: generation, actor, what changed, step applied on all ranks."""
    rank_logs: list[list[dict[str, Any]]] = field(default_factory=list)
    """Per rank: one entry per step (step, loss, lr used, lr_scale, paused wait)."""
    incidents: list[dict[str, Any]] = field(default_factory=list)
    """The run's incidents, oldest first: onset, the rungs of the escalation ladder, outcome."""
    healthy_losses: list[float] = field(default_factory=list)
    """Per step, the loss of the run without faults (empty without ``healthy_reference``)."""

    def final_loss(self, last: int = 10) -> float:
        """Mean loss of the last ``last`` steps, over every rank (the global batch's loss)."""
        return _tail_mean([sum(e["loss"] for e in es) / len(es) for es in zip(*self.rank_logs)], last)

    def healthy_final_loss(self, last: int = 10) -> float | None:
        return _tail_mean(self.healthy_losses, last) if self.healthy_losses else None


def _tail_mean(xs: list[float], last: int) -> float:
    tail = xs[-last:]
    return sum(tail) / len(tail) if tail else math.nan


# -- one rank ----------------------------------------------------------------------------------
def _rank_main(rank: int, cfg_dict: dict[str, Any], init_method: str, controller: str, token: str,
               run: str, log_dir: str) -> None:
    """Train on one rank. Runs in a spawned process."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import trainer_agent as ta
    from trainguard.demo.model import (CONTROL_BYTE_IDS, VOCAB_SIZE, ByteCorpus, TinyGPT, next_byte_loss,
                                          stdlib_source_bytes)

    cfg = DemoConfig(**cfg_dict)
    torch.set_num_threads(1)
    os.environ.update(LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=cfg.world_size)

    faults = FaultPlan(burst=cfg.burst, lr_blowup=cfg.lr_blowup, lr_blowup_factor=cfg.lr_blowup_factor,
                       nan_step=cfg.nan_step)
    # A schedule that "does not fit the optimizer": the stability guide's opening story.
    model, optimizer, scheduler, corpus = _training_setup(cfg, faults)
    ddp = DDP(model)
    window = 32 * cfg.batch_size  # sequences: about 32 steps, so the monitor reacts within the demo
    monitor = ta.DataMonitor(VOCAB_SIZE, special_ids=CONTROL_BYTE_IDS, window=window,
                             reference_tokens=16 * cfg.batch_size * (cfg.seq_len + 1))
    lr_used: list[float] = [math.nan]
    # Registered before the agent's hooks, so it runs before the agent restores the scheduler's LR:
    # it sees the LR optimizer.step actually used (scheduler LR x lr_scale).
    optimizer.register_step_post_hook(lambda opt, args, kwargs: lr_used.__setitem__(0, opt.param_groups[0]["lr"]))
    agent = ta.attach(
        model, optimizer, job=JOB, run=run, lr_scheduler=scheduler, data_monitor=monitor,
        controller=controller, token=token,
        config=ta.AgentConfig(report_every=cfg.report_every, skip_nonfinite=True,
                              metrics_port=cfg.metrics_port, metrics_host=cfg.metrics_host,
                              layer_depth=2, snapshot_every=cfg.snapshot_every, snapshot_keep=cfg.snapshot_keep),
    )
    log: list[dict[str, Any]] = []
    step = 0  # steps completed; the step being trained is step + 1, the agent's numbering
    try:
        while step < cfg.steps and not agent.should_stop:
            ids, mask = corpus.batch(step + 1, rank, faults)
            agent.observe_batch(ids, mask)
            loss = next_byte_loss(ddp, ids, mask)
            if step + 1 == faults.nan_step and rank == cfg.world_size - 1:
                loss = loss * float("nan")  # the injected fault: one rank's loss turns NaN
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            lr_used[0] = math.nan  # stays NaN when the step is skipped
            optimizer.step()  # the agent's hooks apply lr_scale (and skip a non-finite step)
            optimizer.zero_grad(set_to_none=True)
            lr_sched = scheduler.get_last_lr()[0]  # the scheduler's LR for this step
            scheduler.step()
            t0 = time.perf_counter()
            agent.end_step(loss, tokens=int(mask.sum()))  # may block: a pause waits here on purpose
            waited = time.perf_counter() - t0
            step += 1
            values = agent.latest()
            log.append({"step": step, "loss": float(loss.detach()), "lr_sched": lr_sched,
                        "lr_scale": values.get("trainguard_lr_scale", 1.0), "lr_used": lr_used[0],
                        "generation": values.get("trainguard_applied_generation", 0), "end_step_s": waited,
                        "grad_norm_max": values.get("trainguard_grad_norm_max")})
            if rank == 0 and not cfg.quiet and step % cfg.report_every == 0:
                print(_status_line(step, cfg.steps, values), flush=True)
    finally:
        agent.close(timeout=5.0)
        Path(log_dir, f"rank{rank}.json").write_text(json.dumps(log))
        # DDP's reducer holds the process group: free it (and the agent's hooks that reach it)
        # before the group goes, so no gloo thread is left for the interpreter's exit to destroy.
        del agent, ddp
        gc.collect()
        dist.destroy_process_group()


def _training_setup(cfg: DemoConfig, faults: FaultPlan) -> tuple[Any, Any, Any, Any]:
    """Model (the same initial weights in every process), AdamW, the LR schedule (warm-up, times
    the fault plan's multiplier) and the corpus: what the ranks and the healthy run share."""
    import torch

    from trainguard.demo.model import ByteCorpus, TinyGPT, stdlib_source_bytes

    torch.manual_seed(0)
    model = TinyGPT(seq_len=cfg.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = 10
    # LambdaLR's argument is the number of steps taken: the LR of step s + 1.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * faults.lr_multiplier(s + 1))
    corpus = ByteCorpus(stdlib_source_bytes(), seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=1)
    return model, optimizer, scheduler, corpus


def _healthy_main(cfg_dict: dict[str, Any], log_dir: str) -> None:
    """The run without faults and without trainguard, in one process: each step averages the
    losses of every rank's batch, which gives the gradient DDP gives the ranks (the mean of theirs).
    Runs in a spawned process."""
    import torch

    from trainguard.demo.model import next_byte_loss

    cfg = DemoConfig(**cfg_dict)
    torch.set_num_threads(1)
    no_faults = FaultPlan(burst=(0, 0), lr_blowup=(0, 0), nan_step=0)
    model, optimizer, scheduler, corpus = _training_setup(cfg, no_faults)
    losses = []
    for step in range(1, cfg.steps + 1):
        loss = sum(next_byte_loss(model, *corpus.batch(step, rank)) for rank in range(cfg.world_size)) / cfg.world_size
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(float(loss.detach()))
    Path(log_dir, "healthy.json").write_text(json.dumps(losses))


def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec)


def _status_line(step: int, total: int, v: dict[str, float]) -> str:
    width = 20
    done = int(width * step / total)
    bar = "#" * done + "." * (width - done)
    return (
        f"[{bar}] step {step:4d}/{total} loss {_fmt(v.get('trainguard_loss'), '.3f')}"
        f" gnorm {_fmt(v.get('trainguard_grad_norm'))} upd {_fmt(v.get('trainguard_update_ratio'), '.2e')}"
        f" | dup {_fmt(v.get('trainguard_data_duplicate_ratio'), '.2f')}"
        f" kl {_fmt(v.get('trainguard_data_token_kl_divergence'), '.2f')}"
        f" ctrl {_fmt(v.get('trainguard_data_special_token_ratio'), '.1e')}"
        f" len-p {_fmt(v.get('trainguard_data_length_shift_pvalue'), '.2g')}"
        f" | paused {int(v.get('trainguard_paused', 0))} lr_scale {_fmt(v.get('trainguard_lr_scale', 1.0), '.3g')}"
    )


# -- the orchestrator --------------------------------------------------------------------------
def _bound_port(log: Path, proc: subprocess.Popen[bytes], pattern: str, what: str) -> int:
    """The port a process started on port 0 reports in its log (none is picked in advance, so no
    other process can take it in between)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return int(m.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited at start; see {log}:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not report its port within 30 s; see {log}")


def _say(cfg: DemoConfig, msg: str) -> None:
    if not cfg.quiet:
        print(msg, flush=True)


class _Controller:
    """The controller process the demo started (or nothing, for an external one)."""

    def __init__(self, cfg: DemoConfig, workdir: Path) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        if cfg.controller:
            self.url = cfg.controller.rstrip("/")
            self.agent_token = cfg.agent_token or os.environ.get("TRAINGUARD_TOKEN", "")
            self.operator_token = cfg.operator_token or os.environ.get("TRAINGUARD_OPERATOR_TOKEN")
            return
        self.agent_token = "agent-" + secrets.token_hex(16)
        self.operator_token = "operator-" + secrets.token_hex(16)
        env = dict(os.environ, TRAINGUARD_AGENT_TOKENS=self.agent_token,
                   TRAINGUARD_OPERATOR_TOKENS=self.operator_token)
        self.log_path = workdir / "controller.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainguard.cli", "serve", "--host", "127.0.0.1", "--port", "0",
             "--db", str(workdir / "trainguard.db")],
            env=env, stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT)
        port = _bound_port(self.log_path, self.proc, r"listening on http://127\.0\.0\.1:(\d+)", "the controller")
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the controller exited at start; see {self.log_path}:\n{self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"the controller did not answer /healthz within 30 s; see {self.log_path}")

    def client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.operator_token}"} if self.operator_token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=5.0)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start_prometheus(cfg: DemoConfig, ctl: _Controller, workdir: Path) -> subprocess.Popen[bytes] | None:
    binary = shutil.which("prometheus")
    if binary is None:
        _say(cfg, "--prometheus: no 'prometheus' binary on PATH; skipped")
        return None
    import yaml

    from trainguard.dashboards.build import GENERATED
    from trainguard.dashboards.stack import prometheus_config

    token_file = workdir / "operator.token"
    token_file.write_text(ctl.operator_token or "")
    rules = GENERATED / "prometheus" / "rules.yml"
    conf = prometheus_config(controller=ctl.url.removeprefix("http://"), token_file=str(token_file),
                             rule_files=[str(rules)] if rules.exists() else [], scrape_interval="2s",
                             sd_refresh_interval="5s")
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(conf))
    proc = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'prometheus-data'}",
         "--web.listen-address=127.0.0.1:0"],
        stdout=(workdir / "prometheus.log").open("wb"), stderr=subprocess.STDOUT)
    port = _bound_port(workdir / "prometheus.log", proc, r'msg="Listening on" address=127\.0\.0\.1:(\d+)', "Prometheus")
    _say(cfg, f"Prometheus: http://127.0.0.1:{port}/graph?g0.expr=trainguard_grad_norm  (log: {workdir / 'prometheus.log'})")
    return proc


def _changes(before: dict[str, Any], after: dict[str, Any]) -> str:
    keys = ("paused", "lr_scale", "checkpoint_seq", "stop", "rollback_seq")

    def fmt(v: Any) -> str:
        return format(v, ".4g") if isinstance(v, float) else str(v)
    out = [f"{k} {fmt(before.get(k))} -> {fmt(after.get(k))}" for k in keys if before.get(k) != after.get(k)]
    if after.get("rollback_seq", 0) != before.get("rollback_seq", 0):
        out.append(f"(roll back to the snapshot of step {after.get('rollback_step')} or older)")
    return ", ".join(out)


def _watch(cfg: DemoConfig, ctl: _Controller, run: str, procs: list[Any]) -> None:
    """Follow the run's audit log while the ranks train; resume a rule's pause as an operator."""
    last_event = 0
    desired: dict[str, Any] = {"paused": False, "lr_scale": 1.0, "checkpoint_seq": 0, "stop": False, "rollback_seq": 0}
    paused_since: float | None = None
    told_manual = False
    deadline = time.monotonic() + cfg.timeout_s
    with ctl.client() as http:
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the demo did not finish within {cfg.timeout_s:.0f} s")
            time.sleep(0.2)
            try:
                resp = http.get(f"/v1/runs/{run}/events", params={"after": last_event})
            except httpx.HTTPError:
                continue
            if resp.status_code != 200:
                continue
            for ev in resp.json():
                last_event = max(last_event, ev["id"])
                if ev["kind"] == "alert":
                    d = ev["data"]
                    _say(cfg, f"  !! alert {d.get('rule')} ({d.get('severity')}) at step {d.get('step', '?')}: {ev['reason']}")
                elif ev["kind"] == "desired":
                    new = ev["data"]["desired"]
                    _say(cfg, f"  >> generation {ev['generation']} by {ev['actor']}: {_changes(desired, new)}")
                    desired = new
                    paused_since = time.monotonic() if new["paused"] else None
                elif ev["kind"] == "applied":
                    _say(cfg, f"  ok generation {ev['generation']} applied on every rank at step {ev['data'].get('step')}")
                elif ev["kind"] == "incident":
                    inc = ev["data"]["incident"]
                    rungs = " > ".join(r["rung"] for r in inc["rungs"]) or "-"
                    _say(cfg, f"  ~~ incident {inc['id']} (onset step {inc['onset_step']}, cause {inc.get('cause', 'unknown')}): "
                              f"{rungs} / {inc['outcome']}")
            if paused_since is not None and time.monotonic() - paused_since >= cfg.resume_after_s:
                if not ctl.operator_token:
                    if not told_manual:
                        _say(cfg, f"  the run is paused; resume it with: trainguard resume {run} --url {ctl.url} --token <operator token>")
                        told_manual = True
                    continue
                _say(cfg, "  the run is paused and a human was paged; standing in for them, the demo resumes it through the REST API")
                try:
                    http.post(f"/v1/runs/{run}/resume", json={"reason": "demo operator: inspected, resuming"},
                              headers={"Idempotency-Key": f"demo-resume-{desired.get('generation', 0)}"})
                    paused_since = None
                except httpx.HTTPError:
                    pass


def _wait_acked(ctl: _Controller, run: str, generation: int, timeout: float = 10.0) -> None:
    """Wait (bounded) until the controller recorded the leader's ack of ``generation``: the last
    ack is sent from the leader's client thread at close(), after its rank finished."""
    deadline = time.monotonic() + timeout
    with ctl.client() as http:
        while time.monotonic() < deadline:
            try:
                if http.get(f"/v1/runs/{run}").json().get("applied_generation", 0) >= generation:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)


def _collect(ctl: _Controller, run: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """Alerts and actions of the run, each with its step, from the controller's audit log, and
    the run's incidents (oldest first)."""
    with ctl.client() as http:
        events = http.get(f"/v1/runs/{run}/events", params={"limit": 5000}).json()
        incidents = list(reversed(http.get(f"/v1/runs/{run}/incidents").json()["incidents"]))
        diagnoses = {a["id"]: a.get("diagnosis") or {}
                     for a in http.get("/v1/alerts", params={"run": run, "limit": 1000}).json()}
    applied: dict[int, int] = {}
    for ev in events:
        if ev["kind"] == "applied":
            applied.setdefault(ev["generation"], ev["data"].get("step"))
    alerts, actions = [], []
    before: dict[str, Any] = {"paused": False, "lr_scale": 1.0, "checkpoint_seq": 0, "stop": False, "rollback_seq": 0}
    for ev in events:
        if ev["kind"] == "alert":
            d = ev["data"]
            alerts.append({"rule": d.get("rule"), "severity": d.get("severity"), "step": d.get("step"),
                           "generation": ev["generation"], "summary": ev["reason"],
                           "diagnosis": diagnoses.get(d.get("alert_id"), {})})
        elif ev["kind"] == "desired":
            new = ev["data"]["desired"]
            gen = ev["generation"]
            # A generation superseded before the ranks applied it is covered by the next ack.
            step = applied.get(gen) or next((s for g, s in sorted(applied.items()) if g >= gen), None)
            actions.append({"generation": gen, "actor": ev["actor"], "change": _changes(before, new),
                            "desired": new, "applied_step": step})
            before = new
    return alerts, actions, incidents


def run_demo(cfg: DemoConfig) -> DemoResult:
    """Run the demo; returns what happened. Raises on a rank that failed or on the timeout."""
    import torch.multiprocessing as mp

    workdir = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="trainguard-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = cfg.run or f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    ctl = _Controller(cfg, workdir)
    prom = None
    procs: list[Any] = []
    try:
        _say(cfg, f"controller: {ctl.url}  (SQLite: {workdir / 'trainguard.db'})" if ctl.proc else f"controller: {ctl.url}")
        if ctl.proc and ctl.operator_token:
            _say(cfg, f"operator token for this demo: {ctl.operator_token}  (e.g. trainguard status {run} --url {ctl.url} --token ...)")
        # the console takes the operator token on its sign-in page (never in the URL)
        _say(cfg, f"console: {ctl.url}/ui/runs/{run}  (sign in with the operator token{' above' if ctl.proc else ''})"
             if ctl.operator_token else f"console: {ctl.url}/ui/runs/{run}")
        if cfg.prometheus:
            prom = _start_prometheus(cfg, ctl, workdir)
        blowup = (f"from step {cfg.lr_blowup[0]} on" if cfg.lr_blowup[1] is None
                  else f"at steps {cfg.lr_blowup[0]}-{cfg.lr_blowup[1] - 1}")
        _say(cfg, f"run {run}: {cfg.world_size} gloo ranks, {cfg.steps} steps; faults: data burst at steps "
                  f"{cfg.burst[0]}-{cfg.burst[1] - 1}, LR x{cfg.lr_blowup_factor:g} {blowup}, "
                  f"NaN loss at step {cfg.nan_step}")
        ctx = mp.get_context("spawn")
        store = workdir / f"gloo-store-{run}"  # the ranks meet through a file: no port to pick
        store.unlink(missing_ok=True)
        cfg_dict = asdict(cfg)
        for rank in range(cfg.world_size):
            p = ctx.Process(target=_rank_main, daemon=True,
                            args=(rank, cfg_dict, f"file://{store}", ctl.url, ctl.agent_token, run, str(workdir)))
            p.start()
            procs.append(p)
        healthy = None
        if cfg.healthy_reference:
            healthy = ctx.Process(target=_healthy_main, daemon=True, args=(cfg_dict, str(workdir)))
            healthy.start()
        _watch(cfg, ctl, run, procs)
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
            _wait_acked(ctl, run, max((e["generation"] for log in logs for e in log), default=0))
        alerts, actions, incidents = _collect(ctl, run) if ctl.operator_token else ([], [], [])
        result = DemoResult(run=run, steps_completed=[log[-1]["step"] if log else 0 for log in logs],
                            alerts=alerts, actions=actions, rank_logs=logs, incidents=incidents,
                            healthy_losses=healthy_losses)
        _print_summary(cfg, result)
        if cfg.keep_running:
            _say(cfg, f"\nthe controller ({ctl.url}){' and Prometheus' if prom else ''} keep running: Ctrl-C to stop")
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
    p = argparse.ArgumentParser(prog="trainguard demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--world-size", type=int, default=defaults.world_size)
    p.add_argument("--report-every", type=int, default=defaults.report_every)
    p.add_argument("--controller", default=None, help="URL of a running controller (default: start one)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--metrics-port", type=int, default=0, help="base port of the ranks' /metrics (0: free ports)")
    p.add_argument("--prometheus", action="store_true", help="also start Prometheus (binary on PATH)")
    p.add_argument("--keep-running", action="store_true",
                   help="keep the controller (and Prometheus) running after the summary, until Ctrl-C "
                        "(the default with --prometheus on a terminal)")
    p.add_argument("--workdir", default=None)
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

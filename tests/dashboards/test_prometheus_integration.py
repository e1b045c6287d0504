"""A real Prometheus (Debian's 2.42) scraping a real training run with the agent attached and a
real controller: every query of every dashboard panel and annotation, and every recording rule,
returns data for that run.

The run is built so that every panel can have data on a CPU: a GradScaler (loss scale, skipped
steps), two micro-batches per step (gradient noise scale), a QualityFilter on the agent's registry
(filtered samples), a declared FLOPs count and device peak (model-FLOPs utilisation), a data
monitor (data signals), a burst of duplicated batches (the controller's
duplicate rule fires, so its alert, suppression and webhook panels have data, and so does
Prometheus's own alert, behind the ALERTS annotation), an operator's lr-scale command (an action,
behind the "actions applied" annotation), a webhook that fails (failures panel) and one rejected
report (rejections panel). Prometheus discovers the rank through the controller's http_sd endpoint
with a bearer token from a file, as in the compose stack.

A second run has two gloo ranks under DDP with the agent at its multi-rank defaults (the job's
values and the per-layer series on the leader alone), scraped as the Helm chart's PodMonitor scrapes
them: every panel of the dashboards that read the ranks has data, once per rank or once per run,
and no alert fires on that healthy run.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn import functional as F

from trainguard.dashboards import build
from trainguard.dashboards.rules import RECORDING_RULES, rule_groups
from trainguard.dashboards.stack import prometheus_config
from trainguard.demo.webhook_sink import make_server
from tests.dashboards.training_rank import VOCAB, TinyLM
from tests.tools.listening import start_listening, stop

PROMETHEUS = shutil.which("prometheus")
TRAINGUARD = Path(sys.executable).parent / "trainguard"
JOB, RUN = "itest", "itest-0001"
SCRAPE = "1s"
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval: 4 x the scrape interval
TRAIN_SECONDS = 16.0
SEQ, BATCH, MICRO = 32, 8, 2
WINDOW = 128  # sequences in the data monitor's window: 16 steps
#: Fractions of the run with a burst of one duplicated batch: the controller's duplicate rule
#: fires in the first, resolves in between, and is held back by its cooldown in the second.
BURSTS = ((0.35, 0.55), (0.75, 1.0))
SPECIAL_ID = 0

#: Queries not required to have data, each with the reason (outside the dashboards).
NOT_REQUIRED: set[str] = {
    # The controller lists a run in trainguard_controller_incidents_awaiting_human only while its
    # incident is escalated (the run paused for a human): a run that trains on has none. (The
    # dashboards' incident panels show 0 then, and have data.)
    f'trainguard:incidents_awaiting_human:max{{run="{RUN}"}}',
    # Gradient communication is timed under DDP with AgentConfig(comm_timing=True) only; this run
    # is one rank without DDP (tests/agent/test_comm_timing.py covers the values).
    *(f'{name}{{job=~"{JOB}", run=~"{RUN}", rank=~"0"}}'
      for name in ("trainguard_comm_seconds", "trainguard_comm_exposed_seconds", "trainguard_comm_exposed_ratio")),
    # The replicas' agreement: one rank has none to compare with (the two-rank run has it).
    *(f'max by (job, run) (trainguard_{kind}_desync_rel_diff{{job=~"{JOB}", run=~"{RUN}"}})' for kind in ("grad", "param")),
    *(f'max by (job, run, worst_layer) (trainguard_{kind}_desync_rank{{job=~"{JOB}", run=~"{RUN}"}})'
      for kind in ("grad", "param")),
}


def _reads_the_gpu(expr: str) -> bool:
    """Whether ``expr`` reads NVML's GPU series, which a CPU run has none of (their values:
    ``tests/agent/test_gpu_health.py`` with a stand-in NVML, and its CUDA test on a real GPU)."""
    return "trainguard_gpu_" in expr


pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(150),
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (scripts/setup.sh)"),
]


def _wait_http(url: str, deadline_s: float, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {deadline_s}s")


def _request(method: str, url: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@pytest.fixture
def stack(tmp_path):
    """A controller process, two webhook sinks (one failing) and a Prometheus scraping both the
    controller and, through http_sd, every registered rank."""
    operator, agent_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    env = {**os.environ, "TRAINGUARD_OPERATOR_TOKENS": operator, "TRAINGUARD_AGENT_TOKENS": agent_token}
    sink_log = open(os.devnull, "w")
    procs: list[subprocess.Popen] = []
    sinks = [make_server("127.0.0.1", 0, status=s, log=sink_log) for s in (204, 500)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in sinks]
    for t in threads:
        t.start()
    try:
        controller, port = start_listening(
            [str(TRAINGUARD), "serve", "--host", "127.0.0.1", "--port", "0", "--db", str(tmp_path / "tg.db")],
            tmp_path / "controller.log", env=env)
        procs.append(controller)
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/healthz", 30, controller)
        for sink in sinks:
            status, body = _request("POST", f"{base}/v1/webhooks", operator, {
                "url": f"http://127.0.0.1:{sink.server_address[1]}/controller", "min_severity": "info"})
            assert status in (200, 201), body
        (tmp_path / "token").write_text(operator + "\n")
        (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule_groups()))
        config = prometheus_config(controller=f"127.0.0.1:{port}", token_file=str(tmp_path / "token"),
                                   rule_files=["rules.yml"], scrape_interval=SCRAPE,
                                   sd_refresh_interval=SCRAPE)
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prometheus, prom_port = start_listening(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", "--web.listen-address=127.0.0.1:0", "--log.level=info"],
            tmp_path / "prometheus.log")
        procs.append(prometheus)
        prom = f"http://127.0.0.1:{prom_port}"
        _wait_http(f"{prom}/-/ready", 30, prometheus)
        yield {"controller": base, "operator": operator, "agent": agent_token, "prometheus": prom,
               "sinks": sinks, "logs": tmp_path}
    finally:
        for proc in reversed(procs):
            stop(proc)
        for sink in sinks:
            sink.shutdown()
            sink.server_close()
        for t in threads:
            t.join(timeout=5)
        sink_log.close()


def _train(stack) -> tuple[float, float, object, set[float]]:
    """Train TinyLM with the agent attached for TRAIN_SECONDS; returns (start, end, agent, the
    gradient norms the agent computed, one per step) with the agent still serving /metrics."""
    import trainer_agent as ta
    from trainer_agent.data import DataMonitor, QualityFilter

    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW([
        {"params": [model.tok.weight], "lr": 3e-3},
        {"params": [p for b in model.blocks for p in b.parameters()], "lr": 1e-3},
    ], weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu")
    # A short window and reference, so that the KL and the length test have values within seconds.
    monitor = DataMonitor(VOCAB, special_ids=(SPECIAL_ID,), window=WINDOW, reference_tokens=WINDOW * SEQ)
    agent = ta.attach(model, optimizer, job=JOB, run=RUN, scaler=scaler, data_monitor=monitor,
                      controller=stack["controller"], token=stack["agent"],
                      config=ta.AgentConfig(report_every=1, metrics_port=0, update_ratio="every",
                                            skip_nonfinite=True, snapshot_every=10,
                                            flops_per_token=6e6, peak_flops=1e12))  # MFU on a CPU
    # The sequences come through the agent's own sharded reader (so its panel has data): random
    # token sequences written into shards, read back in a seeded order, watched by the agent.
    from trainer_agent.dataset import TokenBatches, TokenLoader, write_shards

    generator = torch.Generator().manual_seed(1)
    shards = write_shards(stack["logs"] / "shards",
                          (torch.randint(1, VOCAB, (SEQ + 1,), generator=generator).numpy() for _ in range(4096)),
                          vocab_size=VOCAB, tokens_per_shard=1024 * (SEQ + 1), monitor=False)
    loader = TokenLoader(TokenBatches(shards, batch_size=BATCH, seq_len=SEQ + 1, seed=1), num_workers=0)
    agent.watch_loader(loader)

    def samples():
        while True:
            for rows in loader:
                yield from rows["input_ids"]

    stream = iter(QualityFilter(samples(), registry=agent.registry,
                                labels={"job": JOB, "run": RUN, "rank": "0"}))
    # The bursts may start an incident; with snapshots the recovery ladder can roll back. Should it
    # still page a human (pause), this thread is the human: the loop would otherwise wait in
    # end_step, and this test is about the dashboards.
    done = threading.Event()

    def resume_if_paused() -> None:
        while not done.wait(0.5):
            status, desired = _request("GET", f"{stack['controller']}/v1/runs/{RUN}/desired", stack["agent"])
            if status == 200 and desired.get("paused"):
                _request("POST", f"{stack['controller']}/v1/runs/{RUN}/resume", stack["operator"],
                         {"reason": "integration test: the human resumes"})

    threading.Thread(target=resume_if_paused, daemon=True).start()
    start = time.time()
    step = 0
    grad_norms: set[float] = set()
    commanded_at: float | None = None
    burst: torch.Tensor | None = None
    # Train TRAIN_SECONDS, and on until Prometheus has scraped the rank both before and 4 s after
    # the operator's command (discovery through the controller may be slow on a busy machine).
    while (time.time() - start < TRAIN_SECONDS or commanded_at is None or time.time() - commanded_at < 4):
        elapsed = time.time() - start
        assert elapsed < 90, "Prometheus never scraped the rank"
        batch = torch.stack([next(stream) for _ in range(BATCH)])
        if any(lo <= elapsed / TRAIN_SECONDS < hi for lo, hi in BURSTS):
            burst = batch if burst is None else burst  # one batch, over and over
            batch = burst
        else:
            burst = None
        agent.observe_batch(batch)
        for micro in batch.chunk(MICRO):
            logits = model(micro[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), micro[:, 1:].reshape(-1))
            scaler.scale(loss / MICRO).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        agent.end_step(loss.detach(), tokens=batch.numel())
        grad_norms.add(agent.latest()["trainguard_grad_norm_max"])  # report_every=1: this step's
        step += 1
        if commanded_at is None and elapsed > TRAIN_SECONDS / 4 and _query(
                stack["prometheus"], f'trainguard_applied_generation{{run="{RUN}"}}', time.time()):
            status, body = _request("POST", f"{stack['controller']}/v1/runs/{RUN}/lr-scale",
                                    stack["operator"], {"scale": 0.5, "reason": "integration test"})
            assert status == 200, body
            status, body = _request("POST", f"{stack['controller']}/v1/runs/{RUN}/reports",
                                    stack["agent"], {"not": "a report"})
            assert 400 <= status < 500, body
            commanded_at = time.time()
        time.sleep(0.02)  # ~30 steps/s: many scrapes see many different steps
    done.set()
    assert step > 50
    return start, time.time(), agent, grad_norms


def _substitute(expr: str) -> str:
    for variable, value in (("$__rate_interval", RATE_INTERVAL), ("$job", JOB), ("$run", RUN), ("$rank", "0")):
        expr = expr.replace(variable, value)
    assert "$" not in expr, expr
    return expr


def _query_range(prom: str, expr: str, start: float, end: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": "1"})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{params}", timeout=10) as resp:
        answer = json.loads(resp.read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _query(prom: str, expr: str, t: float) -> list[dict]:
    """An instant query at time ``t`` (ms precision, as Prometheus stores it)."""
    params = urllib.parse.urlencode({"query": expr, "time": f"{t:.3f}"})
    with urllib.request.urlopen(f"{prom}/api/v1/query?{params}", timeout=10) as resp:
        answer = json.loads(resp.read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _wait_settled(prom: str, last_step: float, end: float) -> None:
    """Poll until Prometheus scraped the final step and evaluated its rules after training ended
    (instead of sleeping for 'long enough')."""
    def settled() -> bool:
        now = time.time()
        step = _query(prom, f'trainguard_step{{run="{RUN}"}}', now)
        rule = _query(prom, f'timestamp(trainguard:grad_norm:max{{run="{RUN}"}})', now)
        return (bool(step) and float(step[0]["value"][1]) == last_step
                and bool(rule) and float(rule[0]["value"][1]) > end)
    deadline = time.monotonic() + 60
    while not settled():
        assert time.monotonic() < deadline, "Prometheus did not scrape the last step / evaluate its rules"
        time.sleep(0.2)


def _key(metric: dict, by: tuple[str, ...] | None) -> tuple:
    """A series' identity without its name (what rate/increase keep), or its ``by`` labels."""
    if by is not None:
        return tuple((k, metric.get(k, "")) for k in by)
    return tuple(sorted((k, v) for k, v in metric.items() if k != "__name__"))


def _naive_increase(samples: list[tuple[int, float]], t: int, window: int, *, rate: bool) -> float | None:
    """Prometheus 2.x's extrapolated increase/rate of a counter over ``[t - window, t]`` (times in
    integer milliseconds, as Prometheus keeps them), written out from its documented rules:
    counter resets add the value before the reset; the sampled span is extrapolated towards the
    window's edges by at most half an average sample interval (or to the edge when it is within
    1.1 intervals), and not to below zero."""
    if len(samples) < 2:
        return None
    (t0, v0), (t1, v1) = samples[0], samples[-1]
    result = v1 - v0
    previous = 0.0
    for _, v in samples:
        if v < previous:
            result += previous
        previous = v
    to_start, to_end, span = (t0 - (t - window)) / 1000, (t - t1) / 1000, (t1 - t0) / 1000
    average = span / (len(samples) - 1)
    if result > 0 and v0 >= 0:
        to_start = min(to_start, span * (v0 / result))
    extended = span + (to_start if to_start < average * 1.1 else average / 2)
    extended += to_end if to_end < average * 1.1 else average / 2
    result *= extended / span
    return result / (window / 1000) if rate else result


#: Panel expressions checked value by value: F(selector[Ns]), optionally summed or maxed over
#: series (after _substitute).
_RATE_PANEL = re.compile(r"^(?:(sum|max) (?:by \(([\w, ]+)\) )?\()?(rate|increase)\(([^\[\]]+)\[(\d+)s\]\)\)?$")


def _check_rate_panel(prom: str, expr: str, t: float) -> int:
    """Prometheus's value of a rate/increase panel at ``t`` against the same computed here from
    the raw samples; returns how many series were compared."""
    m = _RATE_PANEL.match(expr)
    assert m, expr
    t = round(t, 3)  # the query's time, as Prometheus reads it
    aggregation = m.group(1)
    aggregated = aggregation is not None
    by = tuple(x.strip() for x in m.group(2).split(",")) if m.group(2) else (() if aggregated else None)
    raw = _query(prom, f"{m.group(4)}[{m.group(5)}s]", t)
    expected: dict[tuple, float] = {}
    for series in raw:
        samples = [(round(float(ts) * 1000), float(v)) for ts, v in series["values"]]
        value = _naive_increase(samples, round(t * 1000), int(m.group(5)) * 1000, rate=m.group(3) == "rate")
        if value is not None:
            k = _key(series["metric"], by)
            expected[k] = max(expected.get(k, value), value) if aggregation == "max" else expected.get(k, 0.0) + value
    got = {_key(r["metric"], by if aggregated else None): float(r["value"][1]) for r in _query(prom, expr, t)}
    assert got.keys() == expected.keys(), (expr, t, got, expected)
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), (expr, t, k)
    return len(expected)


def _finite_points(result: list[dict]) -> int:
    return sum(1 for series in result for _, v in series["values"] if math.isfinite(float(v)))


def test_every_panel_and_recording_rule_returns_data(stack):
    start, end, agent, grad_norms = _train(stack)
    try:
        prom = stack["prometheus"]
        _wait_settled(prom, agent.latest()["trainguard_step"], end)
        with urllib.request.urlopen(f"{prom}/api/v1/targets", timeout=10) as resp:
            targets = json.loads(resp.read())["data"]["activeTargets"]
        ranks = [t for t in targets if t["labels"].get("run") == RUN]
        assert [(t["labels"]["job"], t["labels"]["rank"], t["health"]) for t in ranks] == [(JOB, "0", "up")], targets

        queries = [(f"{name}: {where}", _substitute(expr))
                   for name, factory in build.DASHBOARDS.items()
                   for where, expr in build.dashboard_queries(build.dashboard_json(factory))]
        queries += [(f"recording rule {r.record}", f'{r.record}{{run="{RUN}"}}') for r in RECORDING_RULES]
        assert NOT_REQUIRED <= {expr for _, expr in queries}
        empty = []
        for where, expr in queries:
            result = _query_range(prom, expr, start, time.time())
            if _finite_points(result) == 0 and expr not in NOT_REQUIRED and not _reads_the_gpu(expr):
                empty.append(f"{where}: {expr}")
        if empty:
            alerts = _request("GET", f"{stack['controller']}/v1/alerts?run={RUN}", stack["operator"])
            pytest.fail("queries without data:\n" + "\n".join(empty)
                        + f"\ncontroller alerts: {alerts}\n(logs in {stack['logs']})")

        # Independent checks of a few values against what the agent itself reports.
        latest = agent.latest()
        step_now = _query_range(prom, f'trainguard_step{{run="{RUN}"}}', time.time() - 2, time.time())
        assert float(step_now[0]["values"][-1][1]) == latest["trainguard_step"]  # training has stopped
        # The operator set 0.5; the controller's rules and recovery may have lowered it since (and
        # their ramp climbs back to 0.5 at most). Prometheus shows what the rank applied last; the
        # controller's desired state may be one generation ahead (sent after the last step).
        status, desired = _request("GET", f"{stack['controller']}/v1/runs/{RUN}/desired", stack["agent"])
        assert status == 200, desired
        deadline = time.monotonic() + 30  # the final step's change may land after its scrape: the next one has it
        while True:
            scales = _query_range(prom, f'trainguard_lr_scale{{run="{RUN}"}}', start, time.time())
            seen = [float(v) for _, v in scales[0]["values"]]
            if seen[-1] == latest["trainguard_lr_scale"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert seen[-1] == latest["trainguard_lr_scale"] <= 0.5 and desired["lr_scale"] <= 0.5
        if desired["generation"] == latest["trainguard_applied_generation"]:
            assert desired["lr_scale"] == seen[-1]
        firing = _query_range(prom, f'ALERTS{{alertname="TrainguardDataDuplicates", alertstate="firing", run="{RUN}"}}',
                              start, time.time())
        assert firing and firing[0]["metric"]["trainguard_action"] == "notify"

        # Values, not just data. The gradient norms Prometheus scraped are ones the agent computed;
        # the panel shows the newest scraped one, a max over an interval is the max of the scraped
        # ones in it, and the threshold rule's recording (trainguard:grad_norm:max, which the
        # GradNormHigh alert compares with 1e3) holds, at each evaluation, one of the two newest.
        # (a job-level metric: the panel reads it per run, from rank 0, the one rank serving it)
        panel = _substitute('max by (job, run) (trainguard_grad_norm_max{job=~"$job", run=~"$run"})')
        assert any(expr == panel for _, expr in queries)  # the panel's own expression
        selector = _substitute('trainguard_grad_norm_max{job=~"$job", run=~"$run"}')
        now, span = time.time(), f"{int(time.time() - start) + 30}s"
        (series,) = _query(prom, f"{selector}[{span}]", now)
        assert series["metric"]["rank"] == "0"
        scraped = [(float(ts), float(v)) for ts, v in series["values"]]
        assert len(scraped) >= TRAIN_SECONDS / 2 and {v for _, v in scraped} <= grad_norms
        first = scraped[0][0]  # the rank is discovered through the controller: a moment after start
        times = [first + f * (end - first) for f in (0.3, 0.55, 0.8, 1.0)]
        for t in times:
            newest = [v for ts, v in scraped if ts <= t][-1]
            assert float(_query(prom, panel, t)[0]["value"][1]) == newest
            in_window = [v for ts, v in scraped if t - 8 <= ts <= t]
            assert float(_query(prom, f"max_over_time({selector}[8s])", t)[0]["value"][1]) == max(in_window)
        (recorded,) = _query(prom, f'trainguard:grad_norm:max{{run="{RUN}"}}[{span}]', now)
        for ts, v in recorded["values"]:
            before = [sv for sts, sv in scraped if sts <= float(ts)]
            assert before and float(v) in before[-2:], (ts, v)  # a scrape may land during an evaluation
        # Rate and increase panels (tokens, sequences, filtered samples, non-finite and skipped
        # steps, the controller's ingest, rejections, alerts, actions, webhooks) at several moments.
        compared = 0
        for _, expr in queries:
            if _RATE_PANEL.match(expr):
                compared += sum(_check_rate_panel(prom, expr, t) for t in times)
        assert compared >= 40, compared
        tokens = _query(prom, f'trainguard_data_tokens_total{{run="{RUN}"}}[{span}]', now)
        assert tokens and all(float(v) % (BATCH * (SEQ + 1)) == 0 for _, v in tokens[0]["values"])  # whole batches
    finally:
        agent.close(timeout=5.0)


# -- two ranks, scraped as the Helm chart's PodMonitor scrapes them ---------------------------------
TWO_RANKS_JOB, TWO_RANKS_RUN = "itest2", "itest2-0001"
#: The scrape job the Prometheus Operator makes of the chart's PodMonitor (<namespace>/<name>): its
#: targets' labels name the pod, never the run or the rank; honor_labels keeps the ranks' own.
POD_MONITOR_JOB = "training/tg-trainguard-training-pods"
RANK_SCRIPT = Path(__file__).with_name("training_rank.py")
#: The dashboards that read the ranks (the controller's own dashboard does not depend on them).
RANK_DASHBOARDS = ("training-stability.json", "data-quality.json", "ranks.json")


def _pod_monitor_config(controller: str, token_file: Path, targets_file: Path) -> dict:
    """The generated Prometheus configuration with the ranks discovered as a PodMonitor would
    give them (a file here, written once the ranks listen) instead of through the controller."""
    config = prometheus_config(controller=controller, token_file=str(token_file), rule_files=["rules.yml"],
                               scrape_interval=SCRAPE, sd_refresh_interval=SCRAPE)
    config["scrape_configs"] = [c for c in config["scrape_configs"] if "http_sd_configs" not in c]
    config["scrape_configs"].append({"job_name": POD_MONITOR_JOB, "honor_labels": True, "metrics_path": "/metrics",
                                     "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": SCRAPE}]})
    return config


@pytest.fixture
def two_ranks(tmp_path):
    """A controller, a Prometheus scraping it and, as a PodMonitor does, two gloo ranks of a DDP run
    with the agent at its multi-rank defaults (job-level and per-layer series on the leader only)
    that train TRAIN_SECONDS and then serve /metrics until the test writes ``done``."""
    operator, agent_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    env = {**os.environ, "TRAINGUARD_OPERATOR_TOKENS": operator, "TRAINGUARD_AGENT_TOKENS": agent_token}
    procs: list[subprocess.Popen] = []
    try:
        controller, port = start_listening(
            [str(TRAINGUARD), "serve", "--host", "127.0.0.1", "--port", "0", "--db", str(tmp_path / "tg.db")],
            tmp_path / "controller.log", env=env)
        procs.append(controller)
        _wait_http(f"http://127.0.0.1:{port}/healthz", 30, controller)
        (tmp_path / "token").write_text(operator + "\n")
        (tmp_path / "rules.yml").write_text(yaml.safe_dump(rule_groups()))
        (tmp_path / "ranks.json").write_text("[]")
        config = _pod_monitor_config(f"127.0.0.1:{port}", tmp_path / "token", tmp_path / "ranks.json")
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prometheus, prom_port = start_listening(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             "--web.listen-address=127.0.0.1:0", "--log.level=info"], tmp_path / "prometheus.log")
        procs.append(prometheus)
        prom = f"http://127.0.0.1:{prom_port}"
        _wait_http(f"{prom}/-/ready", 30, prometheus)
        cfg = {"init": f"file://{tmp_path}/store", "job": TWO_RANKS_JOB, "run": TWO_RANKS_RUN,
               "controller": f"http://127.0.0.1:{port}", "token": agent_token, "out": str(tmp_path),
               "seconds": TRAIN_SECONDS, "linger": 120}
        ranks = [subprocess.Popen([sys.executable, str(RANK_SCRIPT), json.dumps(cfg)],
                                  env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"},
                                  stdout=open(tmp_path / f"rank{r}.log", "wb"), stderr=subprocess.STDOUT)
                 for r in range(2)]
        procs += ranks
        yield {"prometheus": prom, "ranks": ranks, "out": tmp_path}
    finally:
        (tmp_path / "done").write_text("")
        for proc in reversed(procs):
            stop(proc)


def _await_files(ranks: list[subprocess.Popen], paths: list[Path], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while not all(p.exists() for p in paths):
        assert all(r.poll() is None for r in ranks), "a rank exited early (its log is rank<r>.log)"
        assert time.monotonic() < deadline, f"not written: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.2)


def _await_query(prom: str, expr: str, accept, deadline_s: float = 30) -> list[dict]:
    """Poll an instant query until ``accept(result)`` (Prometheus scrapes and evaluates every 1 s)."""
    deadline = time.monotonic() + deadline_s
    while True:
        result = _query(prom, expr, time.time())
        if accept(result):
            return result
        assert time.monotonic() < deadline, (expr, result)
        time.sleep(0.2)


def _two_rank_queries() -> list[tuple[str, str]]:
    """(where, expression) of every panel of the dashboards that read the ranks, with the Rank
    variable at its default (All), and of every recording rule, for the two-rank run."""
    subs = (("$__rate_interval", RATE_INTERVAL), ("$job", TWO_RANKS_JOB), ("$run", TWO_RANKS_RUN), ("$rank", ".*"))
    queries = []
    for name in RANK_DASHBOARDS:
        for where, expr in build.dashboard_queries(build.dashboard_json(build.DASHBOARDS[name])):
            if where.startswith("panel"):  # (the annotations mark alerts and actions: none on a healthy run)
                for variable, value in subs:
                    expr = expr.replace(variable, value)
                queries.append((f"{name}: {where}", expr))
    queries += [(f"recording rule {r.record}", f'{r.record}{{run="{TWO_RANKS_RUN}"}}') for r in RECORDING_RULES]
    return queries


#: Two-rank queries not required to have data on this healthy run, each with the reason.
TWO_RANKS_NOT_REQUIRED = {
    # The controller lists a run there only while its incident waits for a human.
    f'trainguard:incidents_awaiting_human:max{{run="{TWO_RANKS_RUN}"}}',
    # The rank holding the replicas' largest difference: none while every rank agrees.
    *(f'max by (job, run, worst_layer) (trainguard_{kind}_desync_rank{{job=~"{TWO_RANKS_JOB}", run=~"{TWO_RANKS_RUN}"}})'
      for kind in ("grad", "param")),
}


def test_two_ranks_every_panel_has_data_once_and_no_alert_fires_on_a_healthy_run(two_ranks):
    prom, out, ranks = two_ranks["prometheus"], two_ranks["out"], two_ranks["ranks"]
    start = time.time()
    _await_files(ranks, [out / f"rank{r}.url" for r in range(2)], 90)
    (out / "ranks.json").write_text(json.dumps([
        {"targets": [urllib.parse.urlsplit((out / f"rank{r}.url").read_text()).netloc],
         "labels": {"namespace": "training", "pod": f"{TWO_RANKS_RUN}-worker-{r}"}} for r in range(2)]))
    _await_files(ranks, [out / f"rank{r}.json" for r in range(2)], 90)
    latest = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in range(2):  # the final step scraped, and the rules evaluated after it
        _await_query(prom, f'trainguard_step{{run="{TWO_RANKS_RUN}", rank="{r}"}}',
                     lambda res: res and float(res[0]["value"][1]) == latest[r]["trainguard_step"])
    scraped_at = time.time()
    _await_query(prom, f'timestamp(trainguard:tokens_per_second:sum{{run="{TWO_RANKS_RUN}"}})',
                 lambda res: res and float(res[0]["value"][1]) > scraped_at)

    empty, shapes = [], []
    for where, expr in _two_rank_queries():
        result = _query_range(prom, expr, start, time.time())
        if _finite_points(result) == 0 and expr not in TWO_RANKS_NOT_REQUIRED and not _reads_the_gpu(expr):
            empty.append(f"{where}: {expr}")
        ranks_seen = {s["metric"].get("rank") for s in result}
        # A series per rank for both ranks, or series per run (a job's value, from the leader alone).
        if result and ranks_seen not in ({"0", "1"}, {None}):
            shapes.append(f"{where}: ranks {ranks_seen}: {expr}")
    assert not empty, "queries without data on a healthy two-rank run:\n" + "\n".join(empty)
    assert not shapes, "\n".join(shapes)

    # No alert fired on the healthy run (RunStalled did at the ranks' first scrape).
    firing = _query(prom, f'ALERTS{{alertstate="firing"}}[{int(time.time() - start) + 5}s]', time.time())
    assert firing == [], [s["metric"] for s in firing]
    # Nor was a straggler pending: each rank is judged by its median forward time over a window,
    # and a CPU rank's forward that the scheduler stretched in one scrape is no straggler.
    straggler = _query(prom, f'ALERTS{{alertname="TrainguardStraggler"}}[{int(time.time() - start) + 5}s]', time.time())
    assert straggler == [], [s["metric"] for s in straggler]

    # Values against what each rank's agent reported last (training has stopped).
    def value(expr: str) -> dict[str | None, float]:
        return {s["metric"].get("rank"): float(s["value"][1]) for s in _query(prom, expr, time.time())}
    sel = f'job=~"{TWO_RANKS_JOB}", run=~"{TWO_RANKS_RUN}"'
    assert value(f"trainguard:tokens_per_second:sum{{{sel}}}") == {
        None: pytest.approx(latest[0]["trainguard_tokens_per_second"] + latest[1]["trainguard_tokens_per_second"])}
    assert value(f'max by (job, run) (trainguard_grad_norm_max{{{sel}}})') == {None: latest[0]["trainguard_grad_norm_max"]}
    assert value(f'trainguard_loss{{{sel}, rank=~".*"}}') == {str(r): latest[r]["trainguard_loss"] for r in range(2)}
    assert value(f"trainguard:rank_up:max{{{sel}}}") == {"0": 1.0, "1": 1.0}
    # The replicas agree: the leader's comparison ran and found 0, the panel shows it (rank 1 serves none).
    for kind in ("grad", "param"):
        name = f"trainguard_{kind}_desync_rel_diff"
        assert latest[0][name] == 0.0 and name not in latest[1]
        assert value(f"max by (job, run) ({name}{{{sel}}})") == {None: 0.0}

    # Rank 1 stops answering while rank 0 is still scraped: it is down, though its target's `up`
    # names no rank.
    ranks[1].kill()
    ranks[1].wait(10)
    _await_query(prom, f'trainguard:rank_up:max{{{sel}}}',
                 lambda res: {s["metric"]["rank"]: float(s["value"][1]) for s in res} == {"0": 1.0, "1": 0.0})

"""A real Prometheus (Debian's 2.42) scraping a real training run with the agent attached and a
real controller: every query of every dashboard panel and annotation, and every recording rule,
returns data for that run.

The run is built so that every panel can have data on a CPU: a GradScaler (loss scale, skipped
steps), two micro-batches per step (gradient noise scale), a QualityFilter on the agent's registry
(filtered samples), a data monitor (data signals), a burst of duplicated batches (the controller's
duplicate rule fires, so its alert, suppression and webhook panels have data, and so does
Prometheus's own alert, behind the ALERTS annotation), an operator's lr-scale command (an action,
behind the "actions applied" annotation), a webhook that fails (failures panel) and one rejected
report (rejections panel). Prometheus discovers the rank through the controller's http_sd endpoint
with a bearer token from a file, as in the compose stack.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import socket
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
from torch import nn
from torch.nn import functional as F

from trainguard.dashboards import build
from trainguard.dashboards.rules import RECORDING_RULES, rule_groups
from trainguard.dashboards.stack import prometheus_config
from trainguard.demo.webhook_sink import make_server

PROMETHEUS = shutil.which("prometheus")
TRAINGUARD = Path(sys.executable).parent / "trainguard"
JOB, RUN = "itest", "itest-0001"
SCRAPE = "1s"
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval: 4 x the scrape interval
TRAIN_SECONDS = 16.0
VOCAB, SEQ, BATCH, MICRO = 64, 32, 8, 2
WINDOW = 128  # sequences in the data monitor's window: 16 steps
#: Fractions of the run with a burst of one duplicated batch: the controller's duplicate rule
#: fires in the first, resolves in between, and is held back by its cooldown in the second.
BURSTS = ((0.35, 0.55), (0.75, 1.0))
SPECIAL_ID = 0

#: Queries not required to have data, each with the reason (outside the dashboards).
NOT_REQUIRED: set[str] = set()

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(150),
    pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (scripts/setup.sh)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks and a tied head: per-layer metrics see ``blocks.0`` and
    ``blocks.1`` at the agent's default depth."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = x + block(x)
        return x @ self.tok.weight.T


@pytest.fixture
def stack(tmp_path):
    """A controller process, two webhook sinks (one failing) and a Prometheus scraping both the
    controller and, through http_sd, every registered rank."""
    operator, agent_token = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    port = _free_port()
    env = {**os.environ, "TRAINGUARD_OPERATOR_TOKENS": operator, "TRAINGUARD_AGENT_TOKENS": agent_token}
    logs = [open(tmp_path / name, "wb") for name in ("controller.log", "prometheus.log")]
    sink_log = open(os.devnull, "w")
    controller = subprocess.Popen(
        [str(TRAINGUARD), "serve", "--host", "127.0.0.1", "--port", str(port), "--db", str(tmp_path / "tg.db")],
        env=env, stdout=subprocess.DEVNULL, stderr=logs[0])
    procs = [controller]
    sinks = [make_server("127.0.0.1", 0, status=s, log=sink_log) for s in (204, 500)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in sinks]
    for t in threads:
        t.start()
    try:
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
        prom_port = _free_port()
        prometheus = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
             "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=logs[1])
        procs.append(prometheus)
        prom = f"http://127.0.0.1:{prom_port}"
        _wait_http(f"{prom}/-/ready", 30, prometheus)
        yield {"controller": base, "operator": operator, "agent": agent_token, "prometheus": prom,
               "sinks": sinks, "logs": tmp_path}
    finally:
        for proc in reversed(procs):
            _stop(proc)
        for sink in sinks:
            sink.shutdown()
            sink.server_close()
        for t in threads:
            t.join(timeout=5)
        for f in (*logs, sink_log):
            f.close()


def _train(stack) -> tuple[float, float, object]:
    """Train TinyLM with the agent attached for TRAIN_SECONDS; returns (start, end, agent) with the
    agent still serving /metrics."""
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
                                            skip_nonfinite=True))
    generator = torch.Generator().manual_seed(1)

    def samples():
        while True:
            yield torch.randint(1, VOCAB, (SEQ + 1,), generator=generator)

    stream = iter(QualityFilter(samples(), registry=agent.registry,
                                labels={"job": JOB, "run": RUN, "rank": "0"}))
    start = time.time()
    step = 0
    commanded = False
    burst: torch.Tensor | None = None
    while time.time() - start < TRAIN_SECONDS:
        elapsed = time.time() - start
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
        step += 1
        if not commanded and elapsed > TRAIN_SECONDS / 4:
            status, body = _request("POST", f"{stack['controller']}/v1/runs/{RUN}/lr-scale",
                                    stack["operator"], {"scale": 0.5, "reason": "integration test"})
            assert status == 200, body
            status, body = _request("POST", f"{stack['controller']}/v1/runs/{RUN}/reports",
                                    stack["agent"], {"not": "a report"})
            assert 400 <= status < 500, body
            commanded = True
        time.sleep(0.02)  # ~30 steps/s: many scrapes see many different steps
    assert step > 50
    return start, time.time(), agent


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


def _finite_points(result: list[dict]) -> int:
    return sum(1 for series in result for _, v in series["values"] if math.isfinite(float(v)))


def test_every_panel_and_recording_rule_returns_data(stack):
    start, end, agent = _train(stack)
    try:
        time.sleep(4)  # the last scrapes and rule evaluations
        prom = stack["prometheus"]
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
            if _finite_points(result) == 0 and expr not in NOT_REQUIRED:
                empty.append(f"{where}: {expr}")
        if empty:
            alerts = _request("GET", f"{stack['controller']}/v1/alerts?run={RUN}", stack["operator"])
            pytest.fail("queries without data:\n" + "\n".join(empty)
                        + f"\ncontroller alerts: {alerts}\n(logs in {stack['logs']})")

        # Independent checks of a few values against what the agent itself reports.
        latest = agent.latest()
        step_now = _query_range(prom, f'trainguard_step{{run="{RUN}"}}', time.time() - 2, time.time())
        assert float(step_now[0]["values"][-1][1]) == latest["trainguard_step"]  # training has stopped
        # The operator set 0.5; the controller's grad-norm spike rule may have halved it since.
        status, desired = _request("GET", f"{stack['controller']}/v1/runs/{RUN}/desired", stack["agent"])
        assert status == 200, desired
        scales = _query_range(prom, f'trainguard_lr_scale{{run="{RUN}"}}', start, time.time())
        seen = [float(v) for _, v in scales[0]["values"]]
        assert seen[-1] == desired["lr_scale"] <= 0.5
        firing = _query_range(prom, f'ALERTS{{alertname="TrainguardDataDuplicates", alertstate="firing", run="{RUN}"}}',
                              start, time.time())
        assert firing and firing[0]["metric"]["trainguard_action"] == "notify"
    finally:
        agent.close(timeout=5.0)

"""The processes the demo starts beside the ranks: the controller (:class:`Controller`) and
Prometheus (:func:`start_prometheus`)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from trainguard.demo.config import DemoConfig, say

__all__ = ["Controller", "bound_port", "start_prometheus"]


def bound_port(log: Path, proc: subprocess.Popen[bytes], pattern: str, what: str) -> int:
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


class Controller:
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
        port = bound_port(self.log_path, self.proc, r"listening on http://127\.0\.0\.1:(\d+)", "the controller")
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


def start_prometheus(cfg: DemoConfig, ctl: Controller, workdir: Path) -> subprocess.Popen[bytes] | None:
    binary = shutil.which("prometheus")
    if binary is None:
        say(cfg, "--prometheus: no 'prometheus' binary on PATH; skipped")
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
    port = bound_port(workdir / "prometheus.log", proc, r'msg="Listening on" address=127\.0\.0\.1:(\d+)', "Prometheus")
    say(cfg, f"Prometheus: http://127.0.0.1:{port}/graph?g0.expr=trainguard_grad_norm  (log: {workdir / 'prometheus.log'})")
    return proc

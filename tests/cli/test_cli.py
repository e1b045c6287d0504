"""trainguard/cli.py as a user runs it: `trainguard serve` says where the console is and whether
auth is on; a client command piped into a reader that stops early (`| head -1`) ends quietly."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from trainguard.service.server import startup_banner

TRAINGUARD = Path(sys.executable).with_name("trainguard")


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}, **extra}


class Serve:
    """`trainguard serve --port 0` as a process; ``lines``: its banner (up to the auth line)."""

    def __init__(self, db: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([str(TRAINGUARD), "serve", "--port", "0", "--db", str(db), "--log-level", "warning"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        while not self.lines or "auth is" not in self.lines[-1]:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.kill()
                raise AssertionError("trainguard serve exited: " + "".join(self.lines))
            self.lines.append(line.rstrip("\n"))
        self.url = self.lines[0].split("listening on ")[1].split()[0]

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture()
def served(tmp_path):  # type: ignore[no-untyped-def]
    started: list[Serve] = []

    def start(**env: str) -> Serve:
        started.append(Serve(tmp_path / f"tg{len(started)}.db", _env(**env)))
        return started[-1]

    yield start
    for s in started:
        s.close()


def test_serve_without_tokens_names_the_console_and_warns_that_auth_is_off(served, tmp_path) -> None:
    s = served()
    assert s.url.startswith("http://127.0.0.1:") and s.lines[0] == f"trainguard controller listening on {s.url} (db {tmp_path / 'tg0.db'})"
    assert s.lines[1:3] == [f"  console:  {s.url}/ui", f"  API docs: {s.url}/docs"]
    assert s.lines[3].startswith("  WARNING: auth is OFF: no tokens are configured (TRAINGUARD_OPERATOR_TOKENS, TRAINGUARD_AGENT_TOKENS)")
    assert len(s.lines) == 4
    # the URLs it printed are the ones that answer
    with httpx.Client(timeout=10) as c:
        assert c.get(s.lines[1].split()[-1]).status_code == 200
        assert c.get(s.lines[2].split()[-1]).status_code == 200


def test_serve_with_tokens_says_auth_is_on(served) -> None:
    s = served(TRAINGUARD_OPERATOR_TOKENS="operator-token-1,reader-token-22:read", TRAINGUARD_AGENT_TOKENS="agent-token-1")
    assert s.lines[3] == ("  auth is ON: 2 operator and 1 agent token(s) configured; every /v1 request and the "
                          "console need one")
    assert not any("WARNING" in line for line in s.lines)
    with httpx.Client(base_url=s.url, timeout=10) as c:
        assert c.get("/v1/runs").status_code == 401  # what the banner said
        assert c.get("/v1/runs", headers={"Authorization": "Bearer reader-token-22"}).status_code == 200


@pytest.mark.parametrize("host, shown, browse", [("0.0.0.0", "0.0.0.0", "127.0.0.1"), ("::", "[::]", "[::1]"),
                                                 ("10.1.2.3", "10.1.2.3", "10.1.2.3")])
def test_banner_of_an_all_interfaces_bind_names_a_browsable_url(host, shown, browse) -> None:
    settings = SimpleNamespace(db=Path("/data/trainguard.db"), auth_enabled=True, operator_tokens=("a" * 8,), agent_tokens=())
    lines = startup_banner(settings, host, 8000).splitlines()
    assert lines[:3] == [f"trainguard controller listening on http://{shown}:8000 (db /data/trainguard.db)",
                         f"  console:  http://{browse}:8000/ui", f"  API docs: http://{browse}:8000/docs"]
    assert lines[3].startswith("  auth is ON: 1 operator and 0 agent token(s)")


@pytest.mark.skipif(shutil.which("head") is None, reason="needs head(1)")
@pytest.mark.parametrize("command", [["runs", "--json"], ["status", "run-0007"]])
def test_output_piped_into_head_ends_quietly(served, command) -> None:
    """`trainguard ... | head -1` through a real pipe: head exits after one line while the command
    still has output to write; the command prints no traceback and exits with 141, as a tool
    ended by SIGPIPE does. Its output is larger than a pipe's buffer, so head is gone before the
    command has written it all, every time."""
    s = served()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        for i in range(600):  # ~200 KB of `runs --json`
            r = c.post("/v1/runs", json={"job": "job-pipe", "run": f"run-{i:04d}", "world_size": 1, "ranks": []})
            assert r.status_code == 200, r.text
        if command[0] == "status":  # a run whose status is large: many reported series
            values = {f"trainguard_custom_series_{k:04d}_{'x' * 100}": float(k) for k in range(900)}
            r = c.post("/v1/runs/run-0007/reports", json={"job": "job-pipe", "step_first": 1, "step_last": 1,
                                                          "time": 1.0, "values": values})
            assert r.status_code == 200, r.text
    full = subprocess.run([str(TRAINGUARD), *command, "--url", s.url], capture_output=True, timeout=60, env=_env())
    assert full.returncode == 0 and len(full.stdout) > 2 * 64 * 1024, len(full.stdout)  # > 2 pipe buffers
    writer = subprocess.Popen([str(TRAINGUARD), *command, "--url", s.url], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=_env())
    reader = subprocess.Popen(["head", "-1"], stdin=writer.stdout, stdout=subprocess.PIPE)
    writer.stdout.close()  # only head holds the pipe's read end now
    first, _ = reader.communicate(timeout=60)
    err = writer.stderr.read()
    writer.stderr.close()
    assert writer.wait(60) == 141, err
    assert err == b""  # no BrokenPipeError traceback, no "Exception ignored"
    assert first == full.stdout.splitlines(keepends=True)[0]

"""Fixtures of the console's browser tests: a real ``trainguard serve`` with tokens on a free
loopback port, Debian's Chromium driven headless by Playwright (never a downloaded browser), and a
page that records every request it makes and refuses any that would leave 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from tests.control.procs import until

OPERATOR, READER = "operator-token-ui-1", "reader-token-ui-1"
#: The runs the tests use, each with its own agent token (TOKEN:RUN entries).
RUNS = ("run-charts", "run-alert", "run-pause", "run-ranks", "run-readonly", "run-offline", "run-actions",
        "run-del-finished", "run-del-live", "run-del-readonly", "run-del-elsewhere", "run-finished", "run-preflight")


def agent_token(run: str) -> str:
    return f"agent-{run}-token"

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
    # no name resolves but the loopback address: a request for anything else fails instead of leaving
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]


class Controller:
    """``trainguard serve`` with an operator, a read-only operator and an agent token."""

    def __init__(self, db: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
        env.update(TRAINGUARD_OPERATOR_TOKENS=f"{OPERATOR},{READER}:read", TRAINGUARD_AGENT_TOKENS=",".join(f"{agent_token(r)}:{r}" for r in RUNS),
                   OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.log = db.with_suffix(".log")
        self._out = self.log.open("w")
        # with the access log: the tests read it to check that no token is ever logged
        self.proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "serve", "--port", "0", "--db", str(db), "--access-log"],
                                     stdout=self._out, stderr=subprocess.STDOUT, env=env)
        assert until(lambda: "listening on" in self.log.read_text() or self.proc.poll() is not None, 60.0)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.log.read_text())
        assert m, self.log.read_text()
        self.url = m.group(1)
        self.operator = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=10.0)
        assert until(lambda: self.operator.get("/healthz").status_code == 200, 30.0)

    def run(self, run: str) -> dict[str, Any]:
        return self.operator.get(f"/v1/runs/{run}").json()

    def close(self) -> None:
        self.operator.close()
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
        self._out.close()


class ScriptedAgent:
    """An agent client speaking the wire protocol by hand: registers a run and posts reports.
    ``nodes``: each rank's node (None: registered without one, as an older agent does)."""

    def __init__(self, url: str, run: str, world_size: int = 2, nodes: list[str | None] | None = None) -> None:
        self.run = run
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {agent_token(run)}"}, timeout=10.0)
        ranks = [{"rank": r, "local_rank": r, "host": "127.0.0.1", "port": 9100 + r} for r in range(world_size)]
        for rank, node in zip(ranks, nodes or []):
            if node is not None:
                rank["node"] = node
        body = {"job": "job-ui", "run": run, "world_size": world_size, "agent_version": "scripted", "ranks": ranks}
        resp = self.http.post("/v1/runs", json=body)
        assert resp.status_code == 200, resp.text

    def report(self, step: int, values: dict[str, float], ranks: dict[str, list[float]] | None = None) -> dict[str, Any]:
        enc = {k: ("NaN" if v != v else v) for k, v in values.items()}
        body = json.dumps({"job": "job-ui", "step_first": step, "step_last": step, "time": time.time(), "values": enc,
                           "ranks": ranks or {}})
        resp = self.http.post(f"/v1/runs/{self.run}/reports", content=body, headers={"Content-Type": "application/json"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def close(self) -> None:
        self.http.close()


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    ctl = Controller(tmp_path_factory.mktemp("console") / "tg.db")
    yield ctl
    ctl.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Debian's chromium is missing: run scripts/setup.sh (apt package 'chromium')"
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """A fresh browser context and page; every request it makes is recorded, and any request for
    a host other than 127.0.0.1 is aborted (and recorded as such)."""

    def __init__(self, browser: Any, controller: Controller) -> None:
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.page = self.context.new_page()
        self.requests: list[str] = []
        self.refused: list[str] = []
        self.errors: list[str] = []

        def guard(route: Any) -> None:
            url = route.request.url
            self.requests.append(url)
            if urlsplit(url).hostname != "127.0.0.1":
                self.refused.append(url)
                route.abort()
            else:
                route.continue_()

        self.context.route("**/*", guard)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        # the pages' Content-Security-Policy admits only the controller's own scripts and styles:
        # a violation (an inline script or style, a foreign asset) is a failure too
        self.page.on("console", lambda m: "Content Security Policy" in m.text and self.errors.append(m.text))
        self.url = controller.url

    def sign_in(self, token: str, path: str = "/ui") -> None:
        self.page.goto(self.url + path)
        self.page.fill("#signin-token", token)
        self.page.click("#signin-form button[type=submit]")
        self.page.wait_for_selector("#signin", state="hidden")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any, controller: Controller) -> Iterator[Page]:
    p = Page(browser, controller)
    yield p
    p.close()
    assert not p.errors, p.errors

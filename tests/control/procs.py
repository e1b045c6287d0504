"""Real processes for the control tests: a ``trainguard serve`` controller (killable and
restartable on its database) and a group of gloo ranks running ``dist_worker.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from trainguard.protocol.wire import RankValues
from trainguard.service.statements import decode_ranks

ROOT = Path(__file__).resolve().parents[2]
TRAINGUARD = str(Path(sys.executable).with_name("trainguard"))
WORKER = str(Path(__file__).with_name("dist_worker.py"))


def until(pred, timeout: float = 30.0, interval: float = 0.005) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``pred`` until it is true or ``timeout`` seconds passed; its last value. The default
    deadline is generous: it costs nothing when the condition comes true, and a loaded machine
    may take seconds for what takes milliseconds on an idle one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return bool(pred())


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return env


def operator_only_rules(directory: Path) -> Path:
    """A rules file in ``directory``: the built-in rules without the ones that set lr_scale on
    their own (recovery's ladder and LR ramp, the update-ratio and scheduled-LR rules), and with a NaN loss pausing
    the run for a human (as without recovery), for tests that check an operator's commands
    generation by generation."""
    import yaml

    rules = yaml.safe_load((ROOT / "service" / "default_rules.yaml").read_text())
    rules["recovery"] = {"enabled": False}
    rules["rules"] = [r for r in rules["rules"] if r["name"] not in ("update_ratio_spike", "scheduler_lr_jump")]
    for r in rules["rules"]:
        if r["name"] == "loss_nonfinite":
            r["actions"] = ["pause", "notify"]
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    return path


def module_controller(factory: pytest.TempPathFactory, *, operator_only: bool = False) -> Iterator[ControllerProcess]:
    """The body of a test module's controller fixture: ``trainguard serve`` with the built-in rules
    (or :func:`operator_only_rules`) on a database of its own, killed once the module is done."""
    tmp = factory.mktemp("ctl")
    ctl = ControllerProcess(tmp / "trainguard.db", rules=operator_only_rules(tmp) if operator_only else None).start()
    yield ctl
    ctl.kill()


class ControllerProcess:
    """``trainguard serve`` on a free loopback port with its own SQLite file; ``kill()`` sends
    SIGKILL, ``start()`` starts it again on the same database (a new port unless given). ``env``:
    ``TRAINGUARD_*`` settings for it (none from this process's environment are passed on)."""

    def __init__(self, db: Path, rules: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.db = db
        self.rules = rules
        self.env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.port = 0

    def start(self, port: int = 0) -> ControllerProcess:
        self.proc = subprocess.Popen(
            [TRAINGUARD, "serve", "--host", "127.0.0.1", "--port", str(port), "--db", str(self.db)]
            + (["--rules", str(self.rules)] if self.rules is not None else []),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env() | self.env, cwd=ROOT,
        )
        assert self.proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listening on (http://127\.0\.0\.1:(\d+))", line)
            if m:
                self.url, self.port = m.group(1), int(m.group(2))
                break
        if not self.url:
            self.kill()
            raise RuntimeError("trainguard serve did not start:\n" + "".join(lines))
        # drain its output so it never blocks on a full pipe
        threading.Thread(target=lambda out=self.proc.stdout: [None for _ in out], daemon=True).start()
        assert until(lambda: self._healthy(), 30.0), "controller not healthy"
        return self

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    # -- operator side ---------------------------------------------------------------------
    def command(self, run: str, command: str, *, on_restart: bool = False, **body: object) -> dict:
        """``command`` sent to ``run``; ``on_restart``: queued for a finished run's next registration."""
        r = httpx.post(f"{self.url}/v1/runs/{run}/{command}", json={"reason": "test", **body}, timeout=10.0,
                       params={"on_restart": "true"} if on_restart else None)
        r.raise_for_status()
        return r.json()

    def run_detail(self, run: str) -> dict | None:
        r = httpx.get(f"{self.url}/v1/runs/{run}", timeout=10.0)
        return r.json() if r.status_code == 200 else None

    def acks(self, run: str) -> list[tuple[int, int]]:
        """(generation, step) of every ack recorded for ``run`` (from its audit log)."""
        events = httpx.get(f"{self.url}/v1/runs/{run}/events", timeout=10.0).json()
        return [(e["generation"], e["data"]["step"]) for e in events if e["kind"] == "applied"]

    def reports(self, run: str) -> list[dict]:
        """The reports stored for ``run``, read from the controller's database: ``steps``
        (first, last), ``values`` and ``ranks`` (per-rank vectors as lists)."""
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10.0) as con:
            con.row_factory = sqlite3.Row
            world = con.execute("SELECT world_size FROM runs WHERE run=?", (run,)).fetchone()
            rows = con.execute("SELECT r.* FROM reports r JOIN runs u ON u.id = r.run_id WHERE u.run=? ORDER BY r.seq",
                               (run,)).fetchall()
        names = tuple(RankValues.model_fields)
        return [{"steps": (r["step_first"], r["step_last"]), "values": json.loads(r["vals"]),
                 "ranks": {k: v.tolist() for k, v in decode_ranks(r, world[0], names).items()}} for r in rows]


class Ranks:
    """``world`` processes of ``dist_worker.py`` with one JSON config; logs go to ``out``. The
    ranks meet through a file store in ``out`` (no port to pick, so none to collide on)."""

    def __init__(self, world: int, cfg: dict, out: Path, worker: str = WORKER) -> None:
        self.out = out
        store = out / f"store-{cfg['scenario']}"
        self.procs = []
        for rank in range(world):
            env = _env()
            env.update(RANK=str(rank), WORLD_SIZE=str(world), DIST_INIT_METHOD=f"file://{store}")
            log = open(out / f"worker-{cfg['scenario']}-rank{rank}.log", "w")  # noqa: SIM115 - closed in wait()
            self.procs.append((subprocess.Popen([sys.executable, worker, json.dumps({**cfg, "out": str(out)})],
                                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log))

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p, log in self.procs:
            try:
                codes.append(p.wait(max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
            log.close()
        return codes

    def exited(self) -> bool:
        """True once any rank has exited (for waits that should not outlive a crashed rank)."""
        return any(p.poll() is not None for p, _ in self.procs)

    def kill(self) -> None:
        for p, log in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()

    def output(self) -> str:
        return "\n".join(f.read_text()[-3000:] for f in sorted(self.out.glob("worker-*.log")))

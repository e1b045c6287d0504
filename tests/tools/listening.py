"""Start a server process on port 0 and read the port it bound from its log (Prometheus and
Alertmanager log ``msg="Listening on" address=127.0.0.1:PORT``, ``trainguard serve`` prints
``listening on http://127.0.0.1:PORT``): no port picked in advance, so none another process can
take in between. The log goes to a file, so no pipe can fill up."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

__all__ = ["start_listening", "stop"]

_LISTENING = re.compile(r'(?:msg="Listening on" address=|listening on http://)127\.0\.0\.1:(\d+)')


def start_listening(cmd: list[str], log: Path, timeout: float = 60.0,
                    env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """Run ``cmd`` (which must listen on ``127.0.0.1:0`` and log at level info or lower) with its
    output in ``log``; return the process and the port it bound. Fails with the log when it exits
    or has not bound within ``timeout`` seconds."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = _LISTENING.search(log.read_text(errors="replace"))
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop(proc)
    raise RuntimeError(f"{cmd[0]} did not start listening:\n{log.read_text(errors='replace')[-3000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

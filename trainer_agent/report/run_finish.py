"""Telling the controller that the run ended (``POST /v1/runs/{run}/finish``): what the controller
client's sender does last as it closes (``trainer_agent/report/client.py``), within the close
deadline and never raising (the run is over either way)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from trainguard.protocol.wire import RunFinished, dumps
from trainer_agent.report.controller_link import ControllerLink, Failures

__all__ = ["send_finish"]


def send_finish(link: ControllerLink, http: httpx.Client, run: str, finish: RunFinished, *, deadline: float,
                clock: Callable[[], float], failures: Failures) -> bool:
    """Post ``finish`` for ``run``, never past ``deadline`` (on ``clock``) and never raising; True
    when the controller took it. Another attempt when one failed on a kept-alive connection the
    server had closed (no answer, no timeout), and one at each further controller URL: the finish
    is idempotent, so sending it twice is harmless."""
    attempts = max(2, len(link.bases))
    for attempt in range(1, attempts + 1):
        left = deadline - clock()
        if left <= 0:
            return False
        try:
            link.exchange(http, "POST", f"/runs/{run}/finish", dumps(finish), None,
                          timeout=httpx.Timeout(min(left, link.timeout.read or left)))
            return True
        except Exception as exc:  # noqa: BLE001 - fail open
            stale = isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError))
            if attempt == attempts or not (stale or attempt < len(link.bases)):
                failures.note(f"finish-{type(exc).__name__}", f"could not tell the controller the run finished: {exc!r}")
                return False
    return False

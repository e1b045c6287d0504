"""Registering a run (service/registration.py): two ranks that register one /metrics endpoint
(host:port) are accepted (the run is monitored and controlled all the same) and warned of in the
registration event, naming the ranks; ranks with endpoints of their own, or none, are not."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.service.conftest import register


def _ranks(*endpoints: tuple[int, str, int]) -> list[dict[str, Any]]:
    return [{"rank": r, "local_rank": 0, "host": host, "port": port} for r, host, port in endpoints]


def _registered_reason(client: Any, ranks: list[dict[str, Any]], world_size: int = 16) -> str:
    resp = client.post("/v1/runs", json={"job": "job-a", "run": "run-1", "world_size": world_size, "ranks": ranks})
    assert resp.status_code == 200, resp.text
    events = client.get("/v1/runs/run-1/events").json()
    return [e["reason"] for e in events if e["kind"] == "registered"][-1]


def test_ranks_sharing_a_metrics_endpoint_are_accepted_and_named(app_factory, caplog: pytest.LogCaptureFixture) -> None:
    # ranks 0 and 8: local rank 0 of two nodes with the loopback metrics_host; ranks 3 and 5: one port, two names of a host
    ranks = _ranks((0, "127.0.0.1", 9400), (8, "127.0.0.1", 9400), (1, "node-a", 9401), (3, "node-b", 9402),
                   (5, "NODE-B", 9402), (9, "node-b", 9403))
    with app_factory() as client, caplog.at_level(logging.WARNING, logger="trainguard.controller"):
        reason = _registered_reason(client, ranks)
        assert client.get("/v1/runs/run-1").status_code == 200  # registered: monitored and controlled
    expected = ("registered; one /metrics endpoint registered by several ranks: 127.0.0.1:9400 by ranks 0, 8; "
                "node-b:9402 by ranks 3, 5; Prometheus scrapes one process there, not each rank: give every rank a "
                "host other hosts reach (AgentConfig.metrics_host) and a port of its own")
    assert reason == expected
    assert [r.getMessage() for r in caplog.records] == [f"run 'run-1': {expected[len('registered; '):]}"]


def test_many_shared_endpoints_are_named_up_to_a_bound(app_factory) -> None:
    ranks = _ranks(*((r, "127.0.0.1", 9400 + r % 6) for r in range(60)))  # 6 ports, 10 ranks on each
    with app_factory() as client:
        reason = _registered_reason(client, ranks, world_size=60)
    assert "127.0.0.1:9400 by ranks 0, 6, 12, 18 and 6 more; " in reason
    assert "127.0.0.1:9403 by ranks 3, 9, 15, 21 and 6 more (and 2 more endpoints);" in reason
    assert "9404" not in reason


@pytest.mark.parametrize("ranks", [
    _ranks((0, "127.0.0.1", 9400), (1, "127.0.0.1", 9401), (2, "node-b", 9400)),  # endpoints of their own
    _ranks((0, "node-a", 9400)),  # ranks 1-3 without a metrics port (metrics_port=None) are not listed
    [],
])
def test_ranks_with_endpoints_of_their_own_or_none_are_not_warned(app_factory, ranks: list[dict[str, Any]]) -> None:
    with app_factory() as client:
        assert _registered_reason(client, ranks, world_size=4) == "registered"
        register(client, world_size=4)  # a restart of the run: its ranks' ports of their own
        events = client.get("/v1/runs/run-1/events").json()
    assert [e["reason"] for e in events if e["kind"] == "registered"] == ["registered", "re-registered"]

"""Cheap callers cannot stall the event loop: an unauthenticated body is refused before anything
reads it, and rule simulations run in worker threads (bounded in number) while reports of
training runs keep being answered."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainguard.service.app import create_app
from trainguard.service.config import Settings

OP, AGENT = "operator-token-0001", "agent-token-0001"


@pytest.mark.parametrize("method,path", [("POST", "/v1/rules/test"), ("POST", "/v1/webhooks"), ("POST", "/v1/runs"),
                                         ("PUT", "/v1/rules"), ("POST", "/v1/runs/r/reports"), ("POST", "/v1/runs/r/pause")])
def test_unauthenticated_body_is_refused_unread(tmp_path: Path, method: str, path: str) -> None:
    app = create_app(Settings(db=tmp_path / "tg.db", operator_tokens=(OP,), agent_tokens=(AGENT,)))
    reads: list[Any] = []
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        reads.append(1)
        return {"type": "http.request", "body": b"[" * (3_500_000), "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    for headers in ([], [(b"authorization", b"Bearer wrong-token-xyz")]):
        reads.clear(), sent.clear()
        scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": b"", "headers": [(b"content-length", b"3500000"), (b"content-type", b"application/json"), *headers],
                 "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1)}
        asyncio.run(app(scope, receive, send))
        assert sent[0]["status"] == 401 and reads == []


def _reports(n: int) -> list[dict[str, Any]]:
    return [{"job": "test", "step_first": i, "step_last": i, "time": float(i),
             "values": {"trainguard_loss": 2.0 + (i % 7) * 0.01, "trainguard_grad_norm": 1.0}} for i in range(n)]


async def _scenario(db: Path) -> None:
    app = create_app(Settings(db=db, operator_tokens=(OP,), agent_tokens=(AGENT,)))
    heavy = json.dumps({"reports": _reports(4_000)}).encode()
    op = {"authorization": f"Bearer {OP}", "content-type": "application/json"}
    ag = {"authorization": f"Bearer {AGENT}"}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=600) as c:
            reg = {"job": "job-a", "run": "run-1", "world_size": 1, "ranks": []}
            assert (await c.post("/v1/runs", json=reg, headers=ag)).status_code == 200
            gate = app.state.simulations
            sims = [asyncio.create_task(c.post("/v1/rules/test", content=heavy, headers=op)) for _ in range(4)]
            while gate.inside < 4:
                await asyncio.sleep(0.01)
            answered_during = 0
            for step in range(1, 6):
                report = {"job": "job-a", "step_first": step, "step_last": step, "time": float(step), "values": {"trainguard_loss": 2.0}}
                r = await c.post("/v1/runs/run-1/reports", json=report, headers=ag)
                assert r.status_code == 200, r.text
                answered_during += not all(s.done() for s in sims)
            # beyond the running and waiting bound, a simulation is refused, not queued forever
            extra = [asyncio.create_task(c.post("/v1/rules/test", content=heavy, headers=op)) for _ in range(14)]
            results = [await s for s in sims + extra]
            assert all(r.status_code in (200, 429) for r in results)
            assert sum(r.status_code == 429 for r in results) >= 4
            assert results[0].status_code == 200 and len(results[0].json()["steps"]) == 4_000
            assert answered_during >= 1  # reports were answered while simulations ran


def test_reports_are_answered_while_rule_simulations_run(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path / "tg.db"))

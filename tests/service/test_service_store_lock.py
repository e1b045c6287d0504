"""A write lock held by another connection (a backup, an operator's sqlite3 shell) stalls only
the writes waiting for it: the commit waits in a worker thread, so every other route answers."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import httpx

from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.store import Store

REG = {"job": "job-a", "run": "run-1", "world_size": 1, "agent_version": "t",
       "ranks": [{"rank": 0, "local_rank": 0, "host": "127.0.0.1", "port": 9100}]}
REPORT = b'{"job":"job-a","step_first":1,"step_last":1,"time":1.0,"values":{"trainguard_loss":2.0}}'


async def _scenario(db: Path) -> None:
    app = create_app(Settings(db=db), store=Store(db, busy_timeout_ms=60_000))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.post("/v1/runs", json=REG)).status_code == 200
            lock = sqlite3.connect(db, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")
            try:
                report = asyncio.create_task(c.post("/v1/runs/run-1/reports", content=REPORT,
                                                    headers={"content-type": "application/json"}))
                # the report reaches the store and waits for the lock (not on the event loop)
                store = app.state.controller.store
                for _ in range(2000):
                    if store._offloaded:
                        break
                    await asyncio.sleep(0.005)
                assert store._offloaded
                # innocent routes answer while the write waits
                for path in ("/v1/runs", "/v1/runs/run-1", "/healthz"):
                    r = await c.get(path)
                    assert r.status_code == 200, (path, r.text)
                assert not report.done()
                # a second write queues behind the first, in order
                second = asyncio.create_task(c.post("/v1/runs/run-1/reports", content=REPORT.replace(b"1", b"2"),
                                                    headers={"content-type": "application/json"}))
                await asyncio.sleep(0.05)
                assert not second.done()
            finally:
                lock.execute("ROLLBACK")
                lock.close()
            r1, r2 = await report, await second
            assert r1.status_code == 200, r1.text
            assert r2.status_code == 200, r2.text
            detail = (await c.get("/v1/runs/run-1")).json()
            assert detail["reports"] == 2 and detail["last_step"] == 2


def test_report_waiting_for_a_write_lock_leaves_other_routes_answering(tmp_path: Path) -> None:
    asyncio.run(_scenario(tmp_path / "tg.db"))

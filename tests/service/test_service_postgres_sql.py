"""What a statement reads of its cursor on PostgreSQL (service/postgres_sql.py), inside the store's
pipelined commit as outside it: the number of rows a statement changed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi.testclient import TestClient

from trainguard.service import statements as sql
from trainguard.service.app import create_app
from trainguard.service.config import Settings

psycopg = pytest.importorskip("psycopg", reason="the postgres extra is not installed: pip install -e '.[postgres]'")
from trainguard.service.store_postgres import PostgresStore  # noqa: E402 - needs psycopg


def test_a_changed_row_count_reaches_a_statement_in_the_pipelined_commit(postgres_url: str) -> None:
    store = PostgresStore(postgres_url)

    async def batch() -> list[Any]:
        store.start()
        ops = [lambda c: sql.mark_alertmanager_seen(c, "fp", "2026-01-01T00:00:00Z", 1.0),
               lambda c: sql.mark_alertmanager_seen(c, "fp", "2026-01-01T00:00:00Z", 2.0)]
        return list(await asyncio.gather(*(store.submit(op) for op in ops)))  # one batch, one pipeline

    try:
        assert asyncio.run(batch()) == [True, False]  # new, then already seen
        assert store.retried_batches == 0  # answered in the pipeline, not by the batch run again
    finally:
        store.close()


def test_deleting_a_webhook_answers_204_then_404(store_db: Any) -> None:
    with TestClient(create_app(Settings(db=store_db, tick_s=60))) as c:
        hook = c.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/hook", "secret": "s" * 24}).json()["id"]
        assert c.delete(f"/v1/webhooks/{hook}").status_code == 204
        assert c.get("/v1/webhooks").json() == []
        r = c.delete(f"/v1/webhooks/{hook}")
        assert r.status_code == 404 and r.json()["detail"] == f"webhook {hook} does not exist"

"""Fixtures of the controller tests: an app on a temporary database, report builders."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.wire import Report


def make_report(step: int, t: float, values: dict[str, float] | None = None, job: str = "job-a", **ranks: list[float]) -> Report:
    return Report(job=job, step_first=step, step_last=step, time=t, values=values or {}, ranks=ranks)


@pytest.fixture
def app_factory(tmp_path: Path) -> Iterator[Callable[..., contextlib.AbstractContextManager[TestClient]]]:
    """``with app_factory(**settings) as client``: a started app on ``tmp_path/tg.db``."""

    @contextlib.contextmanager
    def factory(*, clock: Callable[[], float] | None = None, transport: Any = None, **overrides: Any) -> Iterator[TestClient]:
        settings = Settings(db=tmp_path / "tg.db", **overrides)
        app = create_app(settings, clock=clock, transport=transport)
        with TestClient(app) as client:
            yield client

    yield factory


def register(client: TestClient, run: str = "run-1", job: str = "job-a", world_size: int = 4, headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = {
        "job": job, "run": run, "world_size": world_size, "agent_version": "test",
        "ranks": [{"rank": r, "local_rank": r, "host": "127.0.0.1", "port": 9100 + r} for r in range(world_size)],
    }
    resp = client.post("/v1/runs", json=body, headers=headers or {})
    assert resp.status_code == 200, resp.text
    return resp.json()

"""A registration whose config nests deeper than the encoders can follow is 422, so the run's
status page (GET /v1/runs/{run}) can never be broken by it."""

from __future__ import annotations

import json
from typing import Any, Callable

from trainguard.protocol.wire import MAX_CONFIG_DEPTH


def _nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _register(c: Any, config: Any) -> Any:
    body = json.dumps({"job": "job-a", "run": "run-1", "world_size": 1, "config": config}).encode()
    return c.post("/v1/runs", content=body, headers={"content-type": "application/json"})


def test_config_deeper_than_the_limit_is_422(app_factory: Callable[..., Any]) -> None:
    with app_factory() as c:
        r = _register(c, {"k": _nested(900)})
        assert r.status_code == 422, r.text
        assert f"more than {MAX_CONFIG_DEPTH} levels" in r.text
        assert c.get("/v1/runs/run-1").status_code == 404


def test_config_at_the_limit_is_kept_and_read_back(app_factory: Callable[..., Any]) -> None:
    config = {"k": _nested(MAX_CONFIG_DEPTH - 1)}  # the config object itself is the first level
    with app_factory() as c:
        assert _register(c, config).status_code == 200
        r = c.get("/v1/runs/run-1")
        assert r.status_code == 200 and r.json()["config"] == config
        assert _register(c, {"k": _nested(MAX_CONFIG_DEPTH)}).status_code == 422

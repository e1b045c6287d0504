"""A run belongs to the agent token that registered it (or to a ``TOKEN:RUN`` entry): another
agent token cannot take it over by registering it."""

from __future__ import annotations

from fastapi.testclient import TestClient

from trainguard.service.app import create_app
from trainguard.service.config import Settings

A, B, C = "agent-token-aaaa", "agent-token-bbbb", "agent-token-cccc"
OP = "operator-token-1"


def _reg(run: str = "r1") -> dict:
    return {"job": "j", "run": run, "world_size": 1,
            "ranks": [{"rank": 0, "local_rank": 0, "host": "127.0.0.1", "port": 9100}]}


def _h(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _report() -> dict:
    return {"job": "j", "step_first": 1, "step_last": 1, "time": 1.0, "values": {}}


def test_another_agent_token_cannot_take_over_a_registered_run(tmp_path) -> None:
    settings = Settings(db=str(tmp_path / "t.db"), operator_tokens=OP, agent_tokens=f"{A},{B},{C}:r2")
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/runs", json=_reg(), headers=_h(A)).status_code == 200
        r = c.post("/v1/runs", json=_reg(), headers=_h(B))
        assert r.status_code == 403 and "belongs to another agent token" in r.text
        assert c.post("/v1/runs/r1/reports", json=_report(), headers=_h(B)).status_code == 403
        # B was not bound by the refused attempt: it can still register a run of its own
        assert c.post("/v1/runs", json=_reg("r3"), headers=_h(B)).status_code == 200
        # the run's ranks are still the owner's
        targets = c.get("/v1/sd/targets", headers=_h(OP)).json()
        assert [t["labels"]["run"] for t in targets].count("r1") == 1
        # the owner re-registers (a restarted job) as before
        assert c.post("/v1/runs", json=_reg(), headers=_h(A)).status_code == 200


def test_a_run_reserved_by_token_colon_run_cannot_be_claimed_by_an_unbound_token(tmp_path) -> None:
    settings = Settings(db=str(tmp_path / "t.db"), operator_tokens=OP, agent_tokens=f"{A},{C}:r2")
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/runs", json=_reg("r2"), headers=_h(A)).status_code == 403
        assert c.post("/v1/runs", json=_reg("r2"), headers=_h(C)).status_code == 200

"""A run belongs to the agent token that registered it (or to a ``TOKEN:RUN`` entry): another
agent token cannot take it over by registering it."""

from __future__ import annotations

import json

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
        r = c.post("/v1/runs/r1/reports", json=_report(), headers=_h(B))  # as for a run that does not exist
        assert r.status_code == 404
        assert r.json()["detail"] == "run 'r1' is not registered with this agent token: register it first (POST /v1/runs)"
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


_AFTER_REGISTRATION = ("report", "desired", "ack", "preflight", "finish")


def _agent_routes(c: TestClient, token: str, run: str) -> dict[str, int]:
    """The status of every agent route for ``run`` with ``token``."""
    h = _h(token)
    return {
        "register": c.post("/v1/runs", json=_reg(run) | {"job": "llm-7b"}, headers=h).status_code,
        "report": c.post(f"/v1/runs/{run}/reports", headers=h | {"content-type": "application/json"},
                         content=json.dumps(_report() | {"job": "llm-7b", "values": {"trainguard_loss": float("nan")}})).status_code,
        "desired": c.get(f"/v1/runs/{run}/desired", headers=h).status_code,
        "ack": c.post(f"/v1/runs/{run}/acks", json={"generation": 0, "step": 1}, headers=h).status_code,
        "preflight": c.post(f"/v1/runs/{run}/preflight", json={"seconds": 0.5, "checks": []}, headers=h).status_code,
        "finish": c.post(f"/v1/runs/{run}/finish", json={"step": 1, "reason": "hijacked"}, headers=h).status_code,
    }


def test_a_run_of_a_runtime_token_cannot_be_taken_by_a_configured_agent_token(tmp_path) -> None:
    settings = Settings(db=str(tmp_path / "t.db"), operator_tokens=OP, agent_tokens=f"{A},{C}:r2")
    with TestClient(create_app(settings)) as c:
        fleet = c.post("/v1/tokens", json={"scopes": ["agent"], "job": "llm*"}, headers=_h(OP)).json()["token"]
        assert c.post("/v1/runs", json=_reg("llm-a") | {"job": "llm-7b"}, headers=_h(fleet)).status_code == 200
        # the unbound configured token, and a TOKEN:RUN token, get nothing of it
        for token in (A, C):
            r = c.post("/v1/runs", json=_reg("llm-a") | {"job": "llm-7b"}, headers=_h(token))
            assert r.status_code == 403
            assert r.json()["detail"] == {A: "run 'llm-a' belongs to another agent token; to hand it to this one, configure it "
                                             "as TOKEN:llm-a in TRAINGUARD_AGENT_TOKENS",
                                          C: "this agent token is bound to run 'r2', not 'llm-a'"}[token]
            routes = _agent_routes(c, token, "llm-a")
            # the unbound token is answered as for a run that does not exist (its agent registers, and is refused)
            assert routes == {"register": 403} | dict.fromkeys(_AFTER_REGISTRATION, 404 if token == A else 403), token
        run = c.get("/v1/runs/llm-a", headers=_h(OP)).json()
        assert run["status"] == "registered" and run["reports"] == 0 and run["finished_at"] is None
        assert not run["desired"]["paused"]
        events = c.get("/v1/runs/llm-a/events", headers=_h(OP)).json()
        assert [e["kind"] for e in events] == ["registered"]
        # the refused attempts did not bind A: it registers a run of its own, and the owner carries on
        assert c.post("/v1/runs", json=_reg("a-own"), headers=_h(A)).status_code == 200
        assert _report_status(c, fleet, "llm-a") == 200


def test_a_run_of_a_configured_token_cannot_be_taken_by_a_runtime_token(tmp_path) -> None:
    settings = Settings(db=str(tmp_path / "t.db"), operator_tokens=OP, agent_tokens=f"{A}")
    with TestClient(create_app(settings)) as c:
        fleet = c.post("/v1/tokens", json={"scopes": ["agent"], "job": "*"}, headers=_h(OP)).json()["token"]
        assert c.post("/v1/runs", json=_reg("llm-b") | {"job": "llm-7b"}, headers=_h(A)).status_code == 200
        routes = _agent_routes(c, fleet, "llm-b")
        assert routes == {"register": 403} | dict.fromkeys(_AFTER_REGISTRATION, 404), routes
        assert _report_status(c, A, "llm-b") == 200


def test_concurrent_first_registrations_by_two_kinds_of_token_give_the_run_to_one(tmp_path) -> None:
    import asyncio

    settings = Settings(db=str(tmp_path / "t.db"), operator_tokens=OP, agent_tokens=f"{A}")
    with TestClient(create_app(settings)) as c:
        fleet = c.post("/v1/tokens", json={"scopes": ["agent"], "job": "*"}, headers=_h(OP)).json()["token"]
        ctl, tokens = c.app.state.controller, c.app.state.tokens
        from trainguard.protocol.wire import RunRegistration

        reg = RunRegistration.model_validate(_reg("race"))

        async def both() -> list[object]:
            return await asyncio.gather(*(ctl.register(reg, tokens.authenticate(f"Bearer {t}")) for t in (A, fleet)),
                                        return_exceptions=True)

        outcomes = c.portal.call(both)
        assert [type(o).__name__ for o in outcomes] == ["RunRegistered", "Forbidden"]
        assert [_report_status(c, t, "race") for t in (A, fleet)] == [200, 404]


def test_a_run_named_by_token_colon_run_belongs_to_that_token_even_if_another_registered_it_first(tmp_path) -> None:
    db = str(tmp_path / "t.db")
    with TestClient(create_app(Settings(db=db, operator_tokens=OP, agent_tokens=A))) as c:
        assert c.post("/v1/runs", json=_reg("r9"), headers=_h(A)).status_code == 200
    # the operator hands r9 to C; A's binding (stored) no longer admits it
    with TestClient(create_app(Settings(db=db, operator_tokens=OP, agent_tokens=f"{A},{C}:r9"))) as c:
        r = c.post("/v1/runs/r9/reports", json=_report(), headers=_h(A))
        assert r.status_code == 403
        assert r.json()["detail"] == "run 'r9' belongs to the agent token configured for it (TOKEN:r9 in TRAINGUARD_AGENT_TOKENS)"
        assert _report_status(c, C, "r9") == 200


def _report_status(c: TestClient, token: str, run: str) -> int:
    job = c.get(f"/v1/runs/{run}", headers=_h(OP)).json()["job"]
    return c.post(f"/v1/runs/{run}/reports", json=_report() | {"job": job}, headers=_h(token)).status_code


def test_a_rank_host_that_is_not_a_host_name_or_address_is_refused_and_never_a_target(tmp_path) -> None:
    settings = Settings(db=str(tmp_path / "t.db"), operator_tokens=OP, agent_tokens=f"{A},{B}")
    with TestClient(create_app(settings)) as c:
        for host in ("evil.example/x?y#\n", "user@host", "a b", "host:9100", "[10.0.0.1]"):
            body = _reg("r1")
            body["ranks"][0]["host"] = host
            r = c.post("/v1/runs", json=body, headers=_h(A))
            assert r.status_code == 422, host
            assert r.json()["detail"] == (f"ranks [0]: host must be a host name or an IP address (letters, digits, '-', "
                                          f"'_', '.'; IPv6 in brackets or bare), not {host!r}")
        assert c.get("/v1/runs", headers=_h(OP)).json() == []
        good = _reg("r1")
        good["world_size"] = 4
        good["ranks"] = [{"rank": i, "local_rank": i, "host": h, "port": 9100}
                         for i, h in enumerate(("node-1.cluster.local", "gpu_box", "fd00::7", "[fd00::8]"))]
        assert c.post("/v1/runs", json=good, headers=_h(A)).status_code == 200
        targets = [t["targets"][0] for t in c.get("/v1/sd/targets", headers=_h(OP)).json()]
        assert targets == ["node-1.cluster.local:9100", "gpu_box:9100", "[fd00::7]:9100", "[fd00::8]:9100"]


def _agent_answers(c: TestClient, token: str, run: str) -> dict[str, tuple[int, str]]:
    """Every agent route after registration for ``run`` with ``token``: status and detail, the
    run's name replaced (a detail naming the run asked for says nothing of it)."""
    h = _h(token)
    answers = {
        "report": c.post(f"/v1/runs/{run}/reports", json=_report(), headers=h),
        "desired": c.get(f"/v1/runs/{run}/desired", headers=h),
        "ack": c.post(f"/v1/runs/{run}/acks", json={"generation": 0, "step": 1}, headers=h),
        "preflight": c.post(f"/v1/runs/{run}/preflight", json={"seconds": 0.5, "checks": []}, headers=h),
        "memory-report": c.post(f"/v1/runs/{run}/memory-report", json={"step": 1, "steps": 1, "owners": []}, headers=h),
        "quarantine": c.post(f"/v1/runs/{run}/quarantine", json={"step": 1, "samples": []}, headers=h),
        "finish": c.post(f"/v1/runs/{run}/finish", json={"step": 1, "reason": "probe"}, headers=h),
    }
    return {k: (r.status_code, r.json()["detail"].replace(repr(run), "<run>")) for k, r in answers.items()}


def test_an_agent_token_is_answered_alike_for_another_tokens_run_and_a_run_that_does_not_exist(tmp_path) -> None:
    settings = Settings(db=str(tmp_path / "t.db"), operator_tokens=OP, agent_tokens=f"{A},{B},{C}:r2")
    with TestClient(create_app(settings)) as c:
        fleet = c.post("/v1/tokens", json={"scopes": ["agent"], "job": "*"}, headers=_h(OP)).json()["token"]
        other = c.post("/v1/tokens", json={"scopes": ["agent"], "job": "*"}, headers=_h(OP)).json()["token"]
        assert c.post("/v1/runs", json=_reg("r1"), headers=_h(A)).status_code == 200
        assert c.post("/v1/runs", json=_reg("r2"), headers=_h(C)).status_code == 200
        assert c.post("/v1/runs", json=_reg("r4"), headers=_h(other)).status_code == 200
        for token in (A, B, C, fleet):  # bound to r1, unbound, TOKEN:RUN, created at runtime
            missing = _agent_answers(c, token, "no-such-run")
            assert all(status in (403, 404) for status, _ in missing.values()), (token, missing)
            for run in {"r1", "r2", "r4"} - {{A: "r1", C: "r2"}.get(token, "")}:
                assert _agent_answers(c, token, run) == missing, (token, run)
        # the owners' runs are untouched: nothing was reported, acknowledged or finished
        for run in ("r1", "r2", "r4"):
            status = c.get(f"/v1/runs/{run}", headers=_h(OP)).json()
            assert status["status"] == "registered" and status["reports"] == 0 and status["finished_at"] is None
        # and B, answered 404 everywhere, registers a run of its own as its first
        assert c.post("/v1/runs", json=_reg("r5"), headers=_h(B)).status_code == 200

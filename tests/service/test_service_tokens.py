"""Tokens created at runtime: hashed, scoped, job-limited, expiring, revocable, audited; an agent
token registers any run of its jobs and each run stays with the token that registered it; the
environment's tokens keep working; all of it survives a restart."""

from __future__ import annotations

import hashlib
import sqlite3

from fastapi.testclient import TestClient

from tests.service.conftest import wait_until

from trainguard.service.app import create_app
from trainguard.service.config import Settings

OP, ENV_AGENT = "operator-token-0001", "env-agent-token-0001"


def _h(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _reg(c: TestClient, token: str, run: str, job: str) -> int:
    body = {"job": job, "run": run, "world_size": 1, "ranks": []}
    return c.post("/v1/runs", json=body, headers=_h(token)).status_code


def _report(c: TestClient, token: str, run: str, job: str, step: int = 1) -> int:
    body = {"job": job, "step_first": step, "step_last": step, "time": 1.0, "values": {"trainguard_loss": 1.0}}
    return c.post(f"/v1/runs/{run}/reports", json=body, headers=_h(token)).status_code


def test_fleet_tokens(tmp_path) -> None:
    now = [1_000.0]
    settings = Settings(db=tmp_path / "tg.db", operator_tokens=(OP, "reader-token-01:read"), agent_tokens=(ENV_AGENT,))
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        assert c.post("/v1/tokens", json={"scopes": ["agent"]}, headers=_h("reader-token-01")).status_code == 403
        r = c.post("/v1/tokens", json={"name": "llm fleet", "scopes": ["agent"], "job": "llm-7b*", "ttl_s": 3600}, headers=_h(OP))
        assert r.status_code == 201, r.text
        t1 = r.json()
        assert t1["expires_at"] == 4_600.0 and t1["job_pattern"] == "llm-7b*"
        t2 = c.post("/v1/tokens", json={"scopes": ["agent"], "job": "llm-7b*"}, headers=_h(OP)).json()
        tok1, tok2 = t1["token"], t2["token"]
        # any run of the matching jobs, not another job
        assert _reg(c, tok1, "llm-7b-a", "llm-7b") == 200
        assert _reg(c, tok1, "llm-7b-b", "llm-7b-sweep") == 200
        assert _reg(c, tok1, "gpt-x", "gpt") == 403
        assert _report(c, tok1, "llm-7b-a", "llm-7b") == 200 and _report(c, tok1, "llm-7b-b", "llm-7b-sweep") == 200
        # a run stays with the token that registered it
        assert _reg(c, tok2, "llm-7b-c", "llm-7b") == 200
        assert _report(c, tok1, "llm-7b-c", "llm-7b") == 404 and _reg(c, tok1, "llm-7b-c", "llm-7b") == 403
        assert _report(c, tok2, "llm-7b-a", "llm-7b") == 404  # (as for a run that does not exist)
        # nor can it take a run an environment token registered, and the environment token still works
        assert _reg(c, ENV_AGENT, "env-run", "llm-7b-env") == 200
        assert _reg(c, tok1, "env-run", "llm-7b-env") == 403
        assert _report(c, ENV_AGENT, "env-run", "llm-7b-env") == 200
        # listing: who, what, when; never the token or its hash
        listed = c.get("/v1/tokens", headers=_h(OP)).json()
        assert [t["id"] for t in listed] == [t1["id"], t2["id"]]
        assert listed[0]["creator"] == "operator:" + hashlib.sha256(OP.encode()).hexdigest()[:12]
        assert all(tok1 not in str(t) and "token_hash" not in t for t in listed)
        # revocation stops it at once
        assert c.delete(f"/v1/tokens/{t2['id']}", headers=_h(OP)).status_code == 200
        assert _report(c, tok2, "llm-7b-c", "llm-7b") == 401
        assert c.delete(f"/v1/tokens/{t2['id']}", headers=_h(OP)).status_code == 404
    rows = sqlite3.connect(tmp_path / "tg.db").execute("SELECT token_hash, revoked_by FROM tokens ORDER BY id").fetchall()
    assert rows[0][0] == hashlib.sha256(tok1.encode()).hexdigest() and rows[1][1].startswith("operator:")
    # after a restart: the live token works, ownership holds; past its expiry it does not
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        assert _report(c, tok1, "llm-7b-a", "llm-7b", step=2) == 200
        assert _report(c, tok2, "llm-7b-c", "llm-7b") == 401
        now[0] = 4_601.0
        assert _report(c, tok1, "llm-7b-a", "llm-7b", step=3) == 401


def test_token_requests_are_validated(app_factory) -> None:
    with app_factory(operator_tokens=(OP,)) as c:
        for body in ({"scopes": ["root"]}, {"scopes": ["agent", "read"]}, {"scopes": ["read"], "job": "x*"}, {"scopes": []},
                     {"scopes": ["agent"], "ttl_s": -1}, *({"scopes": ["agent"], "job": job} for job in (
                         "\x00", "a\nb", "[", "llm-[7b", "a b", "llm/7b", "job*\u202e"))):
            assert c.post("/v1/tokens", json=body, headers=_h(OP)).status_code == 422, body
        for job in ("llm-7b*", "job-[ab]?", "run-[!x]*", "*"):  # a job name's characters and the wildcards
            assert c.post("/v1/tokens", json={"scopes": ["agent"], "job": job}, headers=_h(OP)).status_code == 201, job
        r = c.post("/v1/tokens", json={"scopes": ["read"]}, headers=_h(OP)).json()
        assert c.get("/v1/runs", headers=_h(r["token"])).status_code == 200
        assert c.post("/v1/runs/x/pause", headers=_h(r["token"])).status_code == 403


def test_cli_creates_lists_and_revokes_tokens_against_a_served_controller(tmp_path, serve, capsys) -> None:
    import httpx

    from trainguard.cli import main

    srv = serve(tmp_path / "tg.db", env={"TRAINGUARD_OPERATOR_TOKENS": OP})
    common = ["--url", srv.url, "--token", OP]
    assert main(["token", "create", "--job", "llm-7b*", "--scope", "agent", "--ttl", "30d", "--name", "fleet", *common]) == 0
    out = capsys.readouterr().out.splitlines()
    token = out[1]
    assert out[0].startswith("token 1 (agent, jobs llm-7b*, expires ")
    with httpx.Client(base_url=srv.url, timeout=30, headers=_h(token)) as c:
        assert c.post("/v1/runs", json={"job": "llm-7b", "run": "r-1", "world_size": 1, "ranks": []}).status_code == 200
        created = c.get("/v1/tokens").status_code
    assert created == 403  # an agent token cannot manage tokens
    assert main(["token", "list", "--json", *common]) == 0
    rows = __import__("json").loads(capsys.readouterr().out)
    assert rows[0]["name"] == "fleet" and rows[0]["expires_at"] - rows[0]["created_at"] == 30 * 86400
    assert main(["token", "create", "--scope", "read", "--ttl", "0.001s", "--name", "brief", *common]) == 0
    capsys.readouterr()
    assert main(["token", "list", *common]) == 0
    states = {line.split()[1]: line.split()[-2] for line in capsys.readouterr().out.splitlines()[1:]}
    assert states == {"fleet": "live", "brief": "expired"}  # (an expired token read "live")
    assert main(["token", "revoke", "1", *common]) == 0
    capsys.readouterr()
    assert httpx.get(srv.url + "/v1/runs/r-1/desired", headers=_h(token)).status_code == 401


def _runtime_token(c, scopes: list[str]) -> dict:
    r = c.post("/v1/tokens", json={"scopes": scopes}, headers=_h(OP))
    assert r.status_code == 201, r.text
    return r.json()


def test_revoking_a_token_ends_its_open_event_stream_before_the_next_event(tmp_path, serve) -> None:
    import threading

    import httpx

    srv = serve(tmp_path / "tg.db", env={"TRAINGUARD_OPERATOR_TOKENS": OP, "TRAINGUARD_AGENT_TOKENS": ENV_AGENT})
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert _reg(c, ENV_AGENT, "run-1", "job-a") == 200
        made = _runtime_token(c, ["read"])
        lines: list[str] = []
        opened = threading.Event()

        def read() -> None:
            with httpx.stream("GET", srv.url + "/v1/events/stream?after=1000000", headers=_h(made["token"]), timeout=60) as s:
                for line in s.iter_lines():
                    lines.append(line)
                    opened.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert opened.wait(60) and lines[0] == "retry: 2000"
        assert c.delete(f"/v1/tokens/{made['id']}", headers=_h(OP)).status_code == 200
        assert c.post("/v1/runs/run-1/checkpoint", json={"reason": "after the revocation"}, headers=_h(OP)).status_code == 200
        reader.join(60)  # (a guard: a stream that never ends fails the test instead of hanging it)
        assert not reader.is_alive(), f"the revoked token's stream is still open: {lines}"
        assert not any("after the revocation" in line for line in lines)
        assert c.get("/v1/events/stream", headers=_h(made["token"])).status_code == 401


def test_a_long_poll_whose_token_is_revoked_while_it_waits_answers_401(tmp_path, serve) -> None:
    import threading

    import httpx

    srv = serve(tmp_path / "tg.db", env={"TRAINGUARD_OPERATOR_TOKENS": OP, "TRAINGUARD_AGENT_TOKENS": ENV_AGENT})
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert _reg(c, ENV_AGENT, "run-1", "job-a") == 200
        made = _runtime_token(c, ["read"])
        answers: list[httpx.Response] = []
        poll = threading.Thread(target=lambda: answers.append(httpx.get(
            srv.url + "/v1/runs/run-1/desired?after=0&wait=60", headers=_h(made["token"]), timeout=90)), daemon=True)
        poll.start()
        waiting = "trainguard_controller_longpoll_waiters 1.0"
        wait_until(lambda: waiting in httpx.get(srv.url + "/metrics").text)
        assert c.delete(f"/v1/tokens/{made['id']}", headers=_h(OP)).status_code == 200
        assert c.post("/v1/runs/run-1/pause", json={"reason": "wakes the poll"}, headers=_h(OP)).status_code == 200
        poll.join(90)
        assert [a.status_code for a in answers] == [401]
        assert answers[0].json()["detail"] == "the bearer token was revoked or expired"
        assert "paused" not in answers[0].text


def test_live_runtime_tokens_are_bounded_per_creator_and_in_all(tmp_path, monkeypatch) -> None:
    from trainguard.service import token_service

    now = [1_000.0]
    other = "other-operator-0001"
    settings = Settings(db=tmp_path / "tg.db", operator_tokens=(OP, other))
    with TestClient(create_app(settings, clock=lambda: now[0])) as c:
        made = [c.post("/v1/tokens", json={"scopes": ["read"], "ttl_s": 60 if i < 10 else None}, headers=_h(OP))
                for i in range(1000)]
        assert {r.status_code for r in made} == {201}
        r = c.post("/v1/tokens", json={"scopes": ["read"]}, headers=_h(OP))
        assert r.status_code == 429
        assert r.json()["detail"] == ("this token has created 1000 live tokens, the limit: revoke some "
                                      "(DELETE /v1/tokens/{id}) or let them expire")
        assert c.post("/v1/tokens", json={"scopes": ["read"]}, headers=_h(other)).status_code == 201  # not another's
        now[0] = 1_060.0  # the first ten expire: their places are free, and they are forgotten
        assert [c.post("/v1/tokens", json={"scopes": ["read"]}, headers=_h(OP)).status_code for _ in range(11)] == [201] * 10 + [429]
        assert c.delete(f"/v1/tokens/{made[500].json()['id']}", headers=_h(OP)).status_code == 200
        assert c.post("/v1/tokens", json={"scopes": ["read"]}, headers=_h(OP)).status_code == 201
        assert len(c.app.state.tokens._stored) == 1001  # (the expired ones are no longer held)
        monkeypatch.setattr(token_service, "MAX_LIVE_TOKENS", 1001)
        r = c.post("/v1/tokens", json={"scopes": ["read"]}, headers=_h(other))
        assert r.status_code == 429
        assert r.json()["detail"] == ("1001 runtime tokens are live, the limit: revoke some (DELETE /v1/tokens/{id}) "
                                      "or let them expire")

"""Who may create, list and revoke tokens: a token grants no scope it lacks and cannot outlive
its creator; a ``tokens`` holder lists and revokes the tokens it created, an administrator (every
operator scope) all of them; a token name is printable text; listings never show a token or its
hash."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from fastapi.testclient import TestClient

ADMIN, MINTER, READER = "admin-token-0001", "minter-token-01", "reader-token-01"
TOKENS = {"operator_tokens": (ADMIN, f"{MINTER}:tokens", f"{READER}:read")}


def _h(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _create(c: TestClient, token: str, **body: Any) -> Any:
    return c.post("/v1/tokens", json=body, headers=_h(token))


def _actor(token: str) -> str:
    return "operator:" + hashlib.sha256(token.encode()).hexdigest()[:12]


def test_a_token_only_grants_scopes_it_holds(app_factory) -> None:
    with app_factory(**TOKENS) as c:
        r = _create(c, MINTER, scopes=["read", "command", "rules", "webhooks", "tokens"])
        assert r.status_code == 403
        assert r.json()["detail"] == ("a token can only grant scopes it holds itself: this one lacks command, read, rules, "
                                      "webhooks (it holds tokens)")
        assert c.get("/v1/tokens", headers=_h(ADMIN)).json() == []  # nothing was created
        # the agent scope: an agent token acts only for the runs it registers, any tokens holder may grant it
        assert _create(c, MINTER, scopes=["agent"], job="llm*").status_code == 201
        # a runtime read+tokens token cannot mint command or rules
        delegate = _create(c, ADMIN, scopes=["read", "tokens"], ttl_s=3600).json()["token"]
        r = _create(c, delegate, scopes=["command", "rules"], ttl_s=60)
        assert r.status_code == 403 and "lacks command, rules" in r.json()["detail"]
        child = _create(c, delegate, scopes=["read"], ttl_s=60)
        assert child.status_code == 201 and child.json()["scopes"] == ["read"]
        assert c.post("/v1/runs/x/pause", json={}, headers=_h(child.json()["token"])).status_code == 403


def test_a_token_cannot_outlive_its_creator(app_factory) -> None:
    now = [1_000.0]
    with app_factory(clock=lambda: now[0], **TOKENS) as c:
        delegate = _create(c, ADMIN, scopes=["read", "tokens"], ttl_s=3600).json()["token"]
        for body in ({"scopes": ["read"]}, {"scopes": ["read"], "ttl_s": 3601}):
            r = _create(c, delegate, **body)
            assert r.status_code == 403, body
            assert r.json()["detail"] == ("a token cannot outlive the token that creates it: this one expires at 4600 "
                                          "(give a ttl_s that ends by then)")
        assert _create(c, delegate, scopes=["read"], ttl_s=3600).json()["expires_at"] == 4_600.0


def test_a_tokens_holder_lists_and_revokes_only_the_tokens_it_created(app_factory) -> None:
    with app_factory(**TOKENS) as c:
        by_admin = _create(c, ADMIN, name="dashboards", scopes=["read"]).json()
        by_minter = _create(c, MINTER, name="fleet", scopes=["agent"], job="llm*").json()
        other_minter = _create(c, ADMIN, scopes=["tokens"]).json()
        by_other = _create(c, other_minter["token"], name="other fleet", scopes=["agent"]).json()
        # listing: the minter sees its own; the administrator sees all; never a token nor a hash
        mine = c.get("/v1/tokens", headers=_h(MINTER)).json()
        assert [t["id"] for t in mine] == [by_minter["id"]] and mine[0]["creator"] == _actor(MINTER)
        everything = c.get("/v1/tokens", headers=_h(ADMIN)).json()
        assert [t["id"] for t in everything] == [by_admin["id"], by_minter["id"], other_minter["id"], by_other["id"]]
        secrets = [t["token"] for t in (by_admin, by_minter, other_minter, by_other)]
        secrets += [hashlib.sha256(t.encode()).hexdigest() for t in secrets[:]]  # (the creator's 12-digit actor name is shown)
        listed = str(everything)
        assert not any(s in listed for s in secrets)
        assert all("token_hash" not in t and "token" not in t for t in everything)
        # revocation: another creator's live token answers as a revoked or a missing id does (404,
        # nothing about it), and stays live; its own yes; the administrator any
        revoked = _create(c, ADMIN, scopes=["read"]).json()
        assert c.delete(f"/v1/tokens/{revoked['id']}", headers=_h(ADMIN)).status_code == 200
        missing = revoked["id"] + 1
        for token_id in (by_admin["id"], by_other["id"], revoked["id"], missing):
            r = c.delete(f"/v1/tokens/{token_id}", headers=_h(MINTER))
            assert (r.status_code, r.json()["detail"]) == (404, f"no live token with id {token_id} among the tokens this "
                                                                "token created (a token with every operator scope may revoke any)")
        assert c.get("/v1/runs", headers=_h(by_admin["token"])).status_code == 200
        assert c.get("/v1/runs", headers=_h(by_other["token"])).status_code == 403  # a live agent token (401 once revoked)
        assert c.delete(f"/v1/tokens/{by_minter['id']}", headers=_h(MINTER)).status_code == 200
        assert c.delete(f"/v1/tokens/{by_minter['id']}", headers=_h(MINTER)).status_code == 404
        assert c.delete(f"/v1/tokens/{by_other['id']}", headers=_h(ADMIN)).status_code == 200
        assert c.delete(f"/v1/tokens/{by_admin['id']}", headers=_h(ADMIN)).status_code == 200
        assert c.get("/v1/runs", headers=_h(by_admin["token"])).status_code == 401
        assert c.delete(f"/v1/tokens/{missing}", headers=_h(ADMIN)).json()["detail"] == f"no live token with id {missing}"
        assert c.get("/v1/tokens", headers=_h(READER)).status_code == 403


def test_a_token_name_with_control_characters_is_refused_and_names_are_logged_escaped(app_factory, caplog) -> None:
    with app_factory(**TOKENS) as c:
        for name in ("a\r\nforged log line", "nul\x00byte", "tab\tname", "esc\x1b[31m"):
            r = _create(c, ADMIN, name=name, scopes=["read"])
            assert r.status_code == 422, name
            assert "a token name must be printable text" in r.text
        assert c.get("/v1/tokens", headers=_h(ADMIN)).json() == []
        name = "ops \u00e9quipe, it's \"quoted\""
        with caplog.at_level(logging.WARNING, logger="trainguard.controller"):
            assert _create(c, ADMIN, name=name, scopes=["read"]).status_code == 201
        assert any(f"({name!r}, scopes read," in m for m in caplog.messages), caplog.messages

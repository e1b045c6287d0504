"""The statements of the runtime tokens' table (``tokens``): created, listed, counted and revoked by
:mod:`service.token_service` and the tokens routes, through a store's connection (SQLite or
PostgreSQL through its dialect), as :mod:`service.statements` is for the other tables."""

from __future__ import annotations

import sqlite3
from typing import Any

_TOKEN_COLUMNS = "id, name, scopes, job_pattern, creator, created_at, expires_at, revoked_at, revoked_by"


def insert_token(conn: sqlite3.Connection, *, token_hash: str, name: str, scopes: list[str], job_pattern: str | None,
                 creator: str, now: float, expires_at: float | None) -> int:
    cur = conn.execute(
        "INSERT INTO tokens (token_hash, name, scopes, job_pattern, creator, created_at, expires_at) VALUES (?,?,?,?,?,?,?)",
        (token_hash, name, "+".join(sorted(scopes)), job_pattern, creator, now, expires_at))
    return int(cur.lastrowid)


def _token_row(r: sqlite3.Row) -> dict[str, Any]:
    return dict(r) | {"scopes": r["scopes"].split("+")}


def list_tokens(conn: sqlite3.Connection) -> list[dict[str, Any]]:
    return [_token_row(r) for r in conn.execute(f"SELECT {_TOKEN_COLUMNS} FROM tokens ORDER BY id")]


def active_tokens(conn: sqlite3.Connection, now: float) -> list[dict[str, Any]]:
    rows = conn.execute(f"SELECT token_hash, {_TOKEN_COLUMNS} FROM tokens WHERE revoked_at IS NULL "
                        "AND (expires_at IS NULL OR expires_at > ?)", (now,))
    return [_token_row(r) for r in rows]


def live_token_counts(conn: sqlite3.Connection, creator: str, now: float) -> tuple[int, int]:
    """Live (neither revoked nor expired) runtime tokens: in all, and those ``creator`` created."""
    row = conn.execute("SELECT COUNT(*), COALESCE(SUM(CASE WHEN creator=? THEN 1 ELSE 0 END), 0) FROM tokens "
                       "WHERE revoked_at IS NULL AND (expires_at IS NULL OR expires_at > ?)", (creator, now)).fetchone()
    return int(row[0]), int(row[1])


def live_token_creator(conn: sqlite3.Connection, token_id: int) -> str | None:
    """Who created live (not revoked) token ``token_id``, or ``None`` when there is no such token."""
    row = conn.execute("SELECT creator FROM tokens WHERE id=? AND revoked_at IS NULL", (token_id,)).fetchone()
    return None if row is None else str(row[0])


def revoke_token(conn: sqlite3.Connection, token_id: int, *, actor: str, now: float) -> str | None:
    """Revoke token ``token_id``; its hash, or ``None`` when there is no such live token."""
    row = conn.execute("SELECT token_hash FROM tokens WHERE id=? AND revoked_at IS NULL", (token_id,)).fetchone()
    if row is None:
        return None
    conn.execute("UPDATE tokens SET revoked_at=?, revoked_by=? WHERE id=?", (now, actor, token_id))
    return str(row[0])

"""Tokens created at runtime (``POST /v1/tokens``, ``DELETE /v1/tokens/{id}``): stored as their
SHA-256 digests, admitted into the app's :class:`~service.auth.TokenTable` at once and at start-up."""

from __future__ import annotations

import logging
import secrets
import sqlite3
from typing import Any, Callable

from trainguard.service import token_statements
from trainguard.service.auth import Principal, TokenTable, is_administrator, manages_token, may_grant, token_hash
from trainguard.service.errors import Forbidden, NotFound, TooMany
from trainguard.service.store import Store

__all__ = ["RuntimeTokens", "MAX_LIVE_TOKENS", "MAX_LIVE_TOKENS_PER_CREATOR"]

#: Live (neither revoked nor expired) runtime tokens, at most: in all, and created by one token.
MAX_LIVE_TOKENS = 10_000
MAX_LIVE_TOKENS_PER_CREATOR = 1_000

log = logging.getLogger("trainguard.controller")


class RuntimeTokens:
    """Creates and revokes tokens; ``tokens`` is the app's table (set by the app)."""

    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self.store = store
        self.clock = clock
        #: The app's token table (tokens created at runtime are added to it).
        self.tokens = TokenTable((), ())

    async def create(self, *, name: str, scopes: frozenset[str], job_pattern: str | None, ttl_s: float | None,
                     creator: Principal) -> dict[str, Any]:
        """A new token (shown once in the answer), stored as its SHA-256 digest and admitted at once;
        403 when it would grant more than ``creator`` holds (:func:`service.auth.may_grant`), 429
        when ``creator`` has ``MAX_LIVE_TOKENS_PER_CREATOR`` live ones or all hold ``MAX_LIVE_TOKENS``."""
        now = self.clock()
        expires = None if ttl_s is None else now + ttl_s
        refused = may_grant(creator, scopes, expires)
        if refused is not None:
            raise Forbidden(refused)
        token = "tg_" + secrets.token_urlsafe(32)
        digest = token_hash(token)
        actor = creator.actor

        def op(c: sqlite3.Connection) -> int | str:
            live, own = token_statements.live_token_counts(c, actor, now)
            if own >= MAX_LIVE_TOKENS_PER_CREATOR:
                return (f"this token has created {own} live tokens, the limit: revoke some "
                        "(DELETE /v1/tokens/{id}) or let them expire")
            if live >= MAX_LIVE_TOKENS:
                return f"{live} runtime tokens are live, the limit: revoke some (DELETE /v1/tokens/{{id}}) or let them expire"
            return token_statements.insert_token(c, token_hash=digest, name=name, scopes=sorted(scopes), job_pattern=job_pattern,
                                    creator=actor, now=now, expires_at=expires)

        tid = await self.store.submit(op)
        if isinstance(tid, str):
            raise TooMany(tid)
        self.tokens.drop_expired()
        self.tokens.add_stored(digest, scopes, job_pattern=job_pattern, expires_at=expires)
        log.warning("token %d (%r, scopes %s, jobs %r) created by %s", tid, name, "+".join(sorted(scopes)), job_pattern, actor)
        return {"id": tid, "token": token, "name": name, "scopes": sorted(scopes), "job_pattern": job_pattern,
                "creator": actor, "created_at": now, "expires_at": expires}

    async def revoke(self, token_id: int, principal: Principal) -> dict[str, Any]:
        """Revoke a live token that ``principal`` manages (:func:`service.auth.manages_token`): 404
        otherwise, the same answer for another creator's live token as for a revoked or missing one,
        so a ``tokens`` holder learns nothing of the tokens it cannot list. It stops authenticating
        at once, and the console sessions signed in with it end on their next request."""
        now = self.clock()
        actor = principal.actor

        def op(c: sqlite3.Connection) -> str | None:
            creator = token_statements.live_token_creator(c, token_id)
            if creator is None or not manages_token(principal, creator):
                return None
            return token_statements.revoke_token(c, token_id, actor=actor, now=now)

        digest = await self.store.submit(op)
        if digest is None:
            if is_administrator(principal):
                raise NotFound(f"no live token with id {token_id}")
            raise NotFound(f"no live token with id {token_id} among the tokens this token created "
                           "(a token with every operator scope may revoke any)")
        self.tokens.remove_stored(digest)
        log.warning("token %d revoked by %s", token_id, actor)
        return {"id": token_id, "revoked_at": now, "revoked_by": actor}

    def load(self) -> None:
        """Admit the stored live tokens (at start-up)."""
        for row in self.store.read_now(lambda c: token_statements.active_tokens(c, self.clock())):
            self.tokens.add_stored(row["token_hash"], frozenset(row["scopes"]), job_pattern=row["job_pattern"],
                                   expires_at=row["expires_at"])

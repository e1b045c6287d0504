"""Tokens created at runtime: create (shown once), list, revoke. Needs the ``tokens`` scope, and
grants no more than the caller holds (:func:`service.auth.may_grant`); a caller lists and revokes
the tokens it created, an administrator (every operator scope) all of them
(:func:`service.auth.manages_token`)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainguard.service import token_statements
from trainguard.service.auth import AGENT_SCOPE, OPERATOR_SCOPES, manages_token
from trainguard.service.deps import ControllerDep, TokensDep
from trainguard.protocol.base import not_printable
from trainguard.protocol.wire import MAX_INT

__all__ = ["router", "TokenCreate"]

router = APIRouter(prefix="/v1", tags=["tokens"])
_JOB_PATTERN = re.compile(r"[A-Za-z0-9._:*?\[\]!-]+")


def _brackets_closed(pattern: str) -> bool:
    """Whether every ``[`` of a shell-style pattern is closed by a later ``]`` (an unclosed one
    would stand for itself, which no job name holds)."""
    depth = 0
    for ch in pattern:
        if ch == "[":
            if depth:
                return False
            depth = 1
        elif ch == "]" and depth:
            depth = 0
    return depth == 0
TokenId = Annotated[int, Path(ge=1, le=MAX_INT)]


class TokenCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="", max_length=200, description="What the token is for (shown in listings and logs).")
    scopes: list[str] = Field(min_length=1, max_length=8, description=f"'{AGENT_SCOPE}' alone, or operator scopes "
                              f"({', '.join(sorted(OPERATOR_SCOPES))}).")
    job: str | None = Field(default=None, min_length=1, max_length=128,
                            description="Agent tokens: the jobs whose runs it may register, a shell-style pattern "
                            "('llm-7b*'); default every job.")
    ttl_s: float | None = Field(default=None, gt=0, le=10 * 365 * 86400, description="Lifetime in seconds; default none.")

    @field_validator("name")
    @classmethod
    def _printable(cls, name: str) -> str:
        bad = not_printable(name)
        if bad:
            raise ValueError(f"a token name must be printable text (it is logged and listed): it contains {', '.join(bad)}")
        return name

    @field_validator("job")
    @classmethod
    def _job_pattern(cls, job: str | None) -> str | None:
        # A job name's characters and the pattern's own (* ? [ ] !): anything else never matches a job.
        if job is not None and (not _JOB_PATTERN.fullmatch(job) or not _brackets_closed(job)):
            raise ValueError("a job pattern holds a job name's characters (letters, digits, '.', '_', ':', '-') and "
                             f"the wildcards * ? [...] [!...] only, each '[' closed: {job[:80]!r}")
        return job

    @field_validator("scopes")
    @classmethod
    def _known(cls, scopes: list[str]) -> list[str]:
        unknown = set(scopes) - OPERATOR_SCOPES - {AGENT_SCOPE}
        if unknown:
            raise ValueError(f"unknown scope(s) {sorted(unknown)}; known: {sorted(OPERATOR_SCOPES | {AGENT_SCOPE})}")
        if AGENT_SCOPE in scopes and len(set(scopes)) > 1:
            raise ValueError("an agent token has the agent scope only")
        return sorted(set(scopes))


@router.post("/tokens", status_code=201, summary="Create a token (the answer shows it once; only its hash is kept)")
async def create(body: TokenCreate, ctl: ControllerDep, principal: TokensDep) -> dict[str, Any]:
    if body.job is not None and AGENT_SCOPE not in body.scopes:
        raise HTTPException(422, "a job pattern applies to agent tokens only")
    return await ctl.create_token(name=body.name, scopes=frozenset(body.scopes), job_pattern=body.job, ttl_s=body.ttl_s,
                                  creator=principal)


@router.get("/tokens", summary="Tokens created at runtime (never the tokens themselves nor their hashes): scopes, jobs, "
            "creator, expiry, revocation; an administrator sees all, any other caller the ones it created")
async def list_tokens(ctl: ControllerDep, principal: TokensDep) -> list[dict[str, Any]]:
    rows = await ctl.store.read(token_statements.list_tokens)
    return [r for r in rows if manages_token(principal, r["creator"])]


@router.delete("/tokens/{token_id}", summary="Revoke a token (it stops working at once, its console sessions too): "
               "one this caller created, or any for an administrator; 404 for any other id")
async def revoke(token_id: TokenId, ctl: ControllerDep, principal: TokensDep) -> dict[str, Any]:
    return await ctl.revoke_token(token_id, principal)

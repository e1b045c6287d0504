"""``Annotated`` dependencies shared by the routers: the controller and the caller's scopes."""

from __future__ import annotations

from typing import Annotated, Awaitable, Callable

from fastapi import Depends, HTTPException, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from trainguard.service.auth import AGENT_SCOPE, Principal, TokenTable
from trainguard.service.controller import Controller
from trainguard.service.limits import PRINCIPAL_KEY

__all__ = ["scope_dep", "ControllerDep", "AgentDep", "ReadDep", "CommandDep", "RulesDep", "WebhooksDep", "PollDep", "TokensDep"]


async def get_controller(request: Request) -> Controller:
    return request.app.state.controller


#: The bearer token scheme of the OpenAPI document (``auto_error=False``: the checks are below).
BEARER = HTTPBearer(auto_error=False, scheme_name="bearer", description="A token from TRAINGUARD_OPERATOR_TOKENS, "
                    "TRAINGUARD_AGENT_TOKENS or POST /v1/tokens; an operation's scopes are the ones it admits (any of them).")


def _require(*scopes: str) -> Callable[[Request], Awaitable[Principal]]:
    """A dependency admitting callers holding any of ``scopes`` (async: runs on the event loop)."""

    async def dep(request: Request, _: HTTPAuthorizationCredentials | None = Security(BEARER, scopes=list(scopes))) -> Principal:
        # (``BEARER`` only documents the scheme and the scopes in the OpenAPI document: it never refuses)
        tokens: TokenTable = request.app.state.tokens
        principal = request.scope.get(PRINCIPAL_KEY) or tokens.authenticate(request.headers.get("authorization"))
        if principal is None:
            raise HTTPException(401, "missing or unknown bearer token (send 'Authorization: Bearer <token>')",
                                headers={"WWW-Authenticate": "Bearer"})
        if not principal.scopes.intersection(scopes):
            raise HTTPException(403, f"this {principal.kind} token lacks the scope for this endpoint (needs one of: {', '.join(scopes)})")
        return principal

    return dep


def scope_dep(scope: str) -> object:
    """The ``Annotated`` dependency admitting callers that hold ``scope`` (a command's ``scope``)."""
    return Annotated[Principal, Depends(_require(scope))]


ControllerDep = Annotated[Controller, Depends(get_controller)]
AgentDep = Annotated[Principal, Depends(_require(AGENT_SCOPE))]
PollDep = Annotated[Principal, Depends(_require(AGENT_SCOPE, "read"))]
ReadDep = Annotated[Principal, Depends(_require("read"))]
CommandDep = Annotated[Principal, Depends(_require("command"))]
RulesDep = Annotated[Principal, Depends(_require("rules"))]
WebhooksDep = Annotated[Principal, Depends(_require("webhooks"))]
TokensDep = Annotated[Principal, Depends(_require("tokens"))]

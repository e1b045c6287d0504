"""Bearer tokens: parsed from settings, kept only as SHA-256 digests, compared in constant time.

Operator entries are ``TOKEN`` (every operator scope) or ``TOKEN:scope+scope`` with scopes from
``read``, ``command``, ``rules``, ``webhooks`` (e.g. ``dashboards-token:read``). Agent entries are
``TOKEN`` — bound to the first run it registers (the binding is stored and survives restarts) —
or ``TOKEN:RUN``, bound to ``RUN`` from the start. Tokens may not contain ``:`` or ``,``.

Tokens created at runtime (``POST /v1/tokens``, :meth:`TokenTable.add_stored`) carry their own
scopes, an expiry, and for agent tokens a job pattern (``fnmatch``, e.g. ``llm-7b*``): such a
token may register any run of a matching job, and a run it registered stays its own.

Who may create and revoke such tokens (the ``tokens`` scope, within limits) is
:func:`may_grant` and :func:`manages_token`; docs/security.md has the whole model.

Missing, unknown, expired or revoked token: 401. Known token without the scope, or an agent token bound to another
run: 403; an agent token on a run it never registered: 404, as for a run nobody registered
(:meth:`service.run_owners.RunOwners.check_agent`). With no token configured at all (loopback only, see :mod:`service.config`) every request
is allowed as the anonymous operator-and-agent.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["OPERATOR_SCOPES", "AGENT_SCOPE", "Principal", "TokenTable", "token_hash", "may_grant", "manages_token",
           "is_administrator"]

OPERATOR_SCOPES: frozenset[str] = frozenset({"read", "command", "rules", "webhooks", "tokens"})
AGENT_SCOPE = "agent"
_MIN_TOKEN = 8


def authorization_header(scope: dict) -> str | None:
    """The ``Authorization`` header of an ASGI ``scope`` (the first one), or None."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling."""

    kind: str
    """"operator", "agent" or "anonymous" (no tokens configured)."""
    scopes: frozenset[str]
    token_id: str
    """First 12 hex digits of the token's SHA-256: names the caller in the audit log."""
    token_digest: str = ""
    bound_run: str | None = None
    """For agent tokens of the ``TOKEN:RUN`` form."""
    job_pattern: str | None = None
    """For agent tokens created at runtime: the jobs whose runs it may register (``fnmatch``)."""
    expires_at: float | None = None

    @property
    def actor(self) -> str:
        return f"{self.kind}:{self.token_id}" if self.token_id else self.kind


ANONYMOUS = Principal("anonymous", OPERATOR_SCOPES | {AGENT_SCOPE}, "")


def is_administrator(principal: Principal) -> bool:
    """Whether ``principal`` holds every operator scope (an environment token without a scope
    list, a runtime token created with all of them, or the anonymous caller)."""
    return principal.kind != "agent" and OPERATOR_SCOPES <= principal.scopes


def may_grant(principal: Principal, scopes: frozenset[str], expires_at: float | None) -> str | None:
    """Why ``principal`` may not create a token with ``scopes`` expiring at ``expires_at``, or
    ``None`` when it may. A token grants at most what its creator holds: operator scopes only
    from the creator's own, and no longer than the creator lives. The agent scope (an agent
    token, bound to the runs it registers and never to another token's) may be granted by any
    ``tokens`` holder."""
    if "tokens" not in principal.scopes:
        return "creating tokens needs the 'tokens' scope"
    missing = sorted((scopes - {AGENT_SCOPE}) - principal.scopes)
    if missing:
        return (f"a token can only grant scopes it holds itself: this one lacks {', '.join(missing)} "
                f"(it holds {', '.join(sorted(principal.scopes))})")
    if principal.expires_at is not None and (expires_at is None or expires_at > principal.expires_at):
        return (f"a token cannot outlive the token that creates it: this one expires at {principal.expires_at:.0f} "
                "(give a ttl_s that ends by then)")
    return None


def manages_token(principal: Principal, creator: str) -> bool:
    """Whether ``principal`` lists and revokes a runtime token created by ``creator`` (an actor
    name): a ``tokens`` holder the tokens it created, an administrator (every operator scope) any.
    A token it does not manage is one it cannot tell from a token that does not exist."""
    return is_administrator(principal) or creator == principal.actor


class TokenTable:
    """The configured tokens, by digest."""

    def __init__(self, operator_entries: tuple[str, ...], agent_entries: tuple[str, ...],
                 clock: Callable[[], float] = time.time) -> None:
        self._by_digest: dict[bytes, Principal] = {}
        #: Tokens created at runtime, by digest (looked up, not compared one by one: a dict probe
        #: on a SHA-256 digest reveals nothing about the token).
        self._stored: dict[bytes, Principal] = {}
        self._clock = clock
        for entry in operator_entries:
            token, _, scopes_text = entry.partition(":")
            scopes = frozenset(s for s in scopes_text.split("+") if s) if scopes_text else OPERATOR_SCOPES
            unknown = scopes - OPERATOR_SCOPES
            if unknown:
                raise ValueError(f"operator token scope(s) {sorted(unknown)} unknown; known: {sorted(OPERATOR_SCOPES)}")
            self._add(token, Principal("operator", scopes, "", ""))
        for entry in agent_entries:
            token, _, run = entry.partition(":")
            self._add(token, Principal("agent", frozenset({AGENT_SCOPE}), "", "", run or None))
        self.enabled = bool(self._by_digest)
        #: Runs named by ``TOKEN:RUN`` entries: no other agent token may claim them.
        self.reserved_runs: frozenset[str] = frozenset(
            p.bound_run for p in self._by_digest.values() if p.bound_run is not None)

    def _add(self, token: str, template: Principal) -> None:
        if len(token) < _MIN_TOKEN:
            raise ValueError(f"tokens must be at least {_MIN_TOKEN} characters (one is {len(token)})")
        digest = hashlib.sha256(token.encode()).digest()
        if digest in self._by_digest:
            raise ValueError("the same token is configured twice")
        self._by_digest[digest] = Principal(
            template.kind, template.scopes, digest.hex()[:12], digest.hex(), template.bound_run
        )

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal of an ``Authorization`` header, ``None`` when missing or unknown."""
        if not self.enabled:
            return ANONYMOUS
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        found = None
        # Constant time with respect to the token: compare against every digest.
        for known, principal in self._by_digest.items():
            if hmac.compare_digest(known, digest):
                found = principal
        if found is None:
            found = self._stored.get(digest)
            if found is not None and found.expires_at is not None and found.expires_at <= self._clock():
                return None
        return found

    def add_stored(self, token_hash: str, scopes: frozenset[str], *, job_pattern: str | None,
                   expires_at: float | None) -> Principal:
        """Admit a token created at runtime (by its hex digest); agent scope makes it an agent."""
        digest = bytes.fromhex(token_hash)
        kind = "agent" if AGENT_SCOPE in scopes else "operator"
        p = Principal(kind, scopes, token_hash[:12], token_hash, None,
                      (job_pattern or "*") if kind == "agent" else None, expires_at)
        self._stored[digest] = p
        return p

    def is_live(self, principal: Principal) -> bool:
        """Whether ``principal``'s token still authenticates (not revoked, not expired): what a
        console session signed in with it checks on every request."""
        if not self.enabled or principal is ANONYMOUS:
            return True
        if not principal.token_digest:
            return False
        digest = bytes.fromhex(principal.token_digest)
        if digest in self._by_digest:
            return True
        stored = self._stored.get(digest)
        return stored is not None and (stored.expires_at is None or stored.expires_at > self._clock())

    def drop_expired(self) -> None:
        """Forget the runtime tokens that expired (they no longer authenticate)."""
        now = self._clock()
        for digest in [d for d, p in self._stored.items() if p.expires_at is not None and p.expires_at <= now]:
            del self._stored[digest]

    def remove_stored(self, token_hash: str) -> None:
        self._stored.pop(bytes.fromhex(token_hash), None)

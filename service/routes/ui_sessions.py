"""The console's sessions (``service/routes/ui.py``): sign-in sessions bound to the token they
signed in with, the failed sign-ins' rate limit, the Origin check of state-changing requests, and
the FastAPI dependencies that authorise a console request (session, scope, CSRF token).

A session expires ``_SESSION_TTL_S`` after sign-in; one token holds at most
``_SESSIONS_PER_TOKEN`` (a sign-in beyond that ends the same token's oldest, never another
token's); live-update streams are counted per session and in all.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Awaitable, Callable
from urllib.parse import urlsplit

from fastapi import Depends, HTTPException, Request, Response

from trainguard.service.auth import Principal
from trainguard.service.errors import TooMany
from trainguard.service.slots import release_once

__all__ = ["COOKIE", "CSRF_HEADER", "Session", "ConsoleSessions", "LoginLimiter", "ReadSession", "AnySession"]

COOKIE = "trainguard_session"
CSRF_HEADER = "X-CSRF-Token"
_SESSION_TTL_S = 12 * 3600.0
_MAX_SESSIONS = 1024
#: Sessions one token may hold at once (one per browser or tab that signed in with it).
_SESSIONS_PER_TOKEN = 16
#: Live-update streams one session may hold (a page holds one), and all sessions together.
_STREAMS_PER_SESSION = 6
_STREAMS_TOTAL = 64
#: Failed sign-ins: a burst of this many per client address, then one per this many seconds;
#: and in all (every address together).
_LOGIN_BURST, _LOGIN_REFILL_S = 10, 6.0
_LOGIN_BURST_TOTAL, _LOGIN_REFILL_TOTAL_S = 100, 1.0
_LOGIN_ADDRESSES = 4096


@dataclass(slots=True)
class Session:
    principal: Principal
    csrf: str
    expires: float
    streams: int = 0
    """Live-update streams open under this session."""


class ConsoleSessions:
    """Signed-in browsers: session id -> principal and CSRF token.

    A session expires ``ttl_s`` after sign-in. At most ``per_token`` sessions per token: a
    sign-in beyond that ends that token's oldest session. In all at most ``capacity``: a sign-in
    beyond that ends the token's own oldest session if it has one, else an expired one, else it
    is refused (:class:`TooMany`) - it never ends another token's live session. Streams are
    counted per session (``streams_per_session``) and in all (``streams_total``)."""

    def __init__(self, *, ttl_s: float = _SESSION_TTL_S, capacity: int = _MAX_SESSIONS, per_token: int = _SESSIONS_PER_TOKEN,
                 streams_per_session: int = _STREAMS_PER_SESSION, streams_total: int = _STREAMS_TOTAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or min(capacity, per_token, streams_per_session, streams_total) < 1:
            raise ValueError("ttl_s must be > 0, and capacity, per_token and the stream limits >= 1")
        self.ttl_s, self.capacity, self.per_token, self.clock = ttl_s, capacity, per_token, clock
        self.streams_per_session, self.streams_total = streams_per_session, streams_total
        self.streams = 0
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        #: Each token's sessions (by digest; the anonymous caller by its actor), oldest first.
        self._by_token: dict[str, OrderedDict[str, None]] = {}

    @staticmethod
    def _key(principal: Principal) -> str:
        return principal.token_digest or principal.actor

    def open(self, principal: Principal) -> tuple[str, Session]:
        own = self._by_token.get(self._key(principal))
        if own and len(own) >= self.per_token:
            self.close(next(iter(own)))
        if len(self._by_id) >= self.capacity:
            if own:
                self.close(next(iter(own)))
            else:
                self._drop_expired()
            if len(self._by_id) >= self.capacity:
                raise TooMany(f"the console holds {len(self._by_id)} sessions, its limit: sign out elsewhere "
                              "or wait for sessions to expire")
        sid = secrets.token_urlsafe(32)
        session = self._by_id[sid] = Session(principal, secrets.token_urlsafe(32), self.clock() + self.ttl_s)
        self._by_token.setdefault(self._key(principal), OrderedDict())[sid] = None
        return sid, session

    def _drop_expired(self) -> None:
        now = self.clock()
        for sid in [sid for sid, s in self._by_id.items() if s.expires <= now]:
            self.close(sid)

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        session = self._by_id.get(sid)
        if session is not None and session.expires <= self.clock():
            self.close(sid)
            return None
        return session

    def close(self, sid: str | None) -> None:
        if not sid:
            return
        session = self._by_id.pop(sid, None)
        if session is not None:
            key = self._key(session.principal)
            own = self._by_token.get(key)
            if own is not None:
                own.pop(sid, None)
                if not own:
                    del self._by_token[key]

    def open_stream(self, session: Session) -> Callable[[], None]:
        """Count a stream of ``session`` (429 beyond the limits); answers its release (idempotent)."""
        if session.streams >= self.streams_per_session:
            raise TooMany(f"this console session has {session.streams} live-update streams open, its limit: close a page "
                          "(or sign in again from another browser)")
        if self.streams >= self.streams_total:
            raise TooMany(f"the console serves {self.streams} live-update streams, its limit: try again later")
        session.streams += 1
        self.streams += 1

        def give_back() -> None:
            session.streams -= 1
            self.streams -= 1

        return release_once(give_back)

    def __len__(self) -> int:
        return len(self._by_id)


class LoginLimiter:
    """Token buckets of failed sign-ins, per client address and in all: each failure takes one;
    a bucket refills one per ``refill_s`` up to ``burst``. An empty bucket refuses sign-ins from
    that address (or, for the total, from everyone) before the token is even checked, so guessing
    learns nothing while it lasts. At most ``addresses`` addresses are tracked (the least recently
    failed beyond that are forgotten; the total bucket still holds)."""

    def __init__(self, *, burst: int = _LOGIN_BURST, refill_s: float = _LOGIN_REFILL_S, burst_total: int = _LOGIN_BURST_TOTAL,
                 refill_total_s: float = _LOGIN_REFILL_TOTAL_S, addresses: int = _LOGIN_ADDRESSES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if min(burst, burst_total, addresses) < 1 or min(refill_s, refill_total_s) <= 0:
            raise ValueError("bursts and addresses must be >= 1 and refill periods > 0")
        self.burst, self.refill_s, self.burst_total, self.refill_total_s = burst, refill_s, burst_total, refill_total_s
        self.addresses, self.clock = addresses, clock
        self._by_address: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (level, at)
        self._total = (float(burst_total), clock())

    @staticmethod
    def _level(bucket: tuple[float, float], burst: int, refill_s: float, now: float) -> float:
        level, at = bucket
        return min(float(burst), level + (now - at) / refill_s)

    def retry_after(self, address: str) -> float:
        """Seconds until ``address`` may try again (0: now)."""
        now = self.clock()
        mine = self._by_address.get(address)
        wait = 0.0
        if mine is not None:
            wait = max(wait, (1.0 - self._level(mine, self.burst, self.refill_s, now)) * self.refill_s)
        wait = max(wait, (1.0 - self._level(self._total, self.burst_total, self.refill_total_s, now)) * self.refill_total_s)
        return wait

    def failed(self, address: str) -> None:
        now = self.clock()
        mine = self._by_address.pop(address, None)
        level = self._level(mine, self.burst, self.refill_s, now) if mine is not None else float(self.burst)
        self._by_address[address] = (level - 1.0, now)
        while len(self._by_address) > self.addresses:
            self._by_address.popitem(last=False)
        self._total = (self._level(self._total, self.burst_total, self.refill_total_s, now) - 1.0, now)


def _sessions(request: Request) -> ConsoleSessions:
    return request.app.state.console_sessions


def _secure(request: Request) -> bool:
    """Whether the browser reaches the console over https (directly, or through a TLS proxy
    whose public address is TRAINGUARD_EXTERNAL_URL)."""
    return request.url.scheme == "https" or request.app.state.settings.external_url.startswith("https://")


def _set_cookie(response: Response, request: Request, sid: str, ttl_s: float) -> None:
    response.set_cookie(COOKIE, sid, max_age=int(ttl_s), path="/ui", httponly=True, samesite="strict",
                        secure=_secure(request))


def _origin_key(scheme: str, netloc: str) -> tuple[str, str, int | None] | None:
    """``(scheme, host, port)`` of an origin, the port made explicit for http and https; ``None``
    when it does not parse."""
    try:
        parts = urlsplit(f"{scheme}://{netloc}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    scheme = scheme.lower()
    return scheme, parts.hostname.lower(), port if port is not None else {"http": 80, "https": 443}.get(scheme)


def _check_origin(request: Request) -> None:
    """Refuse a state-changing request whose ``Origin`` is another site's: scheme, host and port
    must all be the controller's (as the browser reached it, or TRAINGUARD_EXTERNAL_URL's).
    SameSite=Strict already keeps the cookie off cross-site requests; this also covers browsers
    that ignore it."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    allowed = {_origin_key(request.url.scheme, request.headers.get("host", ""))}
    external = request.app.state.settings.external_url
    if external:  # behind a proxy that rewrites Host, the public address the browser uses
        parts = urlsplit(external)
        allowed.add(_origin_key(parts.scheme, parts.netloc))
    try:
        parts = urlsplit(origin)
    except ValueError:  # (an Origin that is no URL, e.g. "http://[::1": refused like another site's)
        parts = None
    key = _origin_key(parts.scheme, parts.netloc) if parts is not None and parts.scheme in ("http", "https") else None
    if key is None or key not in allowed:
        raise HTTPException(403, "cross-origin request refused: the Origin's scheme, host and port must be this "
                            "controller's (behind a proxy, set TRAINGUARD_EXTERNAL_URL to the public address)")


def _live_session(request: Request) -> Session | None:
    """The request's session while it and the token it signed in with are valid; a session whose
    token was revoked or expired ends here."""
    sessions = _sessions(request)
    sid = request.cookies.get(COOKIE)
    session = sessions.get(sid)
    if session is not None and not request.app.state.tokens.is_live(session.principal):
        sessions.close(sid)
        return None
    return session


def _session_dep(scope: str | None, *, csrf: bool) -> Callable[[Request], Awaitable[Session]]:
    async def dep(request: Request) -> Session:
        session = _live_session(request)
        if session is None:
            raise HTTPException(401, "not signed in to the console (POST /ui/login with an operator token)")
        if csrf:
            _check_origin(request)
            sent = request.headers.get(CSRF_HEADER, "")
            if not hmac.compare_digest(sent.encode(), session.csrf.encode()):
                raise HTTPException(403, f"missing or wrong {CSRF_HEADER} header")
        if scope is not None and scope not in session.principal.scopes:
            raise HTTPException(403, f"this operator token lacks the '{scope}' scope")
        return session

    return dep


ReadSession = Annotated[Session, Depends(_session_dep("read", csrf=False))]
AnySession = Annotated[Session, Depends(_session_dep(None, csrf=True))]

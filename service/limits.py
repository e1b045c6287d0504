"""Request-body size limit as a plain ASGI middleware (no per-request thread or task), and the
one reader of a whole request body the middlewares share (:func:`read_body`, :func:`replay`).

Registrations and reports grow with the run's world size (an endpoint per rank; a value per rank
in each per-rank vector): their limits follow from ``TRAINGUARD_MAX_WORLD_SIZE``
(:func:`registration_body_bytes`, :func:`report_body_bytes`), so that every run the controller
accepts can register and report, however low ``TRAINGUARD_MAX_BODY_BYTES`` is set.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

from trainguard.protocol.catalog import BY_NAME
from trainguard.protocol.wire import API_PREFIX, MAX_DESYNC_LAYERS, RankValues
from trainguard.service.auth import authorization_header

__all__ = ["BodyLimit", "BodyTooLarge", "Authenticate", "PRINCIPAL_KEY", "read_body", "replay", "registration_body_bytes",
           "report_body_bytes"]

#: The most bytes one number takes in an agent's report (compact JSON): the longest float64
#: (``-2.2250738585072014e-308``, 24 characters; NaN and Inf are shorter strings) and a comma.
_VALUE_BYTES = 25
#: A desync layer at most: its name (512 characters, each escaped to at most 6 bytes), 64 rank
#: ids of up to 20 digits, its kind, difference and keys.
_DESYNC_LAYER_BYTES = 512 * 6 + 64 * 21 + 128
#: The rest: job, steps, time, applied generation, and every key and bracket of the vectors.
_ENVELOPE_BYTES = 4096
#: One rank's endpoint in a registration at most: rank and local rank of up to 20 digits, a host
#: name of 253 characters (a valid one needs no escaping), the port, the keys and a comma.
_ENDPOINT_BYTES = 42 + 20 + 20 + 253 + 5
#: A registration's job, run, agent version and the agent's configuration (a few hundred bytes).
_REGISTRATION_BYTES = 64 << 10


def registration_body_bytes(world_size: int) -> int:
    """The largest registration the agent of a run of ``world_size`` ranks sends (every rank's
    endpoint at its longest)."""
    return _REGISTRATION_BYTES + world_size * _ENDPOINT_BYTES


def report_body_bytes(world_size: int) -> int:
    """The largest report body the agent of a run of ``world_size`` ranks sends: every per-rank
    vector of the wire model full of the longest numbers, every job-level metric of the agent's
    catalogue, the most desync layers (``trainguard.protocol.wire``). The vectors are counted as
    the JSON lists older agents send (25 bytes a value); packed, as this agent sends them
    (``trainguard.protocol.rank_vector``), a value takes at most 11 bytes."""
    per_rank = len(RankValues.model_fields) * _VALUE_BYTES
    values = sum(len(name) + 4 + _VALUE_BYTES for name, metric in BY_NAME.items() if not metric.labels)
    return _ENVELOPE_BYTES + values + MAX_DESYNC_LAYERS * _DESYNC_LAYER_BYTES + world_size * per_rank

#: Where :class:`Authenticate` leaves the caller's principal in the ASGI scope (the routes'
#: dependencies and the report fast path read it instead of hashing the token again).
PRINCIPAL_KEY = "trainguard.principal"


class BodyLimit:
    """Answer 413 to bodies over ``max_bytes``: at once from ``Content-Length``, else (chunked
    bodies) after buffering at most the limit. Registrations may be as large as those of a run of
    ``max_world_size`` ranks (:func:`registration_body_bytes`), if that is more; a report as large
    as the largest report of its run's world size (``world_size_of(run)``, :func:`report_body_bytes`),
    or of ``max_world_size`` ranks for a run not registered, if that is more."""

    def __init__(self, app: Any, max_bytes: int, max_world_size: int = 1,
                 world_size_of: Callable[[str], int | None] = lambda run: None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.registration_max_bytes = max(max_bytes, registration_body_bytes(max_world_size))
        self._max_world_size = max_world_size
        self._world_size_of = world_size_of

    def _limit(self, scope: dict[str, Any]) -> tuple[int, str]:
        """The limit of this request's body, and the setting it comes from."""
        path: str = scope["path"]
        limit = self.max_bytes
        if scope["method"] == "POST" and path == f"{API_PREFIX}/runs":
            limit, what = self.registration_max_bytes, f"a run of TRAINGUARD_MAX_WORLD_SIZE={self._max_world_size} ranks"
        elif scope["method"] == "POST" and path.startswith(f"{API_PREFIX}/runs/") and path.endswith("/reports"):
            run = path[len(f"{API_PREFIX}/runs/"):-len("/reports")]
            world = self._world_size_of(run)
            limit = report_body_bytes(min(world, self._max_world_size) if world else self._max_world_size)
            what = f"run {run[:128]!r} of {world} ranks" if world else f"a run of TRAINGUARD_MAX_WORLD_SIZE={self._max_world_size} ranks"
        if limit > self.max_bytes:
            return limit, f"the largest {'report' if path.endswith('/reports') else 'registration'} of {what}"
        return self.max_bytes, "TRAINGUARD_MAX_BODY_BYTES"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        max_bytes, setting = self._limit(scope)
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await self._refuse(send, 400, "invalid Content-Length")
                    return
        if length is not None:
            if length > max_bytes:
                await self._refuse(send, 413, f"request body of {length} bytes exceeds the limit of {max_bytes} ({setting})")
                return
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read it here, bounded, then replay it.
        try:
            body = await read_body(receive, max_bytes)
        except BodyTooLarge:
            await self._refuse(send, 413, f"request body exceeds the limit of {max_bytes} bytes ({setting})")
            return
        if body is not None:  # (else the client went away)
            await self.app(scope, replay(body, receive), send)

    @staticmethod
    async def _refuse(send: Any, status: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    """A request body past the limit :func:`read_body` was given (the rest left unread)."""


async def read_body(receive: Any, max_bytes: float = math.inf) -> bytes | None:
    """The whole request body from the ASGI ``receive``; None when the client disconnected first.
    :class:`BodyTooLarge` as soon as more than ``max_bytes`` arrived."""
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        total += len(chunk)
        if total > max_bytes:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)  # (one chunk: that chunk itself, no copy)


def replay(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that yields the already read ``body`` once, then defers to ``receive``."""
    sent = False

    async def receive_again() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


class Authenticate:
    """Answer 401 to an API request (``/v1/...``) without a known token before anything reads
    its body: an unauthenticated caller costs a hash, never a parse. Scopes are checked later,
    by each route. ``tokens`` is a :class:`~trainguard.service.auth.TokenTable`."""

    def __init__(self, app: Any, tokens: Any) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        principal = self.tokens.authenticate(authorization_header(scope))
        if principal is None:
            body = b'{"detail":"missing or unknown bearer token (send \'Authorization: Bearer <token>\')"}'
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        scope[PRINCIPAL_KEY] = principal
        await self.app(scope, receive, send)

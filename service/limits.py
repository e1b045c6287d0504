"""Request-body size limit as a plain ASGI middleware (no per-request thread or task)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["BodyLimit", "Authenticate", "PRINCIPAL_KEY", "replay"]

#: Where :class:`Authenticate` leaves the caller's principal in the ASGI scope (the routes'
#: dependencies and the report fast path read it instead of hashing the token again).
PRINCIPAL_KEY = "trainguard.principal"


class BodyLimit:
    """Answer 413 to bodies over ``max_bytes``: at once from ``Content-Length``, else (chunked
    bodies) after buffering at most ``max_bytes``."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    await self._refuse(send, 400, "invalid Content-Length")
                    return
        if length is not None:
            if length > self.max_bytes:
                await self._refuse(send, 413, f"request body of {length} bytes exceeds the limit of {self.max_bytes}")
                return
            await self.app(scope, receive, send)
            return
        # No Content-Length (chunked): read it here, bounded, then replay it.
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await self._refuse(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, replay(b"".join(chunks), receive), send)

    @staticmethod
    async def _refuse(send: Any, status: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


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
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        principal = self.tokens.authenticate(authorization)
        if principal is None:
            body = b'{"detail":"missing or unknown bearer token (send \'Authorization: Bearer <token>\')"}'
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        scope[PRINCIPAL_KEY] = principal
        await self.app(scope, receive, send)

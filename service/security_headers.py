"""``X-Content-Type-Options: nosniff`` on every answer of the controller, as an ASGI middleware.

The API answers JSON and the console serves HTML, scripts and styles with their own types; a
browser that sniffed a type instead could run an answer as a script or a page (a run name or a
reason echoed in a JSON error, read as HTML). ``nosniff`` tells it to take the declared type only.
The middleware is the outermost layer (``service/app.py``), so the answers of the gates inside it
(standby, authentication, loading, the body limit, the report ingress) carry it too.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["NoSniff", "NOSNIFF"]

#: The header as the ASGI server sends it.
NOSNIFF = (b"x-content-type-options", b"nosniff")


class NoSniff:
    """Add :data:`NOSNIFF` to every HTTP answer of ``app`` that does not set the header itself."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_nosniff(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if all(name.lower() != NOSNIFF[0] for name, _ in headers):
                    headers.append(NOSNIFF)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_nosniff)

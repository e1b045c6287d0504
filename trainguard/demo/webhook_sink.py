"""A tiny webhook receiver that logs and shows the alerts it receives (standard library only).

It accepts Alertmanager's webhook payload (version 4; the controller's outgoing webhooks use the
same format) and any other JSON on ``POST`` to any path, logs one line per alert to stdout, and
keeps the newest ``--keep`` payloads in memory:

    python -m trainguard.demo.webhook_sink --host 0.0.0.0 --port 9000

    GET  /             an HTML page of the received alerts, newest first (refreshes every 5 s)
    GET  /alerts.json  the same as JSON
    GET  /healthz      "ok"
    POST /<anything>   receive a payload (answered ``--status``; 204 by default)

``--status 500`` makes it a failing receiver, to exercise a sender's retries.

Signatures: with ``--secret`` (or ``TRAINGUARD_WEBHOOK_SECRET``), every ``POST`` under
``--signed-prefix`` (``/controller`` by default: point the controller's webhook there) must carry
the controller's signature, rebuilt here from the documented recipe::

    X-Trainguard-Signature: sha256=hex(HMAC_SHA256(secret, "{X-Trainguard-Timestamp}." + body))

and a timestamp at most ``--max-age`` seconds (300) away from this machine's clock (a captured
delivery cannot be replayed later). Anything else is answered 401 and not kept. Other paths
(Alertmanager's ``/alerts``: Alertmanager does not sign) are taken as before.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import html
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Inbox", "make_server", "main", "signature_problem"]

MAX_BODY_BYTES = 1 << 20
MAX_AGE_S = 300.0


def signature_problem(secret: str, timestamp: str | None, signature: str | None, body: bytes, *,
                      now: float, max_age_s: float = MAX_AGE_S) -> str | None:
    """Why a delivery is not signed with ``secret`` (``None`` when it is): the signature must be
    ``sha256=`` + hex HMAC-SHA256 of ``"{timestamp}." + body``, the timestamp (Unix seconds)
    within ``max_age_s`` of ``now``. Compared in constant time."""
    if not timestamp or not signature:
        return "missing X-Trainguard-Timestamp or X-Trainguard-Signature"
    try:
        ts = int(timestamp)
    except ValueError:
        return "X-Trainguard-Timestamp is not an integer"
    if abs(now - ts) > max_age_s:
        return f"timestamp {ts} is more than {max_age_s:g} s away from now"
    expected = "sha256=" + hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected.encode(), signature.encode()):
        return "signature does not match"
    return None


class Inbox:
    """The newest payloads received, with their arrival time and path; thread-safe."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._items: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.received = 0

    def add(self, path: str, payload: Any, *, signed: bool = False) -> dict[str, Any]:
        item = {"received_at": time.time(), "path": path, "signed": signed, "payload": payload}
        with self._lock:
            self._items.append(item)
            self.received += 1
        return item

    def newest_first(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(reversed(self._items))


def alert_lines(payload: Any) -> list[str]:
    """One human line per alert of an Alertmanager-format payload (one line for anything else)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
        return [f"payload: {json.dumps(payload, sort_keys=True)[:500]}"]
    lines = []
    for alert in payload["alerts"]:
        labels = alert.get("labels", {}) if isinstance(alert, dict) else {}
        annotations = alert.get("annotations", {}) if isinstance(alert, dict) else {}
        status = alert.get("status", payload.get("status", "?")) if isinstance(alert, dict) else "?"
        lines.append(
            f"{status.upper()} {labels.get('alertname', '?')} run={labels.get('run', '-')} "
            f"severity={labels.get('severity', '-')} action={labels.get('trainguard_action', '-')}"
            f" | {annotations.get('summary', '')}"
        )
    return lines


def _page(inbox: Inbox) -> str:
    rows = []
    for item in inbox.newest_first():
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(item["received_at"]))
        for line in alert_lines(item["payload"]):
            rows.append(f"<tr><td>{when}</td><td>{html.escape(item['path'])}</td>"
                        f"<td>{html.escape(line)}</td></tr>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='5'>"
        "<title>trainguard webhook sink</title></head><body>"
        f"<h1>Received alerts ({inbox.received} payloads)</h1>"
        "<table border='1' cellpadding='4'><tr><th>received</th><th>path</th><th>alert</th></tr>"
        + "".join(rows) + "</table></body></html>"
    )


@dataclass(frozen=True)
class _SinkSettings:
    """How a server answers and checks what it receives (see :func:`make_server`)."""

    status: int
    log: Any
    secret: str | None
    signed_prefix: str
    max_age_s: float
    clock: Callable[[], float]


class _Handler(BaseHTTPRequestHandler):
    """The sink's requests; the inbox and the settings are the server's (``server.inbox``,
    ``server.sink``)."""

    server_version = "trainguard-webhook-sink"

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        inbox = self.server.inbox  # type: ignore[attr-defined]
        if self.path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        elif self.path == "/alerts.json":
            self._send(200, json.dumps(inbox.newest_first()).encode(), "application/json")
        elif self.path == "/":
            self._send(200, _page(inbox).encode(), "text/html; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:  # noqa: N802
        sink: _SinkSettings = self.server.sink  # type: ignore[attr-defined]
        body = self._read_body()
        if body is None:
            return
        signed = sink.secret is not None and self.path.startswith(sink.signed_prefix)
        if signed and self._refused(sink, body):
            return
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            self._send(400, f"body is not JSON: {exc}\n".encode(), "text/plain")
            return
        self.server.inbox.add(self.path, payload, signed=signed)  # type: ignore[attr-defined]
        for line in alert_lines(payload):
            print(f"[webhook-sink] {self.path} {line}", file=sink.log, flush=True)
        self._send(sink.status, b"", "text/plain")

    def _read_body(self) -> bytes | None:
        """The request's body, or None when its length is missing or too large (answered)."""
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._send(411, b"Content-Length required\n", "text/plain")
            return None
        if not 0 <= length <= MAX_BODY_BYTES:
            self._send(413, b"body too large\n", "text/plain")
            return None
        return self.rfile.read(length)

    def _refused(self, sink: _SinkSettings, body: bytes) -> bool:
        """Whether the delivery's signature is refused (answered 401 and logged)."""
        problem = signature_problem(sink.secret, self.headers.get("X-Trainguard-Timestamp"),  # type: ignore[arg-type]
                                    self.headers.get("X-Trainguard-Signature"), body, now=sink.clock(),
                                    max_age_s=sink.max_age_s)
        if problem is None:
            return False
        print(f"[webhook-sink] {self.path} refused: {problem}", file=sink.log, flush=True)
        self._send(401, f"bad signature: {problem}\n".encode(), "text/plain")
        return True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # one line per alert is logged above; access logs would drown it


def make_server(host: str, port: int, *, keep: int = 200, status: int = 204, log=sys.stdout,
                secret: str | None = None, signed_prefix: str = "/controller", max_age_s: float = MAX_AGE_S,
                clock=time.time) -> ThreadingHTTPServer:
    """A server bound to (host, port) (port 0: a free one); ``server.inbox`` holds what came.
    With ``secret``, POSTs under ``signed_prefix`` must be signed (see :func:`signature_problem`)."""
    if not 200 <= status <= 599:
        raise ValueError(f"status must be an HTTP status code, got {status}")
    if secret is not None and not secret:
        raise ValueError("secret must not be empty (leave it out to take unsigned deliveries)")
    if max_age_s <= 0:
        raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
    inbox = Inbox(keep)
    server = ThreadingHTTPServer((host, port), _Handler)
    server.daemon_threads = True
    server.inbox = inbox  # type: ignore[attr-defined]
    server.sink = _SinkSettings(status=status, log=log, secret=secret,  # type: ignore[attr-defined]
                                signed_prefix=signed_prefix, max_age_s=max_age_s, clock=clock)
    return server


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.demo.webhook_sink",
                                     description="Log and show received webhook alerts.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--keep", type=int, default=200, help="payloads kept for the page")
    parser.add_argument("--status", type=int, default=204, help="HTTP status answered to POSTs")
    parser.add_argument("--secret", default=os.environ.get("TRAINGUARD_WEBHOOK_SECRET") or None,
                        help="the webhook's secret: POSTs under --signed-prefix must be signed with it "
                             "(default: $TRAINGUARD_WEBHOOK_SECRET; unset: signatures are not checked)")
    parser.add_argument("--signed-prefix", default="/controller", help="paths whose POSTs must be signed")
    parser.add_argument("--max-age", type=float, default=MAX_AGE_S, help="oldest signed timestamp taken, seconds")
    args = parser.parse_args(argv)
    server = make_server(args.host, args.port, keep=args.keep, status=args.status, secret=args.secret,
                         signed_prefix=args.signed_prefix, max_age_s=args.max_age)
    host, port = server.server_address[:2]
    checked = f"signatures checked under {args.signed_prefix}" if args.secret else "signatures NOT checked (no --secret)"
    print(f"[webhook-sink] listening on http://{host}:{port}/ ({checked})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

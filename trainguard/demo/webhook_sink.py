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
"""

from __future__ import annotations

import argparse
import html
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["Inbox", "make_server", "main"]

MAX_BODY_BYTES = 1 << 20


class Inbox:
    """The newest payloads received, with their arrival time and path; thread-safe."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._items: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.received = 0

    def add(self, path: str, payload: Any) -> dict[str, Any]:
        item = {"received_at": time.time(), "path": path, "payload": payload}
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


def make_server(host: str, port: int, *, keep: int = 200, status: int = 204,
                log=sys.stdout) -> ThreadingHTTPServer:
    """A server bound to (host, port) (port 0: a free one); ``server.inbox`` holds what came."""
    if not 200 <= status <= 599:
        raise ValueError(f"status must be an HTTP status code, got {status}")
    inbox = Inbox(keep)

    class Handler(BaseHTTPRequestHandler):
        server_version = "trainguard-webhook-sink"

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if body and self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            elif self.path == "/alerts.json":
                self._send(200, json.dumps(inbox.newest_first()).encode(), "application/json")
            elif self.path == "/":
                self._send(200, _page(inbox).encode(), "text/html; charset=utf-8")
            else:
                self._send(404, b"not found\n", "text/plain")

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._send(411, b"Content-Length required\n", "text/plain")
                return
            if not 0 <= length <= MAX_BODY_BYTES:
                self._send(413, b"body too large\n", "text/plain")
                return
            body = self.rfile.read(length)
            try:
                payload = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                self._send(400, f"body is not JSON: {exc}\n".encode(), "text/plain")
                return
            inbox.add(self.path, payload)
            for line in alert_lines(payload):
                print(f"[webhook-sink] {self.path} {line}", file=log, flush=True)
            self._send(status, b"", "text/plain")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # one line per alert is logged above; access logs would drown it

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.inbox = inbox  # type: ignore[attr-defined]
    return server


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainguard.demo.webhook_sink",
                                     description="Log and show received webhook alerts.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--keep", type=int, default=200, help="payloads kept for the page")
    parser.add_argument("--status", type=int, default=204, help="HTTP status answered to POSTs")
    args = parser.parse_args(argv)
    server = make_server(args.host, args.port, keep=args.keep, status=args.status)
    host, port = server.server_address[:2]
    print(f"[webhook-sink] listening on http://{host}:{port}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

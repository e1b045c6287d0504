"""The CLI's HTTP client: the controller's URL and token from the options, an answer's JSON or
the error it is (``SystemExit`` with the status and the controller's detail), JSON printing."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import Any

import httpx

__all__ = ["DEFAULT_URL", "connect", "checked", "show", "when"]

DEFAULT_URL = "http://127.0.0.1:8000"


def connect(args: argparse.Namespace, timeout: float | None = 10.0) -> httpx.Client:
    """A client of the controller at ``--url`` with ``--token``."""
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=timeout)


def checked(resp: httpx.Response) -> Any:
    """The answer's JSON; ``SystemExit`` (status 1) with the status and the controller's detail for an error."""
    if resp.status_code >= 400:
        try:
            detail = resp.json()
        except ValueError:
            detail = resp.text
        raise SystemExit(f"error: HTTP {resp.status_code}: {json.dumps(detail) if not isinstance(detail, str) else detail}")
    return resp.json() if resp.content else None


def show(value: Any) -> None:
    """Print ``value`` as indented JSON."""
    print(json.dumps(value, indent=2, sort_keys=False))


def when(t: float) -> str:
    """A Unix time as local ``YYYY-mm-dd HH:MM:SS``."""
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")

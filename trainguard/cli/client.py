"""The CLI's HTTP client: the controller's URL and token from the options, an answer's JSON or
the error it is (``SystemExit`` with the status and the controller's detail), JSON printing."""

from __future__ import annotations

import argparse
import json
import re
from datetime import datetime
from typing import Any

import httpx

from trainguard.protocol.base import NAME_PATTERN

__all__ = ["DEFAULT_URL", "connect", "checked", "show", "when", "run_name"]

DEFAULT_URL = "http://127.0.0.1:8000"
_RUN_NAME = re.compile(NAME_PATTERN)  # the controller's run names


def connect(args: argparse.Namespace, timeout: float | None = 10.0) -> httpx.Client:
    """A client of the controller at ``--url`` with ``--token``."""
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=timeout)


def run_name(text: str) -> str:
    """A run's name as the controller names runs (``argparse`` type): anything else would become
    another path in the URL (``other/../run-1`` is run-1) or never match a run."""
    if not _RUN_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"not a run name: {text!r} (letters, digits, '.', '_', ':', '-'; "
                                         "at most 128 characters, starting with a letter or digit)")
    return text


def checked(resp: httpx.Response) -> Any:
    """The answer's JSON; ``SystemExit`` (status 1) with the status and the controller's detail for an
    error, or for a redirect (the controller answers none: a proxy in between, or another server)."""
    if 300 <= resp.status_code < 400:
        raise SystemExit(f"error: HTTP {resp.status_code}: redirected to {resp.headers.get('location', '?')!r}; "
                         "give --url the controller's own address")
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

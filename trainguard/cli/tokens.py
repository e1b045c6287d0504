"""``trainguard token``: create, list and revoke a fleet's tokens at the controller (the
``tokens`` scope), and the lifetime option's parser."""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from trainguard.cli.client import checked, connect, show, when

__all__ = ["add_token", "parse_ttl"]


_TTL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_ttl(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``3600s`` or plain seconds -> seconds."""
    unit = text[-1:].lower()
    number = text[:-1] if unit in _TTL_UNITS else text
    try:
        value = float(number) * _TTL_UNITS.get(unit, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30d, 12h, 90m, 3600s)") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"a duration must be positive and finite, got {text!r}")
    return value


def _token(args: argparse.Namespace) -> int:
    with connect(args) as c:
        if args.token_cmd == "create":
            body: dict[str, Any] = {"name": args.name, "scopes": args.scope.split("+"), "ttl_s": args.ttl}
            if args.job is not None:
                body["job"] = args.job
            made = checked(c.post("/v1/tokens", json=body))
            if args.json:
                show(made)
            else:
                expires = "never" if made["expires_at"] is None else when(made["expires_at"])
                print(f"token {made['id']} ({'+'.join(made['scopes'])}, jobs {made['job_pattern'] or '-'}, expires {expires}):")
                print(made["token"])
                print("It is shown only this once: store it now.", file=sys.stderr)
        elif args.token_cmd == "list":
            rows = checked(c.get("/v1/tokens"))
            if args.json:
                show(rows)
                return 0
            print(f"{'ID':>4} {'NAME':<20} {'SCOPES':<22} {'JOBS':<14} {'EXPIRES':<19} {'STATE':<8} CREATOR")
            for t in rows:
                expired = t["expires_at"] is not None and t["expires_at"] <= time.time()
                state = "revoked" if t["revoked_at"] else "expired" if expired else "live"
                expires = "never" if t["expires_at"] is None else when(t["expires_at"])
                print(f"{t['id']:>4} {t['name'][:20]:<20} {'+'.join(t['scopes']):<22} {(t['job_pattern'] or '-'):<14} {expires:<19} {state:<8} {t['creator']}")
        else:
            show(checked(c.delete(f"/v1/tokens/{args.id}")))
    return 0


def add_token(sub: Any, client: argparse.ArgumentParser) -> None:
    s = sub.add_parser("token", help="tokens for a fleet: create, list, revoke (needs a token with the tokens scope)")
    tsub = s.add_subparsers(dest="token_cmd", required=True)
    t = tsub.add_parser("create", parents=[client], help="create a token (printed once)")
    t.add_argument("--scope", required=True, help="'agent', or operator scopes joined by '+' (read+command)")
    t.add_argument("--job", default=None, help="agent tokens: jobs whose runs it may register, e.g. 'llm-7b*'")
    t.add_argument("--ttl", type=parse_ttl, default=None, help="lifetime: 30d, 12h, 90m, 3600s (default: none)")
    t.add_argument("--name", default="", help="what it is for")
    t.set_defaults(func=_token)
    t = tsub.add_parser("list", parents=[client], help="list tokens (never the tokens themselves)")
    t.set_defaults(func=_token)
    t = tsub.add_parser("revoke", parents=[client], help="revoke a token by id")
    t.add_argument("id", type=int)
    t.set_defaults(func=_token)

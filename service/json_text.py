"""JSON bodies whose strings are text, as a plain ASGI middleware (:class:`JsonText`).

JSON writes a character outside the Basic Multilingual Plane as a pair of UTF-16 surrogate
escapes (``"\\ud83d\\ude00"``); one escape alone (``"\\ud800"``) is no character at all. Python's
``json`` module, which FastAPI parses bodies with, accepts it and yields a string that cannot be
encoded as UTF-8: the request validates, and then storing its value or repeating it in the
answer raised (a 500), after part of the work was done. Pydantic's own parser, which the report
path uses, refuses such a body; this middleware gives every other route the same answer, a 422,
before any of them reads the body.

A JSON object naming one key twice (``{"scale": 0.5, "scale": 5}``) is answered 422 too: which
of the two counts is up to each parser (Python's and pydantic's take the last, others the first or
refuse), so what a client meant, or what a proxy in front checked, need not be what the
controller does. Reports, which the ingress parses before this middleware sees them, are checked
by their wire model only.

Each body this middleware sees is parsed once for keys named twice; only a body holding an escape
of the surrogate range (``\\uD800``-``\\uDFFF``, found by one scan of the bytes) is parsed again,
to tell a pair from a lone one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trainguard.service.limits import read_body, replay
from trainguard.service.schemas import NOT_REPEATED, SECRET_FIELDS, validation_summary

__all__ = ["JsonText", "ECHO_CHARACTERS", "unpaired_surrogate", "duplicate_key"]

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
_METHODS = ("POST", "PUT", "PATCH")
#: Characters of the refused string the answer repeats at most.
ECHO_CHARACTERS = 200


def unpaired_surrogate(body: bytes) -> tuple[list[Any], str] | None:
    """Where the JSON ``body`` first holds a string (a key or a value) with an unpaired surrogate:
    its location (the keys and indexes down to it, ``"[key]"`` after a key, as pydantic names
    them) and the string; None where there is none (also for a body that is no JSON: the route
    answers that)."""
    if _SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, list[Any]]] = [(value, [])]
    while stack:  # (no recursion: a body may nest thousands deep)
        item, loc = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, [*loc, k]) for k, v in item.items())
            stack.extend((k, [*loc, k, "[key]"]) for k in item)
        elif isinstance(item, list):
            stack.extend((v, [*loc, i]) for i, v in enumerate(item))
        elif isinstance(item, str) and any("\ud800" <= ch <= "\udfff" for ch in item):
            return loc, item
    return None


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def duplicate_key(body: bytes) -> str | None:
    """The first key the JSON ``body`` names twice in one object; None where there is none (also
    for a body that is no JSON: the route answers that)."""
    try:
        json.loads(body, object_pairs_hook=_unique_pairs)
    except _Duplicate as e:
        return e.key
    except (ValueError, RecursionError):
        return None
    return None


def _refused(body: bytes) -> dict[str, Any] | None:
    """The 422's error for ``body``: a string with an unpaired surrogate or a key named twice."""
    bad = unpaired_surrogate(body)
    if bad is not None:
        loc, text = bad
        shown = NOT_REPEATED if SECRET_FIELDS.intersection(k for k in loc if isinstance(k, str)) else text[:ECHO_CHARACTERS]
        return {"type": "string_unicode", "loc": ["body", *loc], "input": shown,
                "msg": "holds an unpaired UTF-16 surrogate escape (\\uD800-\\uDFFF without its pair), which is "
                       "no character: send text (a character beyond U+FFFF as its two escapes, or as UTF-8)"}
    key = duplicate_key(body)
    if key is not None:
        return {"type": "duplicate_key", "loc": ["body"], "input": key[:ECHO_CHARACTERS],
                "msg": f"names the key {key[:ECHO_CHARACTERS]!r} twice in one object: send each key once"}
    return None


class JsonText:
    """Answer 422 to a POST, PUT or PATCH whose JSON body holds a string with an unpaired
    surrogate escape or an object naming a key twice; pass every other request to ``app`` (the
    body read once, then replayed)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in _METHODS or not _json(scope):
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)  # (bounded: BodyLimit runs first)
        if body is None:
            return  # the client went away
        error = _refused(body)
        if error is None:
            await self.app(scope, replay(body, receive), send)
            return
        # The shape of the API's other 422s for a body that does not validate (``service/app.py``).
        errors = [error]
        answer = json.dumps({"detail": validation_summary(errors), "errors": errors}).encode()
        await send({"type": "http.response.start", "status": 422,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})


def _json(scope: dict[str, Any]) -> bool:
    """Whether FastAPI would parse the body as JSON: its content type says JSON, or it has none."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return b"json" in value.lower()
    return True

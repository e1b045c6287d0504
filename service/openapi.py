"""The OpenAPI document, completed: the schemas routes refer to but FastAPI does not generate (a
route that parses its own body), one error shape, and every status code each operation answers.

FastAPI lists an operation's success and, when it has parameters, a 422 with its own validation
body. The controller answers more: 401 and 403 from the token checks, 413 from the body limit,
408 from the server's body deadline (``service/server.py``), 404 for an unknown run, 409, 429 and
503 from the controller (``service.errors``), and every error has the body :data:`ERROR_SCHEMA` (``detail``: a sentence; ``errors``: the fields that did not validate;
``reasons``: every problem of a rules file). :func:`install` replaces ``app.openapi`` by a
function that adds all of it, so no route has to list them.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from fastapi import FastAPI
from pydantic import BaseModel

__all__ = ["install", "complete", "ERROR_SCHEMA", "ERROR_ITEM_SCHEMA", "STANDARD_ERRORS", "SPECIFIC_ERRORS", "MEDIA_TYPES"]

_REF = "#/components/schemas/{model}"

#: One item of ``errors``: a field that did not validate.
ERROR_ITEM_SCHEMA: dict[str, Any] = {
    "title": "ErrorItem", "type": "object", "required": ["loc", "msg", "type"],
    "properties": {
        "loc": {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                "description": "Where: 'body', 'query', 'path' or 'header', then the field's path."},
        "msg": {"type": "string"},
        "type": {"type": "string", "description": "The kind of problem, e.g. 'missing' or 'int_type'."},
        "input": {"description": "The value that was refused."},
        "ctx": {"type": "object"},
    },
}

#: The body of every error answer.
ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error", "type": "object", "required": ["detail"],
    "properties": {
        "detail": {"type": "string", "description": "What was refused and why, in a sentence."},
        "errors": {"type": "array", "items": {"$ref": _REF.format(model="ErrorItem")},
                   "description": "422 for a request that does not validate: each field that did not."},
        "reasons": {"type": "array", "items": {"type": "string"},
                    "description": "422 for a rules file that does not validate: every problem found."},
    },
}

#: Why each status is answered, where it applies to many operations.
STANDARD_ERRORS: dict[str, str] = {
    "400": "The request is malformed (e.g. an invalid Content-Length).",
    "401": "Missing or unknown bearer token.",
    "403": "The token lacks the operation's scope, or the run belongs to another agent token.",
    "404": "No such run (or other resource).",
    "408": "The request body did not arrive within TRAINGUARD_BODY_TIMEOUT_S.",
    "413": "The request body exceeds TRAINGUARD_MAX_BODY_BYTES.",
    "422": "The request does not validate; 'errors' names each field.",
    "503": "The database failed (the answer says how); retry later.",
}

#: Statuses only some operations answer: (method, path) -> {status: description}.
SPECIFIC_ERRORS: dict[tuple[str, str], dict[str, str]] = {
    ("delete", "/v1/runs/{run}"): {"409": "The run is live (paused, or reporting within its job's silence limit): give "
                                          "force=true to delete it anyway."},
    ("post", "/v1/runs"): {"409": "The run is registered for another job.",
                           "429": "The controller's or this token's limit of runs (TRAINGUARD_MAX_RUNS, "
                                  "TRAINGUARD_MAX_RUNS_PER_TOKEN) is reached."},
    ("post", "/v1/runs/{run}/reports"): {"409": "The run finished, or the report is for another job."},
    ("post", "/v1/runs/{run}/acks"): {"409": "The generation was never published."},
    ("post", "/v1/rules/test"): {"429": "Too many rule simulations in progress; retry later (Retry-After)."},
    ("get", "/v1/events/stream"): {"400": "Last-Event-ID is not the id of an event."},
    ("get", "/readyz"): {"503": "Database writes fail (after a full disk, until a 256 KiB row fits again) or wait for "
                                "a lock, or the runs are still being read back at start-up (the answer says which, and "
                                "how far the read got)."},
    ("get", "/healthz"): {"503": "The database writer stopped (or reading the runs back at start-up failed; it is tried again)."},
}

#: Operations whose success is not JSON: their media type.
MEDIA_TYPES: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {
    ("get", "/v1/events/stream"): ("text/event-stream", {  # (before OpenAPI 3.2 the schema describes one event)
        "type": "object", "description": "One Server-Sent Event: an audit event (a comment keeps the stream alive every 15 s).",
        "properties": {"id": {"type": "string", "description": "The event's id (send it back as Last-Event-ID)."},
                       "event": {"type": "string", "description": "The event's kind."},
                       "data": {"type": "string", "contentMediaType": "application/json", "description": "The event as JSON."},
                       "retry": {"type": "integer"}}}),
    ("get", "/metrics"): ("text/plain", {"type": "string", "description": "The Prometheus text exposition format."}),
}

#: Operations whose run or resource may be unknown (besides those with a ``{run}`` in the path).
_MAY_BE_ABSENT = {"/v1/webhooks/{webhook_id}", "/v1/webhooks/{webhook_id}/deliveries", "/v1/tokens/{token_id}"}
#: Tags of the operator commands: each may answer 409 (e.g. a rollback without a good snapshot,
#: an Idempotency-Key used with another request).
_COMMAND_TAG = "commands"
_WITH_BODY = {"post", "put", "patch"}


def install(app: FastAPI, models: tuple[type[BaseModel], ...] = ()) -> None:
    """Make ``app.openapi`` answer the completed document; ``models`` are added to its schemas
    (those that routes parsing their own bodies refer to)."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = complete(generate(), models)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def complete(doc: dict[str, Any], models: tuple[type[BaseModel], ...] = ()) -> dict[str, Any]:
    """``doc`` with ``models``, the error schemas and every operation's error statuses added
    (changed in place and returned)."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        _add_model(schemas, model)
    schemas["ErrorItem"] = ERROR_ITEM_SCHEMA
    schemas["Error"] = ERROR_SCHEMA
    for path, operations in doc.get("paths", {}).items():
        for method, op in operations.items():
            if (method, path) in MEDIA_TYPES:
                media_type, schema = MEDIA_TYPES[(method, path)]
                op["responses"]["200"]["content"] = {media_type: {"schema": schema}}
            for status, description in _errors(method, path, op).items():
                op.setdefault("responses", {})[status] = {
                    "description": description, "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}}
    for unused in ("HTTPValidationError", "ValidationError"):
        if unused in schemas and f'"{_REF.format(model=unused)}"' not in json.dumps(doc):
            del schemas[unused]
    return doc


def _errors(method: str, path: str, op: dict[str, Any]) -> dict[str, str]:
    """The error statuses of one operation and why."""
    out: dict[str, str] = {}
    secured = bool(op.get("security"))
    if secured:
        out["401"] = STANDARD_ERRORS["401"]
        out["403"] = STANDARD_ERRORS["403"]
    if method in _WITH_BODY:
        out["400"] = STANDARD_ERRORS["400"]
        out["408"] = STANDARD_ERRORS["408"]
        out["413"] = STANDARD_ERRORS["413"]
    if op.get("parameters") or "requestBody" in op:
        out["422"] = STANDARD_ERRORS["422"]
    if "{run}" in path or path in _MAY_BE_ABSENT:
        out["404"] = STANDARD_ERRORS["404"]
    if secured:
        out["503"] = STANDARD_ERRORS["503"]
    if _COMMAND_TAG in op.get("tags", ()):
        out["409"] = "The command cannot be applied now (the answer says why), or the Idempotency-Key was used with another request."
    out.update(SPECIFIC_ERRORS.get((method, path), {}))
    return dict(sorted(out.items()))


def _add_model(schemas: dict[str, Any], model: type[BaseModel]) -> None:
    """``model``'s validation schema and the models it holds, unless already there."""
    schema = model.model_json_schema(ref_template=_REF)
    for name, definition in schema.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas.setdefault(model.__name__, schema)


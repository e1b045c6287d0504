"""The OpenAPI document (``service/openapi.py``): valid, every reference resolved, every status
code each operation answers listed, one error shape; and the API fuzzed from it with schemathesis
(every operation, the report route included: no 5xx, no undocumented status, answers as described)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import hypothesis
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase
from openapi_spec_validator import validate as validate_openapi
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance, status_code_conformance

from trainguard.service.app import create_app
from trainguard.service.config import Settings
from trainguard.service.openapi import ERROR_ITEM_SCHEMA, ERROR_SCHEMA
from tests.service.conftest import register

OP, AG = "operator-token-1", "agent-token-1"
TOKENS = dict(operator_tokens=(OP,), agent_tokens=(AG,))
AS_OP = {"Authorization": f"Bearer {OP}"}
AS_AG = {"Authorization": f"Bearer {AG}"}
#: Examples per operation and generation mode (positive, negative): the fuzz stays well under a
#: minute on two cores.
EXAMPLES = 8
STREAM_EXAMPLES = 3


def _document(tmp_path: Path) -> dict[str, Any]:
    return create_app(Settings(db=tmp_path / "doc.db")).openapi()


def _refs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "$ref" and isinstance(v, str):
                yield v
            else:
                yield from _refs(v)
    elif isinstance(value, list):
        for v in value:
            yield from _refs(v)


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"{ref} does not resolve"
        node = node[part]
    return node


def test_the_document_is_valid_and_every_reference_resolves(tmp_path: Path) -> None:
    doc = _document(tmp_path)
    validate_openapi(doc)
    refs = set(_refs(doc))
    assert "#/components/schemas/Report" in refs and "#/components/schemas/RulesTestRequest" in refs
    for ref in sorted(refs):
        _resolve(doc, ref)
    for name, schema in doc["components"]["schemas"].items():
        jsonschema.Draft202012Validator.check_schema(schema)
    body = doc["paths"]["/v1/runs/{run}/reports"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert _resolve(doc, body["$ref"])["required"] == ["job", "step_first", "step_last", "time"]


def test_every_operation_lists_its_error_statuses_with_the_error_schema(tmp_path: Path) -> None:
    doc = _document(tmp_path)
    error = {"$ref": "#/components/schemas/Error"}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            responses = op["responses"]
            for status, response in responses.items():
                if status[0] in "45":
                    assert response["content"]["application/json"]["schema"] == error, (method, path, status)
            if op.get("security"):
                assert {"401", "403"} <= set(responses), (method, path)
            if method in ("post", "put"):
                assert {"408", "413", "422"} <= set(responses), (method, path)
            if "{run}" in path:
                assert "404" in responses, (method, path)
    assert "429" in doc["paths"]["/v1/runs"]["post"]["responses"]
    assert "429" in doc["paths"]["/v1/rules/test"]["post"]["responses"]
    assert "409" in doc["paths"]["/v1/runs/{run}/rollback"]["post"]["responses"]
    assert doc["paths"]["/v1/runs/{run}/pause"]["post"]["security"] == [{"bearer": ["command"]}]
    assert doc["paths"]["/v1/runs/{run}/reports"]["post"]["security"] == [{"bearer": ["agent"]}]
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def _error_validator() -> jsonschema.Draft202012Validator:
    schema = dict(ERROR_SCHEMA, **{"$defs": {"ErrorItem": ERROR_ITEM_SCHEMA}})
    text = json.dumps(schema).replace("#/components/schemas/ErrorItem", "#/$defs/ErrorItem")
    return jsonschema.Draft202012Validator(json.loads(text))


def test_every_error_answer_has_the_error_shape_and_a_documented_status(app_factory) -> None:
    validator = _error_validator()
    with app_factory(**TOKENS) as c:
        register(c, headers=AS_AG)
        doc = c.get("/openapi.json").json()
        cases = [
            ("post", "/v1/runs/{run}/pause", "/v1/runs/run-1/pause", {}, None, 401),
            ("post", "/v1/runs/{run}/pause", "/v1/runs/run-1/pause", AS_AG, None, 403),
            ("get", "/v1/runs/{run}", "/v1/runs/nope", AS_OP, None, 404),
            ("post", "/v1/runs/{run}/rollback", "/v1/runs/run-1/rollback", AS_OP, None, 409),
            ("post", "/v1/runs/{run}/lr-scale", "/v1/runs/run-1/lr-scale", AS_OP, {"scale": "half"}, 422),
            ("post", "/v1/runs/{run}/acks", "/v1/runs/run-1/acks", AS_AG, {"generation": 1, "step": True}, 422),
            ("post", "/v1/tokens", "/v1/tokens", AS_OP, {"scopes": ["read"], "job": "llm*"}, 422),
            ("put", "/v1/rules", "/v1/rules", AS_OP, "rules: [{name: a}]", 422),
            ("post", "/v1/rules/test", "/v1/rules/test", AS_OP, "x" * (5 << 20), 413),
        ]
        for method, template, url, headers, body, status in cases:
            if isinstance(body, str):
                r = c.request(method, url, content=body, headers=headers)
            else:
                r = c.request(method, url, json=body, headers=headers)
            assert r.status_code == status, (url, r.status_code, r.text)
            assert str(status) in doc["paths"][template][method]["responses"], (url, status)
            answer = r.json()
            validator.validate(answer)
            assert answer["detail"] and isinstance(answer["detail"], str)
        r = c.post("/v1/runs/run-1/acks", json={"generation": 1, "step": True}, headers=AS_AG)
        assert r.json()["errors"][0]["loc"] == ["body", "step"]
        assert r.json()["detail"] == "the request does not validate: body.step: Input should be a valid integer, not a boolean"


def test_a_boolean_is_never_a_number_and_an_integral_number_is_an_integer(app_factory) -> None:
    with app_factory(**TOKENS) as c:
        register(c, headers=AS_AG)
        preflight = {"rank": 0, "seconds": False, "checks": []}
        r = c.post("/v1/runs/run-1/preflight", json=preflight, headers=AS_AG)
        assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", "seconds"]
        assert c.post("/v1/runs/run-1/preflight", json=preflight | {"seconds": 1}, headers=AS_AG).status_code == 200
        report = {"job": "job-a", "step_first": 200.0, "step_last": 213.0, "time": 1.0}
        assert c.post("/v1/runs/run-1/reports", json=report, headers=AS_AG).status_code == 200
        assert c.get("/v1/runs/run-1", headers=AS_OP).json()["last_step"] == 213
        for bad in (213.5, True, "213"):
            r = c.post("/v1/runs/run-1/reports", json=report | {"step_last": bad}, headers=AS_AG)
            assert r.status_code == 422 and r.json()["errors"][0]["loc"][-1] == "step_last", bad
        assert c.post("/v1/runs/run-1/reports", json=report | {"time": False}, headers=AS_AG).status_code == 422
        r = c.post("/v1/runs/run-1/lr-scale", json={"scale": True}, headers=AS_OP)
        assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", "scale"]
        assert c.get("/v1/runs/run-1", headers=AS_OP).json()["reports"] == 1


# -- the API fuzzed from its own document ----------------------------------------------------------
@pytest.fixture
def fuzzed_app(tmp_path: Path) -> Iterator[Any]:
    sent: list[httpx.Request] = []  # webhooks the fuzz creates are never reached over the network

    def nowhere(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(204)

    settings = Settings(db=tmp_path / "fuzz.db", longpoll_max_s=0.05, **TOKENS)
    yield create_app(settings, transport=httpx.MockTransport(nowhere))
    from schemathesis.python import asgi

    asgi.shutdown_lifespans()  # (the app stops)


def test_schemathesis_finds_no_server_error_and_no_undocumented_status_in_any_operation(fuzzed_app) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)  # (starts the app)
    schema.config.max_stream_events = 1
    from schemathesis.python import asgi

    register(asgi.get_client(fuzzed_app), headers=AS_AG)  # a run with events for the reads to find
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    failures: list[str] = []
    fuzzed: set[str] = set()
    for result in schema.get_all_operations():
        operation = result.ok()
        raw = operation.definition.raw
        roles = raw.get("security", [{}])[0].get("bearer", [])
        headers = AS_AG if roles == ["agent"] else AS_OP if roles else {}
        stream = any("text/event-stream" in r.get("content", {}) for r in raw["responses"].values())
        # An event stream never ends: each call is cut after its first event or a second.
        timeout, examples = (1, STREAM_EXAMPLES) if stream else (30, EXAMPLES)
        fuzzed.add(operation.label)
        modes = [GenerationMode.POSITIVE]
        if raw.get("parameters") or "requestBody" in raw:
            modes.append(GenerationMode.NEGATIVE)  # (nothing to send wrong to the others)
        for mode in modes:

            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            @hypothesis.settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                                 suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            def fuzz(case: Any) -> None:
                response = case.call(headers=headers, timeout=timeout)
                case.validate_response(response, checks=checks)

            try:
                fuzz()
            except FailureGroup as e:
                failures.append(f"{operation.label} ({mode.value}): " + "; ".join(str(f.title) for f in e.exceptions))
    assert not failures, "\n".join(failures)
    assert "POST /v1/runs/{run}/reports" in fuzzed and len(fuzzed) == sum(len(v) for v in schema.raw_schema["paths"].values())

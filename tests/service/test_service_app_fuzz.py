"""Every route of the app's route table (the console's and the undocumented ones too, which the
OpenAPI fuzz of test_service_openapi.py never sees), called on a real ``trainguard serve`` with
malformed input: bodies of random bytes, JSON with NaN, Infinity, huge numbers, duplicate keys and
deep nesting, sent with and without a JSON content type; path values with control characters,
quotes and markup; paging values negative, zero, huge or not numbers. Each answer is below 500 and
comes within the client's timeout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import hypothesis
import hypothesis.strategies as st
from hypothesis import HealthCheck, Phase

from tests.service.test_service_deps import app_routes

_QUERY_KEYS = ("limit", "before", "after", "wait", "seq", "run", "state", "job", "status", "force", "reason", "on_restart")
_NUMBERS = st.one_of(st.integers(-(10**30), 10**30), st.sampled_from(["NaN", "-Infinity", "1e999", "-0", "0x10", "", "1.5"]))
_JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**40), 10**40),
                         st.text(max_size=20))
_JSON = st.recursive(_JSON_LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_SPECIAL_BODIES = [
    b'{"a":' * 20_000 + b"1" + b"}" * 20_000,  # far deeper than any parser's recursion
    b"[" * 200_000,
    b'{"job":"job-a","job":"other","run":"run-1","world_size":1}',  # a duplicate key
    b'{"world_size":' + b"9" * 100_000 + b"}",  # a number of 100,000 digits
    b'{"scale":NaN,"reason":"\\u0000<script>alert(1)</script>"}',
    b"\xff\xfe\x00{",
]
_BODIES = st.one_of(st.binary(max_size=64), _JSON.map(lambda v: json.dumps(v, allow_nan=True).encode()),
                    st.sampled_from(_SPECIAL_BODIES))
_PATH_VALUES = st.one_of(st.sampled_from(["run-1", "1", "0", "-1", "9" * 40, "<script>", "a'\"b", "x" * 300, "pause"]),
                         st.text(min_size=1, max_size=12))
_CONTENT_TYPES = st.sampled_from([None, "application/json", "text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"])


@st.composite
def requests(draw: Any, routes: list[tuple[str, str]]) -> tuple[str, str, dict[str, Any], bytes | None, str | None]:
    method, path = draw(st.sampled_from(routes))
    while "{" in path:
        name = path[path.index("{"):path.index("}") + 1]
        path = path.replace(name, quote(draw(_PATH_VALUES), safe=""), 1)
    query = draw(st.dictionaries(st.sampled_from(_QUERY_KEYS), _NUMBERS.map(str) | st.text(max_size=12), max_size=3))
    body = draw(_BODIES) if method in ("POST", "PUT", "DELETE") and draw(st.booleans()) else None
    return method, path, query, body, draw(_CONTENT_TYPES)


def test_no_route_answers_a_server_error_or_hangs_on_malformed_input(serve: Any, tmp_path: Path) -> None:
    server = serve(tmp_path / "tg.db")  # (no tokens: every route is reached; test_service_deps.py checks who may)
    c = httpx.Client(base_url=server.url, timeout=30)
    body = {"job": "job-a", "run": "run-1", "world_size": 2}
    assert c.post("/v1/runs", json=body).status_code == 200
    csrf = c.get("/ui/api/session").json()["csrf"]  # the console's anonymous session
    routes = sorted(r for r in app_routes(tmp_path) if r[0] != "HEAD")
    failures: list[str] = []

    @hypothesis.given(request=requests(routes))
    @hypothesis.settings(max_examples=800, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    def fuzz(request: tuple[str, str, dict[str, Any], bytes | None, str | None]) -> None:
        method, path, query, content, content_type = request
        headers = {"X-CSRF-Token": csrf} | ({"content-type": content_type} if content_type else {})
        with c.stream(method, path, params=query, content=content, headers=headers) as r:  # (a stream: status, closed)
            if r.status_code >= 500:
                failures.append(f"{method} {path}?{query} {(content or b'')[:60]!r} ({content_type}): {r.status_code} {r.read()[:200]!r}")

    fuzz()
    assert not failures, "\n".join(failures[:20])
    assert c.get("/healthz").status_code == 200

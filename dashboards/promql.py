"""Metric names used by PromQL expressions, for checking the dashboards and rules against the
exporters' catalogues.

A small lexical pass, not a parser: it removes what cannot contain a metric name (string literals,
label matchers ``{...}``, range and subquery brackets ``[...]``, Grafana's ``$variables``, the label
lists of ``by``/``without``/``on``/``ignoring``/``group_left``/``group_right``), then takes every
remaining identifier that is neither a keyword, an aggregation operator nor a function call (an
identifier followed by ``(``). Numbers (``1e3``, ``0x1f``) and durations (``5m``) never start an
identifier, so they are never taken for names. The syntax itself is checked by ``promtool`` and a
real Prometheus in the tests.
"""

from __future__ import annotations

import re

__all__ = ["metric_names", "variable_query_metric", "KEYWORDS"]

#: Words that look like identifiers but are PromQL keywords, aggregation operators or literals.
KEYWORDS = frozenset(
    {
        "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
        "and", "or", "unless", "atan2", "start", "end",
        "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
        "bottomk", "topk", "quantile", "limitk", "limit_ratio",
    }
)
_NUMBER_WORDS = frozenset({"inf", "nan"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_VARIABLE_QUERY = re.compile(r"^\s*label_values\(\s*(.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*$", re.S)


def metric_names(expr: str) -> set[str]:
    """Every metric name ``expr`` selects; ``ValueError`` when the brackets do not balance."""
    text = _STRING.sub('""', expr)
    text = _GRAFANA_VARIABLE.sub("", text)
    for pattern in (_BRACES, _BRACKETS):
        # Nested brackets (subqueries of subqueries) are removed innermost first.
        while True:
            stripped = pattern.sub(" ", text)
            if stripped == text:
                break
            text = stripped
    text = _LABEL_LIST.sub(r"\1 ", text)
    if any(c in text for c in "{}[]") or text.count("(") != text.count(")"):
        raise ValueError(f"unbalanced brackets in PromQL expression: {expr!r}")
    names: set[str] = set()
    for match in _IDENTIFIER.finditer(text):
        word, call = match.group(1), match.group(2)
        if call or word in KEYWORDS or word.lower() in _NUMBER_WORDS:
            continue
        names.add(word)
    return names


def variable_query_metric(query: str) -> set[str]:
    """Metric names in a Grafana Prometheus variable query (``label_values(metric{...}, label)``
    or a plain PromQL query)."""
    match = _VARIABLE_QUERY.match(query)
    return metric_names(match.group(1) if match else query)

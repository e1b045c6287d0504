"""The wire's base types (``trainguard/protocol/base.py``): printable text, metric names, ranks,
and the agent's escaping of names it does not choose."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from trainguard.protocol.base import MAX_RANK, MetricName, Prose, Rank, Text, Value, printable
from trainguard.protocol.wire import DesyncLayer, MemoryOwnerEntry, QuarantinedSamples, Report

_TEXT = TypeAdapter(Text)


@pytest.mark.parametrize("name", ["blocks.0.attn", "layers.ünïcode", "a b", "x" * 512, "", "\U0001F600"])
def test_printable_text_is_taken_as_it_is(name: str) -> None:
    assert _TEXT.validate_python(name) == name
    assert printable(name) == name


@pytest.mark.parametrize("name, shown", [
    ("a\nb", "a\\nb"), ("a\x00b", "a\\x00b"), ("tab\there", "tab\\there"), ("rtl\u202eoverride", "rtl\\u202eoverride"),
    ("lone\ud800", "lone\\ud800"), ("del\x7f", "del\\x7f"),
])
def test_what_is_not_printable_is_refused_on_the_wire_and_escaped_by_the_agent(name: str, shown: str) -> None:
    with pytest.raises(ValidationError, match="must be printable text"):
        _TEXT.validate_python(name)
    assert printable(name) == shown
    assert _TEXT.validate_python(printable(name)) == shown  # what the agent sends validates
    # Every wire field of a name the agent does not choose (a module's, a file's) takes the escaped form.
    assert DesyncLayer(kind="grad", layer=printable(name), rel_diff=0.1).layer == shown
    assert MemoryOwnerEntry(owner=printable(name), bytes_per_step=1.0, tensors=1).owner == shown
    assert QuarantinedSamples(shard=printable("/data/" + name), indices=[3, 1, 1]).indices == [1, 3]


def test_prose_takes_tabs_and_newlines_and_refuses_the_other_controls_by_code_point() -> None:
    prose = TypeAdapter(Prose)
    assert prose.validate_python("line one\n\tline two \u00e9") == "line one\n\tline two \u00e9"
    with pytest.raises(ValidationError) as raised:
        prose.validate_python("a\x1b[2Jb\rc\u202ed\x1b")
    (error,) = raised.value.errors()
    assert error["type"] == "prose_text"
    assert error["msg"] == ("must be text without control characters (tab and newline aside); "
                            "it contains U+000D, U+001B, U+202E")
    with pytest.raises(ValidationError) as raised:
        _TEXT.validate_python("a\tb\x00")
    assert [(e["type"], e["msg"]) for e in raised.value.errors()] == [
        ("printable_text", "must be printable text; it contains U+0000, U+0009")]


def test_metric_names_and_ranks_have_their_bounds() -> None:
    names = TypeAdapter(MetricName)
    for ok in ("trainguard_loss", "a:b_c", "_x", "n" * 128):
        assert names.validate_python(ok) == ok
    for bad in ("", "1x", "a-b", "a b", "n" * 129, "ünï"):
        with pytest.raises(ValidationError):
            names.validate_python(bad)
    ranks = TypeAdapter(Rank)
    assert ranks.validate_python(MAX_RANK) == 999_999 and ranks.validate_python(0) == 0
    for bad in (-1, MAX_RANK + 1, True, "3"):
        with pytest.raises(ValidationError):
            ranks.validate_python(bad)


@pytest.mark.parametrize("text, message", [
    *((b, "Input should be a number, not a boolean") for b in ("true", "false")),
    *((t, "Input should be a number, or the string NaN, Infinity or -Infinity")
      for t in ('"1.5"', '"nan"', '"inf"', '" 2 "', '"Infinity "', '""')),
])
def test_a_boolean_or_a_string_is_no_metric_value_but_the_wire_s_non_finite_ones(text: str, message: str) -> None:
    values = TypeAdapter(dict[str, Value])
    with pytest.raises(ValidationError, match=message) as raised:
        values.validate_json(f'{{"trainguard_loss": {text}}}')
    assert raised.value.errors()[0]["loc"] == ("trainguard_loss",)
    with pytest.raises(ValidationError, match=message):
        Report.model_validate_json('{"job": "j", "step_first": 1, "step_last": 1, "time": 1.0, '
                                   f'"ranks": {{"loss": [1.5, {text}]}}}}')
    with pytest.raises(ValidationError, match=message):
        DesyncLayer.model_validate_json(f'{{"kind": "grad", "layer": "a", "rel_diff": {text}}}')
    # Numbers, integers and the wire's non-finite strings (and bare tokens) stay values.
    read = values.validate_json('{"a": 1.5, "b": 2, "c": "NaN", "d": "-Infinity", "e": "Infinity", "f": NaN}')
    assert read["a"] == 1.5 and read["b"] == 2.0 and read["c"] != read["c"] and read["d"] == float("-inf")
    assert read["e"] == float("inf") and read["f"] != read["f"]

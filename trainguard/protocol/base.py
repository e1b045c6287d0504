"""The wire's base types, shared by the wire models (:mod:`trainguard.protocol.wire`) and the
command registry (:mod:`trainguard.protocol.commands`): pydantic only."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict, StringConstraints
from pydantic_core import PydanticCustomError

__all__ = ["MAX_INT", "MAX_RANK", "NAME_PATTERN", "Name", "not_printable", "MetricName", "NON_FINITE_STRINGS", "Text", "Prose", "Value", "Int", "Rank", "WireModel", "printable"]

#: Largest integer a step, generation or id may be: SQLite's INTEGER is a signed 64-bit number,
#: so a bigger one could be validated here and then fail (500) when it is stored.
MAX_INT = 2**63 - 1

#: Job and run identifiers: also used in URLs and as Prometheus label values.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN, strict=True)]

#: A report value's key: a Prometheus metric name (the agent's catalogue's are up to 43 characters).
MetricName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_:][A-Za-z0-9_:]{0,127}$", strict=True)]

#: The strings a metric value may be: JSON has no literal for NaN and the infinities, and the wire
#: writes them so (``ser_json_inf_nan="strings"``).
NON_FINITE_STRINGS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _metric_value(value: Any) -> Any:
    """A metric value's input: a number, or one of :data:`NON_FINITE_STRINGS`. ``true``/``false``
    are refused (no metric of the catalogue is a boolean, and 1.0/0.0 read from them would be values
    nothing measured), and so is any other string (``"1.5"``, ``"nan"``: no sender writes them)."""
    if type(value) is bool:
        raise PydanticCustomError("float_type", "Input should be a number, not a boolean")
    if isinstance(value, str):
        if value not in NON_FINITE_STRINGS:
            raise PydanticCustomError("float_type", "Input should be a number, or the string NaN, Infinity or -Infinity")
        return NON_FINITE_STRINGS[value]
    return value


#: A metric value: any float, NaN and ±Inf included (as numbers or the strings of
#: :data:`NON_FINITE_STRINGS`); never a boolean, never another string.
Value = Annotated[float, BeforeValidator(_metric_value)]


def _codes(chars: Any) -> list[str]:
    """The distinct ``chars`` as sorted ``U+XXXX``."""
    return sorted({f"U+{ord(ch):04X}" for ch in chars})


def not_printable(text: str) -> list[str]:
    """The characters of ``text`` that are not printable, as sorted ``U+XXXX`` (none: ``[]``)."""
    return [] if text.isprintable() else _codes(ch for ch in text if not ch.isprintable())


def _refusing(kind: str, wanted: str, refused: Callable[[str], list[str]]) -> AfterValidator:
    """A text validator: the error ``kind``, "must be ``wanted``; it contains U+..." when
    ``refused`` lists characters of the text (the first 8 named)."""

    def check(text: str) -> str:
        bad = refused(text)
        if bad:
            raise PydanticCustomError(kind, f"must be {wanted}; it contains {{bad}}", {"bad": ", ".join(bad[:8])})
        return text

    return AfterValidator(check)


#: Printable text (bounded by each field's ``max_length``), for a name shown to people (a layer, a
#: shard, a check): a control character, a lone surrogate or a bidirectional override would garble
#: the console, the logs and the messages sent to webhooks. See :func:`printable` for the agent's side.
Text = Annotated[str, _refusing("printable_text", "printable text", not_printable)]

#: Control characters and the bidirectional overrides that text written by people may not hold
#: (tab and newline may: a reason of several lines): ESC sequences, CR and NUL act on a terminal
#: that prints the audit log, an override reverses what follows it.
_NOT_PROSE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

#: Text written by people (a command's reason): any characters but controls other than tab and newline.
Prose = Annotated[str, _refusing("prose_text", "text without control characters (tab and newline aside)",
                                 lambda text: _codes(_NOT_PROSE.findall(text)))]


def printable(text: str) -> str:
    """``text`` with each character that is not printable written as its escape (``\\n``,
    ``\\x00``, ``\\u202e``): what the agent sends of a name it does not choose (a module's, a
    file's), which the wire's :data:`Text` fields take."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)


def _integer(value: Any) -> Any:
    """An integer field's input: an integral number (``213.0`` is 213, as JSON Schema's
    ``integer`` says); a boolean, a fractional number or a string is refused."""
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer, not a boolean")
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise PydanticCustomError("int_from_float", "Input should be a valid integer, got a number with a fractional part")
    if isinstance(value, int) or isinstance(value, str):
        return value
    try:
        return operator.index(value)  # numpy and torch integers
    except TypeError:
        return value


#: Every integer of the wire: integral numbers only, never a boolean or a string.
Int = Annotated[int, Strict(), BeforeValidator(_integer)]

#: Largest rank number: a registration declares at most 1,000,000 ranks.
MAX_RANK = 999_999
#: A global rank's number.
Rank = Annotated[Int, Field(ge=0, le=MAX_RANK)]


class WireModel(BaseModel):
    """Base of every wire type: NaN/Inf as strings, unknown fields refused. Integers (:data:`Int`) and
    finite numbers are strict: a boolean is never a number and a string never a number (``"1"``, ``true``
    and ``1.5`` are refused for a step; ``213.0`` is the integer 213)."""

    model_config = ConfigDict(
        extra="forbid",
        ser_json_inf_nan="strings",
        allow_inf_nan=True,
        frozen=True,
    )

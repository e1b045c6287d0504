"""One per-rank vector of a report on the wire: a JSON list, or packed binary.

A report carries a dozen vectors of one value per rank; as JSON lists they cost ~156 bytes per
rank (5.1 MB at 32,768 ranks). The agent sends each vector packed instead, in one of three forms:

``{"float64": "<base64>"}``
    the values as little-endian IEEE-754 binary64, index = global rank (exact);
``{"float32": "<base64>"}``
    the same as binary32: when every value converts to float32 and back unchanged (a loss or a
    gradient norm computed in float32, an XID code, a NaN), or for a vector declared
    ``precision="float32"`` (timings) once the job has :data:`FLOAT32_FROM_RANKS` ranks or more,
    provided no finite value overflows float32 (a finite value never arrives as an infinity);
``{"fill": <value>, "n": <ranks>}``
    every one of the ``n`` ranks holds the same value, bit for bit (replicas' fingerprints in sync,
    no desync, no check): a few bytes whatever the world size.

NaN, ±Inf and -0.0 survive every form (binary32 and binary64 keep them). The JSON list stays
accepted (older agents). Decoding is strict: base64 of the standard alphabet with its padding and
nothing else, a whole number of values (no trailing bytes), ``n`` at most :data:`MAX_RANKS`; the
vector's length against the run's world size is the controller's check (it knows the run).

A decoded packed vector is an :class:`array.array` (``'d'`` or ``'f'``, one value per rank) or a
:class:`Filled` (the value and the count, nothing expanded): sequences of floats, like the list,
that the controller turns into numpy arrays without a Python float per rank (the buffer protocol)
and only after checking their length. This module must not import numpy (nor torch).
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Union, overload

from pydantic import AfterValidator, Discriminator, Field, InstanceOf, PlainSerializer, Tag, WithJsonSchema, model_validator

from trainguard.protocol.base import Int, Value, WireModel

__all__ = ["MAX_RANKS", "FLOAT32_FROM_RANKS", "Filled", "PackedVector", "pack", "unpack", "vector_field"]

#: Most ranks a vector may hold (the largest ``world_size`` a registration may declare).
MAX_RANKS = 1_000_000
#: From this many ranks on, a vector declared ``precision="float32"`` is sent as float32 even
#: where that rounds its values (7 significant digits). Below it a report is small anyway
#: (~40 KB at 256 ranks with every vector exact) and every value goes exactly.
FLOAT32_FROM_RANKS = 256
_BIG_ENDIAN = sys.byteorder == "big"


class Filled(Sequence[float]):
    """A vector of ``n`` ranks that all hold ``value`` (the ``fill`` form, unexpanded)."""

    __slots__ = ("value", "n")

    def __init__(self, value: float, n: int) -> None:
        if not 0 <= n <= MAX_RANKS:
            raise ValueError(f"a filled vector holds 0..{MAX_RANKS} ranks, not {n}")
        self.value, self.n = float(value), n

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> float: ...
    @overload
    def __getitem__(self, i: slice) -> list[float]: ...

    def __getitem__(self, i: int | slice) -> float | list[float]:
        if isinstance(i, slice):
            return [self.value] * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError("rank out of range")
        return self.value

    def __iter__(self) -> Iterator[float]:
        return iter([self.value] * self.n) if self.n <= 4096 else (self.value for _ in range(self.n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Filled):
            return self.n == other.n and (self.value == other.value or self.value != self.value and other.value != other.value)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Filled({self.value!r}, n={self.n})"


class PackedVector(WireModel):
    """A per-rank vector in binary: exactly one of ``float64``, ``float32`` (base64 of the
    little-endian values, index = global rank) and ``fill`` (with ``n``, the ranks it covers)."""

    float64: str | None = Field(default=None, description="Base64 of the ranks' values as little-endian binary64.")
    float32: str | None = Field(default=None, description="Base64 of the ranks' values as little-endian binary32.")
    fill: Value | None = Field(default=None, description="The value every rank holds (NaN, Infinity as strings).")
    n: Int | None = Field(default=None, ge=0, le=MAX_RANKS, description="With 'fill': how many ranks hold it.")

    @model_validator(mode="after")
    def _one_form(self) -> "PackedVector":
        forms = [name for name in ("float64", "float32", "fill") if getattr(self, name) is not None]
        if len(forms) != 1:
            raise ValueError("a packed vector has exactly one of 'float64', 'float32' and 'fill', "
                             f"not {forms or 'none'}")
        if (forms[0] == "fill") != (self.n is not None):
            raise ValueError("'n' (the number of ranks) goes with 'fill', and only with it")
        return self


def _values(data: str, typecode: str, what: str) -> array:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"'{what}' is not base64 (standard alphabet, padded, nothing else): {e}") from None
    out = array(typecode)
    if len(raw) % out.itemsize:
        raise ValueError(f"'{what}' holds {len(raw)} bytes: not a whole number of {out.itemsize}-byte values "
                         f"({len(raw) % out.itemsize} trailing bytes)")
    if len(raw) // out.itemsize > MAX_RANKS:
        raise ValueError(f"'{what}' holds {len(raw) // out.itemsize} values; a vector holds at most {MAX_RANKS}")
    out.frombytes(raw)
    if _BIG_ENDIAN:
        out.byteswap()
    return out


def unpack(packed: PackedVector) -> array | Filled:
    """A packed vector's values (``ValueError`` with what is wrong for a malformed one)."""
    if packed.fill is not None:
        assert packed.n is not None
        return Filled(packed.fill, packed.n)
    if packed.float64 is not None:
        return _values(packed.float64, "d", "float64")
    assert packed.float32 is not None
    return _values(packed.float32, "f", "float32")


def _b64(values: array) -> str:
    if _BIG_ENDIAN:
        values = array(values.typecode, values)
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


def pack(values: Sequence[float], *, float32: bool = False) -> dict[str, Any] | list[float]:
    """``values`` in their most compact exact form (see the module docstring); ``float32``: the
    vector is declared ``precision="float32"`` (rounded to float32 from :data:`FLOAT32_FROM_RANKS`
    ranks on). An empty vector (absent from the report) stays ``[]``."""
    n = len(values)
    if n == 0:
        return []
    if isinstance(values, Filled):
        return {"fill": values.value, "n": n}
    d = values if isinstance(values, array) and values.typecode == "d" else array("d", values)
    raw = d.tobytes()
    if raw == raw[:8] * n:  # every rank the same, bit for bit (-0.0 is not 0.0)
        return {"fill": d[0], "n": n}
    f = values if isinstance(values, array) and values.typecode == "f" else array("f", d)
    if array("d", f).tobytes() == raw:  # float32 holds every value exactly
        return {"float32": _b64(f)}
    if float32 and n >= FLOAT32_FROM_RANKS and not _overflows(d, f):
        return {"float32": _b64(f)}
    return {"float64": _b64(d)}


def _overflows(d: array, f: array) -> bool:
    """Whether a finite value of ``d`` became an infinity in float32 ``f``."""
    inf = float("inf")
    if inf not in f and -inf not in f:  # (the usual case, in C)
        return False
    return any(abs(x) == inf and abs(y) != inf for x, y in zip(f, d))


def _form(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, (array, Filled)):
        return "decoded"  # (a model built in Python from another's values)
    return "packed"


_NUMBER = {"anyOf": [{"type": "number"}, {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}]}
#: The wire's JSON Schema of a vector (what an agent may send).
_SCHEMA = {"anyOf": [
    {"type": "array", "items": _NUMBER, "description": "One value per rank, index = global rank."},
    {"type": "object", "additionalProperties": False, "required": ["float64"],
     "properties": {"float64": {"type": "string", "contentEncoding": "base64",
                                "description": "The ranks' values as little-endian binary64."}}},
    {"type": "object", "additionalProperties": False, "required": ["float32"],
     "properties": {"float32": {"type": "string", "contentEncoding": "base64",
                                "description": "The ranks' values as little-endian binary32."}}},
    {"type": "object", "additionalProperties": False, "required": ["fill", "n"],
     "properties": {"fill": _NUMBER, "n": {"type": "integer", "minimum": 0, "maximum": MAX_RANKS}},
     "description": "Every one of the n ranks holds the value fill."},
]}


def vector_field(description: str, *, float32: bool) -> Any:
    """The wire field of one per-rank vector: a JSON list or a packed form in; the most compact
    packed form out (JSON), the values as given out (Python)."""
    kind = Annotated[
        Union[Annotated[list[Value], Tag("list")], Annotated[PackedVector, Tag("packed")],
              Annotated[Union[InstanceOf[array], InstanceOf[Filled]], Tag("decoded")]],
        Discriminator(_form),
        AfterValidator(lambda v: unpack(v) if isinstance(v, PackedVector) else v),
        PlainSerializer(lambda v: pack(v, float32=float32), when_used="json"),
        WithJsonSchema(_SCHEMA),
    ]
    return (kind, Field(default_factory=list, description=description))

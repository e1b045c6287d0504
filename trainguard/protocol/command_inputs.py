"""The inputs of an operator command, read from its request model's JSON schema.

The CLI's options (``trainguard grad-clip RUN --max-norm 1.0``) and the console's form fields
(``GET /ui/api/commands``) are both built from :func:`command_inputs`, so a command declared in
:data:`trainguard.protocol.commands.REGISTRY` with a new request model gets its options and
fields without either being edited. ``reason`` is every command's and is not listed.

:func:`validation_message` writes a request model's ``ValidationError`` as one line, the way
the CLI (exit status 2) and the console (HTTP 422) show it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

__all__ = ["CommandInput", "command_inputs", "validation_message"]

InputType = Literal["number", "integer", "boolean", "choice", "text", "list"]


@dataclass(frozen=True, slots=True)
class CommandInput:
    """One field of an operator command's body.

    ``type``: ``number`` (a float), ``integer``, ``boolean``, ``choice`` (one of ``choices``),
    ``text`` or ``list`` (of texts, at most ``max_items``). Bounds as JSON Schema says them:
    ``minimum``/``maximum`` inclusive, ``exclusive_minimum``/``exclusive_maximum`` exclusive.
    ``default`` is None for a field without one (required, or optional with "not given")."""

    name: str
    type: InputType
    required: bool
    description: str = ""
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: float | None = None
    exclusive_maximum: float | None = None
    choices: tuple[str, ...] = ()
    max_items: int | None = None
    max_length: int | None = None

    def as_json(self) -> dict[str, Any]:
        """The field as ``GET /ui/api/commands`` answers it."""
        return {"name": self.name, "type": self.type, "required": self.required, "description": self.description,
                "default": self.default, "minimum": self.minimum, "maximum": self.maximum,
                "exclusive_minimum": self.exclusive_minimum, "exclusive_maximum": self.exclusive_maximum,
                "choices": list(self.choices), "max_items": self.max_items, "max_length": self.max_length}

    @property
    def option(self) -> str:
        """Its command-line option: ``--max-norm``; a list is given once per item, in the singular
        (``--layer a --layer b`` for ``layers``)."""
        name = self.name[:-1] if self.type == "list" and self.name.endswith("s") else self.name
        return "--" + name.replace("_", "-")

    @property
    def metavar(self) -> str:
        """Its value's name in a usage line: ``MAX_NORM``, ``LAYER``."""
        return self.option[2:].upper().replace("-", "_")

    def notes(self) -> str:
        """Its bounds, whether it is required, its default, as one phrase (``in [0, 10]; required``)."""
        return "; ".join(x for x in (self.bounds() and f"in {self.bounds()}", self.required and "required",
                                     self.default not in (None, []) and f"default {self.default}",
                                     self.type == "list" and "once per item") if x)

    def bounds(self) -> str:
        """The bounds as an interval, e.g. ``(0, 10]``; empty without bounds."""
        lo = self.minimum if self.exclusive_minimum is None else self.exclusive_minimum
        hi = self.maximum if self.exclusive_maximum is None else self.exclusive_maximum
        if lo is None and hi is None:
            return ""
        left = "(" if self.exclusive_minimum is not None or lo is None else "["
        right = ")" if self.exclusive_maximum is not None or hi is None else "]"
        return f"{left}{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}{right}"


def _plain(prop: dict[str, Any]) -> dict[str, Any]:
    """An optional field's ``anyOf: [X, null]`` as X."""
    options = prop.get("anyOf")
    if not options:
        return prop
    kept = [o for o in options if o.get("type") != "null"]
    if len(kept) != 1:
        raise TypeError(f"an operator command's field must have one type (or that type or null), got {options}")
    return {**{k: v for k, v in prop.items() if k != "anyOf"}, **kept[0]}


def _input(name: str, prop: dict[str, Any], required: bool) -> CommandInput:
    p = _plain(prop)
    kind = p.get("type")
    common: dict[str, Any] = dict(name=name, required=required, description=p.get("description", ""),
                                  default=None if required else p.get("default"))
    if "enum" in p:
        return CommandInput(type="choice", choices=tuple(str(c) for c in p["enum"]), **common)
    if kind in ("number", "integer"):
        return CommandInput(type=kind, minimum=p.get("minimum"), maximum=p.get("maximum"),
                            exclusive_minimum=p.get("exclusiveMinimum"), exclusive_maximum=p.get("exclusiveMaximum"),
                            **common)
    if kind == "boolean":
        return CommandInput(type="boolean", **common)
    if kind == "string":
        return CommandInput(type="text", max_length=p.get("maxLength"), **common)
    if kind == "array" and p.get("items", {}).get("type") == "string":
        if common["default"] is None and not required:
            common["default"] = []
        return CommandInput(type="list", max_items=p.get("maxItems"), **common)
    raise TypeError(f"an operator command's field {name!r} has a type the CLI and the console cannot offer: {prop}")


def command_inputs(request: type[BaseModel]) -> tuple[CommandInput, ...]:
    """The fields of an operator command's body (``CommandSpec.request``) but ``reason``, in
    declaration order; ``TypeError`` for a field neither a number, an integer, a boolean, a
    choice, a text nor a list of texts."""
    schema = request.model_json_schema()
    required = set(schema.get("required", ()))
    return tuple(_input(name, prop, name in required) for name, prop in schema.get("properties", {}).items()
                 if name != "reason")


def validation_message(error: ValidationError) -> str:
    """A request model's validation errors as one line: ``field: message; ...``."""
    parts = []
    for err in error.errors():
        msg = err["msg"].removeprefix("Value error, ")
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)

"""The one reader of typed JSON: a JSON-shaped document (mappings, lists, scalars; from JSON or YAML) read
into a dataclass by its fields' type annotations. manifest.json (runtime/manifest/types.py) and build
recipes (builder/recipe.py) are both read by it; each words the FieldError it raises in its own error type.

Types: a nested dataclass (or a class with `from_section(data, where)`), `X | None`, `Any`, `tuple[T, ...]`
(item by item), `list[T]` (items of exactly T), `dict[str, T]`, and bool, int, float (an int widens;
`numeric_strings` also takes YAML 1.1's "1e-4"), str."""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

NOT_OBJECT, MISSING, UNKNOWN, MISTYPED, INVALID = "not an object", "missing", "unknown", "mistyped", "invalid"

_hints = functools.cache(typing.get_type_hints)  # a dataclass's field types, resolved once


class FieldError(ValueError):
    """What is wrong at `where`: `kind` (NOT_OBJECT, MISSING, UNKNOWN, MISTYPED or INVALID), the `value` found,
    what was `expected` (a type's name, or the dataclass for NOT_OBJECT), the `key` missing or unknown and
    the keys `allowed`, or the section's own check that failed (`cause`)."""

    def __init__(self, where: str, kind: str, value: Any = None, expected: Any = "", key: str = "",
                 allowed: tuple[str, ...] = (), cause: Exception | None = None):
        super().__init__(f"{where}: {kind}")
        self.where, self.kind, self.value, self.expected = where, kind, value, expected
        self.key, self.allowed, self.cause = key, allowed, cause


def read(cls: type, data: Any, where: str, strict: bool = False, numeric_strings: bool = False) -> Any:
    """An instance of dataclass `cls` from the mapping `data`; `where` names it in errors. `strict`: a key
    that is not a field is an error (else ignored: a newer writer's addition). A check of the dataclass's own
    that raises a plain ValueError or TypeError is INVALID; its own error subclasses pass through."""
    if hasattr(cls, "from_section"):
        return cls.from_section(data, where)
    if not isinstance(data, dict):
        raise FieldError(where, NOT_OBJECT, data, cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if strict and (unknown := sorted(set(data) - set(fields))):
        raise FieldError(where, UNKNOWN, key=unknown[0], allowed=tuple(sorted(fields)))
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = _value(data[name], _hints(cls)[name], f"{where}.{name}".lstrip("."), strict,
                                  numeric_strings)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise FieldError(where, MISSING, key=name)
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        if type(err) not in (TypeError, ValueError):  # the dataclass's own error type, or a FieldError
            raise
        raise FieldError(where, INVALID, cause=err) from None


def _value(value: Any, kind: Any, where: str, strict: bool, numeric_strings: bool) -> Any:
    """`value` checked against the annotation `kind` (tuples, lists, dicts and dataclasses rebuilt)."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in [a for a in args if a is not type(None)]:  # the first that takes the value
            try:
                return _value(value, option, where, strict, numeric_strings)
            except FieldError as err:
                if err.kind != MISTYPED or err.where != where:  # a problem inside the value: say that one
                    raise
        raise FieldError(where, MISTYPED, value, " or ".join(_type_name(a) for a in args))
    if kind is Any:
        return value
    if dataclasses.is_dataclass(kind):
        return read(kind, value, where, strict, numeric_strings)
    if origin is tuple:
        if not isinstance(value, list):
            raise FieldError(where, MISTYPED, value, "a list")
        return tuple(_value(v, args[0], f"{where}[{i}]", strict, numeric_strings) for i, v in enumerate(value))
    if origin is list:
        if not isinstance(value, list) or any(type(v) is not args[0] for v in value):
            raise FieldError(where, MISTYPED, value, _type_name(kind))
        return list(value)
    if origin is dict or kind is dict:
        if not isinstance(value, dict):
            raise FieldError(where, NOT_OBJECT, value, dict)
        inner = args[1] if args else Any
        return {k: _value(v, inner, f"{where}.{k}", strict, numeric_strings) for k, v in value.items()}
    if kind is float and numeric_strings and isinstance(value, str) and _is_number(value):
        return float(value)
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
          isinstance(value, int) and not isinstance(value, bool) if kind is int else isinstance(value, kind))
    if not ok:
        raise FieldError(where, MISTYPED, value, kind.__name__)
    return float(value) if kind is float else value


def _type_name(kind: Any) -> str:
    return getattr(kind, "__name__", str(kind)) if typing.get_origin(kind) is None else str(kind)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

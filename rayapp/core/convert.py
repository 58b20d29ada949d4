"""The one door for outside input: recipes, layouts, dataset rows, HTTP bodies, files on disk.

``convert``/``decode`` turn plain data into typed Structs with msgspec, whose types carry their own
bounds (``Meta(ge=...)``, ``Literal``s); ``check`` puts a Struct that code built (constructors do
not type-check) through the same bounds. A failure becomes one ``InputError`` that names the source,
the JSON path and the offending value:
``recipe "rollout.yaml": $.engines.student.num_replicas: expected int >= 1, got 0``.
Code behind the door trusts its types and checks nothing again.

A Struct's ``__post_init__`` may add a rule the annotations cannot say by raising
``ValueError("$.field: reason")``; the door places that path under the Struct's own.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

T = TypeVar("T")

_AT = re.compile(r" - at `(?:key` in `)?(\$[^`]*)`$")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_EXPECTED = re.compile(r"^Expected `([^`]+)`(?:, got `[^`]+`)?(.*)$", re.S)
_FINITE = f" <= {sys.float_info.max!r}"  # the upper bound that only rejects inf (NaN fails any bound)
_MISSING = object()


class InputError(ValueError):
    """Outside input that does not fit its type: ``source: $.path: reason`` (``source: reason`` when
    the input as a whole is unusable: unreadable, malformed)."""

    def __init__(self, source: str, path: str | None, reason: str):
        self.source, self.path, self.reason = source, path, reason
        super().__init__(f"{source}: {path}: {reason}" if path else f"{source}: {reason}")


def show(value: Any) -> str:
    """A short JSON-ish rendering of an offending value; never recurses, never fails."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):  # str() of a huge int raises past Python's digit limit
        return str(value) if value.bit_length() <= 128 else "a very large integer"
    if isinstance(value, float):
        return repr(value)  # nan and inf as such (JSON encoders write null)
    if isinstance(value, str):
        return json.dumps(value if len(value) <= 40 else value[:40] + "...")
    if isinstance(value, dict):
        return "an object" if value else "{}"
    if isinstance(value, list | tuple):
        return f"an array of {len(value)} item{'s' if len(value) > 1 else ''}" if value else "[]"
    return type(value).__name__


def _at(value: Any, path: str) -> Any:
    """The value at msgspec's ``path`` (``$.a[1].b``) inside ``value``; _MISSING when it cannot be told."""
    for field, index in _STEP.findall(path[1:]):
        try:
            if field:
                value = value[field] if isinstance(value, dict) else getattr(value, field)
            elif index == "...":
                return _MISSING
            else:
                value = value[int(index)]
        except Exception:  # any input at all: a path that does not resolve shows no value
            return _MISSING
    return value


def _choices(type_: Any, path: str) -> str | None:
    """The values a ``Literal`` or enum at ``path`` in ``type_`` allows (msgspec's message names none)."""
    try:
        info = mi.type_info(type_)
        for field, index in _STEP.findall(path[1:]):
            info = _step(info, field, index)
        values = _values(info)
    except Exception:  # any type at all: choices that cannot be told are left out
        return None
    return None if values is None else " or ".join(show(v) for v in values)


def _step(info: Any, field: str, index: str) -> Any:
    while isinstance(info, mi.Metadata | mi.UnionType):  # a union: the one member that has children
        info = info.type if isinstance(info, mi.Metadata) else next(
            t for t in info.types if isinstance(t, mi.StructType | mi.ListType | mi.TupleType | mi.DictType
                                                   | mi.VarTupleType | mi.Metadata))
    if isinstance(info, mi.StructType):
        return next(f.type for f in info.fields if f.encode_name == field)
    if isinstance(info, mi.TupleType):
        return info.item_types[int(index)]
    return info.value_type if isinstance(info, mi.DictType) else info.item_type


def _values(info: Any) -> tuple[Any, ...] | None:
    for t in info.types if isinstance(info, mi.UnionType) else (info,):
        if isinstance(t, mi.LiteralType):
            return t.values
        if isinstance(t, mi.EnumType):
            return tuple(m.value for m in t.cls)
    return None


def _reason(text: str, value: Any, choices: str | None) -> tuple[str, str]:
    """msgspec's message (its ``- at`` suffix removed) as (path below the failing node, reason)."""
    if text.startswith("Object missing required field `"):
        return "." + text.split("`")[1], "missing required field"
    if text.startswith("Object contains unknown field `"):
        return "", f"unknown field {show(text.split('`')[1])}"
    if text.startswith("$") and ": " in text:  # a __post_init__ rule: "$.field: reason"
        path, reason = text.split(": ", 1)
        return path[1:], reason
    if text.startswith("Invalid enum value") and choices is not None:
        return "", f"expected {choices}" + ("" if value is _MISSING else f", got {show(value)}")
    expected = _EXPECTED.match(text)
    if expected:
        want = (expected[1] + expected[2]).replace(f"float{_FINITE}", "finite float").replace(_FINITE, "")
        return "", f"expected {want}" + ("" if value is _MISSING else f", got {show(value)}")
    reason = text.removeprefix("JSON is malformed: ").replace("`", "")
    return "", reason[:1].lower() + reason[1:] + ("" if value is _MISSING else f", got {show(value)}")


def _error(e: msgspec.MsgspecError, value: Any, type_: Any, source: str, root: str,
           error: type[InputError]) -> InputError:
    text = str(e)
    at = _AT.search(text)
    path = at.group(1) if at else "$"
    text = text[: at.start()] if at else text
    choices = _choices(type_, path) if text.startswith("Invalid enum value") else None
    sub, reason = _reason(text, _at(value, path), choices)
    return error(source, root + path[1:] + sub, reason)


def convert(value: Any, type_: type[T] | Any, source: str, *, root: str = "$", strict: bool = True,
            error: type[InputError] = InputError) -> T:
    """``value`` (plain Python data) as ``type_``, or ``error`` naming ``source`` and the path below
    ``root`` (``root`` places a piece inside a larger document: ``$.evaluators[0]``)."""
    try:
        return msgspec.convert(value, type_, strict=strict)
    except msgspec.ValidationError as e:
        raise _error(e, value, type_, source, root, error) from None


def decode(raw: bytes | str, type_: type[T] | Any, source: str, *, fmt: str = "json",
           error: type[InputError] = InputError) -> T:
    """``raw`` (JSON, or msgpack with ``fmt="msgpack"``) decoded straight into ``type_``."""
    module = msgspec.msgpack if fmt == "msgpack" else msgspec.json
    try:
        return module.decode(raw, type=type_)
    except msgspec.ValidationError as e:
        try:  # only to show the offending value; a document too odd to re-read shows none
            plain = module.decode(raw)
        except Exception:  # the value only decorates the message
            plain = _MISSING
        raise _error(e, plain, type_, source, "$", error) from None
    except msgspec.DecodeError as e:
        reason = str(e).removeprefix("JSON is malformed: ").replace("`", "")
        name = "JSON" if fmt == "json" else fmt
        raise error(source, None, f"malformed {name}: {reason[:1].lower()}{reason[1:]}") from None


def check(obj: T, source: str, *, error: type[InputError] = InputError) -> T:
    """``obj``, a Struct built in code, put through its own type's bounds (a constructor checks
    none): the same error as if it had come in as data."""
    try:
        plain = msgspec.to_builtins(obj)
    except TypeError as e:  # a field holding something that is not data at all
        raise error(source, "$", str(e)) from None
    return convert(plain, type(obj), source, error=error)

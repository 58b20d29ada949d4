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
_EXPECTED = re.compile(r"^Expected `([^`]+)`(?:, got `([^`]+)`)?(.*)$", re.S)
_BOUND = re.compile(r"^Expected `(int|float)` [<>]")  # a number of the right type out of its bounds
_MISSING = object()
TOO_DEEP = "nested too deeply"
# The most of one part of a message kept: a 200 KB bad path or key is cut, not echoed whole.
CLIP = 200


def clip(text: str, limit: int = CLIP) -> str:
    """``text`` cut to about ``limit`` characters, with a marker saying how much was left out. Text cut
    once is not cut again (the slack holds the marker), so an error rebuilt from its parts is the same."""
    return text if len(text) <= limit + 40 else f"{text[:limit]}...({len(text) - limit} more characters)"


class InputError(ValueError):
    """Outside input that does not fit its type: ``source: $.path: reason`` (``source: reason`` when
    the input as a whole is unusable: unreadable, malformed)."""

    def __init__(self, source: str, path: str | None, reason: str):
        # Each part cut on its own: a reason lists what is allowed, so it may be longer than a path.
        self.source, self.reason = clip(source), clip(reason, 4 * CLIP)
        self.path = None if path is None else clip(path)
        super().__init__(f"{self.source}: {self.path}: {self.reason}" if path else f"{self.source}: {self.reason}")

    def __reduce__(self) -> tuple[Any, ...]:  # it crosses Ray calls: rebuilt from its parts, not its message
        return type(self), (self.source, self.path, self.reason)


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


def _info(type_: Any, path: str) -> Any:
    """msgspec's description of the type at ``path`` inside ``type_``; None when it cannot be told."""
    try:
        info = mi.type_info(type_)
        for field, index in _STEP.findall(path[1:]):
            info = _step(info, field, index)
    except Exception:  # any type at all: what cannot be told is left out of the message
        return None
    return info


def _step(info: Any, field: str, index: str) -> Any:
    kinds = (mi.StructType | mi.DictType) if field else (mi.ListType | mi.TupleType | mi.VarTupleType | mi.DictType)
    info = _member(info, kinds)
    if isinstance(info, mi.StructType):
        return next(f.type for f in info.fields if f.encode_name == field)
    if isinstance(info, mi.TupleType):
        return info.item_types[int(index)]
    return info.value_type if isinstance(info, mi.DictType) else info.item_type


def _member(info: Any, kinds: Any) -> Any:
    """The member of a (possibly annotated or optional) type that is one of ``kinds``, or None."""
    members = info.types if isinstance(info, mi.UnionType) else (info,)
    for t in members:
        while isinstance(t, mi.Metadata):
            t = t.type
        if isinstance(t, kinds):
            return t
    return None


def _wanted(info: Any) -> str | None:
    """What the type allows, where msgspec's message leaves it out: the values of a Literal or an
    enum, the fields of a Struct, or every bound of a number (msgspec names only the one broken)."""
    t = _member(info, mi.LiteralType | mi.EnumType | mi.StructType | mi.IntType | mi.FloatType)
    if isinstance(t, mi.LiteralType | mi.EnumType):
        values = t.values if isinstance(t, mi.LiteralType) else tuple(m.value for m in t.cls)
        return " or ".join(show(v) for v in values)
    if isinstance(t, mi.StructType):
        return ", ".join(f.encode_name for f in t.fields)
    if isinstance(t, mi.IntType | mi.FloatType):
        finite = t.le == sys.float_info.max
        bounds = [f"{op} {b:g}" if isinstance(b, float) else f"{op} {b}"
                  for op, b in ((">=", t.ge), (">", t.gt), ("<=", None if finite else t.le), ("<", t.lt))
                  if b is not None]
        name = ("finite " if finite else "") + ("int" if isinstance(t, mi.IntType) else "float")
        return " ".join([name, " and ".join(bounds)]) if bounds else name
    return None


def _reason(text: str, value: Any, wanted: str | None) -> tuple[str, str]:
    """msgspec's message (its ``- at`` suffix removed) as (path below the failing node, reason)."""
    got = "" if value is _MISSING else f", got {show(value)}"
    if text.startswith("Object missing required field `"):
        return "." + text.split("`")[1], "missing required field"
    if text.startswith("Object contains unknown field `"):
        return "", f"unknown field {show(text.split('`')[1])}" + (f" (expected {wanted})" if wanted else "")
    if text.startswith("$") and ": " in text:  # a __post_init__ rule: "$.field: reason"
        path, reason = text.split(": ", 1)
        return path[1:], reason
    if wanted and (text.startswith(("Invalid enum value", "Number out of range")) or _BOUND.match(text)):
        return "", f"expected {wanted}{got}"
    expected = _EXPECTED.match(text)
    if expected:  # the value itself when it can be shown, else the type msgspec saw
        got = got or (f", got {expected[2]}" if expected[2] else "")
        return "", f"expected {expected[1]}{expected[3]}{got}"
    reason = text.removeprefix("JSON is malformed: ").replace("`", "")
    return "", reason[:1].lower() + reason[1:] + got


def _error(e: msgspec.MsgspecError, value: Any, type_: Any, source: str, root: str,
           error: type[InputError]) -> InputError:
    text = str(e)
    at = _AT.search(text)
    path = at.group(1) if at else "$"
    text = text[: at.start()] if at else text
    node = _at(value, path)
    if at and at.group(0).startswith(" - at `key`"):  # a mapping's key: show the first that is not a str
        node = next((k for k in node if not isinstance(k, str)), _MISSING) if isinstance(node, dict) else _MISSING
        text += " key"
    wanted = _wanted(_info(type_, path)) if not text.startswith("Expected `") or _BOUND.match(text) else None
    sub, reason = _reason(text, node, wanted)
    return error(source, root + path[1:] + sub, reason)


def convert(value: Any, type_: type[T] | Any, source: str, *, root: str = "$", strict: bool = True,
            error: type[InputError] = InputError) -> T:
    """``value`` (plain Python data) as ``type_``, or ``error`` naming ``source`` and the path below
    ``root`` (``root`` places a piece inside a larger document: ``$.evaluators[0]``)."""
    try:
        return msgspec.convert(value, type_, strict=strict)
    except msgspec.ValidationError as e:
        raise _error(e, value, type_, source, root, error) from None
    except RecursionError:
        raise error(source, root, TOO_DEEP) from None


def decode(raw: bytes | str, type_: type[T] | Any, source: str, *, fmt: str = "json",
           error: type[InputError] = InputError, **options: Any) -> T:
    """``raw`` (JSON, or msgpack with ``fmt="msgpack"``) decoded straight into ``type_``; ``options``
    go to msgspec's decoder (``float_hook``, ...)."""
    module = msgspec.msgpack if fmt == "msgpack" else msgspec.json
    try:
        return module.Decoder(type_, **options).decode(raw) if options else module.decode(raw, type=type_)
    except msgspec.ValidationError as e:
        try:  # only to show the offending value; a document too odd to re-read shows none
            plain = module.decode(raw)
        except Exception:  # the value only decorates the message
            plain = _MISSING
        raise _error(e, plain, type_, source, "$", error) from None
    except msgspec.DecodeError as e:
        reason = str(e).removeprefix("JSON is malformed: ").replace("`", "")
        raise error(source, None, f"malformed {_name(fmt)}: {reason[:1].lower()}{reason[1:]}") from None
    except RecursionError:  # msgspec's own depth guard: a document nested past what it will read
        raise error(source, None, f"malformed {_name(fmt)}: {TOO_DEEP}") from None


def _name(fmt: str) -> str:
    return "JSON" if fmt == "json" else fmt


def check(obj: T, source: str, *, error: type[InputError] = InputError) -> T:
    """``obj``, a Struct built in code, put through its own type's bounds (a constructor checks
    none): the same error as if it had come in as data."""
    try:
        plain = msgspec.to_builtins(obj)
    except TypeError as e:  # a field holding something that is not data at all
        raise error(source, "$", str(e)) from None
    return convert(plain, type(obj), source, error=error)

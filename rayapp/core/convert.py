"""The one door for outside input: recipes, layouts, dataset rows, HTTP bodies, files on disk.

``convert``/``decode`` turn plain data into typed Structs with msgspec, whose types carry their own
bounds (``Meta(ge=...)``, ``Literal``s); a failure becomes one ``InputError`` that names the source
and the JSON path: ``recipe "rollout.yaml": $.engines.student.num_replicas: expected int >= 1, got 0``.
Code behind the door trusts its types and checks nothing again.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_AT = re.compile(r" - at `(\$[^`]*)`$")


class InputError(ValueError):
    """Outside input that does not fit its type: ``source: $.path: reason``."""

    def __init__(self, source: str, path: str, reason: str):
        self.source, self.path, self.reason = source, path, reason
        super().__init__(f"{source}: {path}: {reason}")


def _split(e: msgspec.MsgspecError, root: str) -> tuple[str, str]:
    """msgspec's ``Reason - at `$.a.b``` as (``$.a.b`` under ``root``, ``reason`` in lower case)."""
    text = str(e)
    at = _AT.search(text)
    path = at.group(1) if at else "$"
    reason = text[: at.start()] if at else text
    reason = reason.removeprefix("JSON is malformed: ")
    reason = reason[:1].lower() + reason[1:]
    return root + path[1:], reason.replace("`", "")


def convert(value: Any, type_: type[T] | Any, source: str, *, root: str = "$", strict: bool = True) -> T:
    """``value`` (plain Python data) as ``type_``, or InputError naming ``source`` and the path below
    ``root`` (``root`` places a piece inside a larger document: ``$.evaluators[0]``)."""
    try:
        return msgspec.convert(value, type_, strict=strict)
    except msgspec.ValidationError as e:
        path, reason = _split(e, root)
        raise InputError(source, path, reason) from None


def decode(raw: bytes | str, type_: type[T] | Any, source: str, *, fmt: str = "json") -> T:
    """``raw`` (JSON, or msgpack with ``fmt="msgpack"``) decoded straight into ``type_``."""
    module = msgspec.msgpack if fmt == "msgpack" else msgspec.json
    try:
        return module.decode(raw, type=type_)
    except msgspec.ValidationError as e:
        path, reason = _split(e, "$")
        raise InputError(source, path, reason) from None
    except msgspec.DecodeError as e:
        raise InputError(source, "$", f"malformed {fmt}: {_split(e, '$')[1]}") from None

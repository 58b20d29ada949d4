"""Dataset rows from outside, validated at load time (issue 4).

Guarantees:

- Every row of a JSONL file (plain or ``.gz``) is decoded with msgspec straight into the caller's
  Struct schema; nothing is converted by hand, so a row either matches the schema or is rejected.
- A file with any bad row (malformed JSON, a missing field, a wrong type, a duplicate key field)
  raises exactly one ``DatasetError`` before anything is returned. Its message names the dataset,
  the file, the 1-based line of the first bad row and the field as a JSON path
  (``dataset 'gsm' ("gsm.jsonl") line 3: $.answer: expected int | str, got array``), and says how
  many further rows are bad, so one fix-and-rerun cycle sees the whole extent of the problem.
- Blank lines are skipped but still counted, so line numbers match what an editor shows.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


class DatasetError(ValueError):
    """A dataset could not be loaded; the message names the dataset, the row and the field."""


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<path>\$[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


def describe_error(err: msgspec.MsgspecError) -> tuple[str, str]:
    """(JSON path, message) from a msgspec error. msgspec puts the path at the end of its message
    and leaves the missing field out of it, so both are moved to where a reader looks first."""
    m = _AT.match(str(err))
    assert m is not None  # the pattern matches any string
    msg, path = m["msg"], m["path"] or "$"
    if m["path"] is None and msg.startswith("$") and ": " in msg:  # a schema's own check, "$.field: why"
        own_path, why = msg.split(": ", 1)
        return own_path, why
    missing = _MISSING.match(msg)
    if missing:
        return f"{path}.{missing['field']}", "missing required field"
    if isinstance(err, msgspec.DecodeError) and not isinstance(err, msgspec.ValidationError):
        return "$", f"malformed JSON ({msg})"
    return path, msg[:1].lower() + msg[1:].replace("`", "")


def decode_rows(lines: Iterable[bytes | str], name: str, schema: type[T], *, source: str = "<memory>",
                unique: str | None = None) -> list[T]:
    """Decode JSON lines into ``schema`` rows; one ``DatasetError`` for the first bad row.

    ``unique`` names a field whose values must not repeat (an id): a repeat is a bad row too,
    since two tasks under one id would be merged or overwritten downstream."""
    decoder = msgspec.json.Decoder(schema)
    rows: list[T] = []
    seen: dict[object, int] = {}
    first: str | None = None
    n_bad = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        problem: tuple[str, str] | None = None
        try:
            row = decoder.decode(line)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            problem = describe_error(e)
        else:
            if unique is not None:
                key = str(getattr(row, unique))  # as ids become strings: 1 and "1" collide
                if key in seen:
                    problem = (f"$.{unique}", f"duplicate value {key!r} (first on line {seen[key]})")
                else:
                    seen[key] = lineno
            rows.append(row)
        if problem is not None:
            n_bad += 1
            if first is None:
                first = f"dataset {name!r} ({source!r}) line {lineno}: {problem[0]}: {problem[1]}"
    if first is not None:
        more = f" (and {n_bad - 1} more bad row{'s' if n_bad > 2 else ''})" if n_bad > 1 else ""
        raise DatasetError(first + more)
    if not rows:
        raise DatasetError(f"dataset {name!r} ({source!r}): no rows")
    return rows


def load_jsonl(path: str | Path, name: str, schema: type[T], *, unique: str | None = None) -> list[T]:
    """Read a JSONL file (gzip when it ends in ``.gz``) into validated ``schema`` rows."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as e:  # missing file, unreadable, or a corrupt gzip stream
        raise DatasetError(f"dataset {name!r} ({str(path)!r}): cannot read: {e}") from None
    return decode_rows(raw.splitlines(), name, schema, source=str(path), unique=unique)

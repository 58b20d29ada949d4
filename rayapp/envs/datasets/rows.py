"""Dataset rows from outside, validated at load time.

Guarantees:

- Every row of a JSONL file (plain or ``.gz``) is decoded through the one door (``rayapp.core.convert``)
  straight into the caller's Struct schema; nothing is converted by hand, so a row either matches the
  schema or is rejected.
- A file with any bad row (malformed JSON, a missing field, a wrong type, a duplicate key field)
  raises exactly one ``DatasetError`` before anything is returned. Its message names the dataset,
  the file, the 1-based line of the first bad row and the field as a JSON path
  (``dataset 'gsm' ("gsm.jsonl") line 3: $.answer: expected int | str, got an array of 2 items``), and says how
  many further rows are bad, so one fix-and-rerun cycle sees the whole extent of the problem.
- Blank lines are skipped but still counted, so line numbers match what an editor shows.
- Only a regular file is read (a FIFO or a device is refused at once), never more than
  ``MAX_FILE_BYTES`` of it, and a ``.gz`` file that inflates more than ``MAX_GZIP_RATIO`` times
  (a gzip bomb) is refused once it has passed ``RATIO_FLOOR`` bytes: one ``DatasetError`` each.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO, TypeVar

import msgspec

from rayapp.core.convert import InputError, decode
from rayapp.core.regular_file import open_regular

T = TypeVar("T", bound=msgspec.Struct)

MAX_FILE_BYTES = 4 << 30  # a dataset file past 4 GiB (decompressed) is refused: split it
MAX_GZIP_RATIO = 200  # JSONL compresses 3-20 times; a bomb over 1000
RATIO_FLOOR = 64 << 20  # the ratio is judged only past this many bytes, where it no longer wobbles
_CHUNK = 1 << 20


class DatasetError(InputError):
    """A dataset could not be loaded; the message names the dataset, the row and the field."""


def decode_rows(lines: Iterable[bytes | str], name: str, schema: type[T], *, source: str = "<memory>",
                unique: str | None = None) -> list[T]:
    """Decode JSON lines into ``schema`` rows; one ``DatasetError`` for the first bad row.

    ``unique`` names a field whose values must not repeat (an id): a repeat is a bad row too,
    since two tasks under one id would be merged or overwritten downstream."""
    rows: list[T] = []
    seen: dict[object, int] = {}
    bad: list[DatasetError] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"dataset {name!r} ({source!r}) line {lineno}"
        try:
            row = decode(line, schema, where, error=DatasetError)
        except DatasetError as e:
            bad.append(e)
            continue
        key = None if unique is None else str(getattr(row, unique))  # as ids become strings: 1 and "1" collide
        if key in seen:
            column = next(f.encode_name for f in msgspec.structs.fields(schema) if f.name == unique)
            bad.append(DatasetError(where, f"$.{column}", f"duplicate value {key!r} (first on line {seen[key]})"))
        elif key is not None:
            seen[key] = lineno
        rows.append(row)
    if bad:
        more = f" (and {len(bad) - 1} more bad row{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
        raise DatasetError(bad[0].source, bad[0].path, bad[0].reason + more)
    if not rows:
        raise DatasetError(f"dataset {name!r} ({source!r})", None, "no rows")
    return rows


def load_jsonl(path: str | Path, name: str, schema: type[T], *, unique: str | None = None) -> list[T]:
    """Read a JSONL file (gzip when it ends in ``.gz``) into validated ``schema`` rows."""
    path = Path(path)
    raw = read_file(path, f"dataset {name!r} ({str(path)!r})", gz=path.suffix == ".gz")
    return decode_rows(raw.splitlines(), name, schema, source=str(path), unique=unique)


def read_file(path: Path, where: str, *, gz: bool) -> bytes:
    """The bytes of a dataset file, inflated when ``gz``, within the bounds of the module docstring;
    one DatasetError naming ``where`` otherwise."""
    try:
        f, _ = open_regular(path, MAX_FILE_BYTES)
        with f:
            return _inflate(f, where) if gz else f.read(MAX_FILE_BYTES)
    except DatasetError:  # _inflate's own (too large, a bomb): it names the file already
        raise
    except (OSError, EOFError, zlib.error) as e:  # missing, not a file, unreadable, a corrupt gzip stream
        raise DatasetError(where, None, f"cannot read: {e.strerror if isinstance(e, OSError) and e.strerror else e}") \
            from None
    except ValueError as e:  # a NUL in the path
        raise DatasetError(where, None, f"cannot read: {e}") from None


def _inflate(f: BinaryIO, where: str) -> bytes:
    parts, total = [], 0
    with gzip.GzipFile(fileobj=f, mode="rb") as g:
        while chunk := g.read(_CHUNK):
            total += len(chunk)
            if total > MAX_FILE_BYTES:
                raise DatasetError(where, None, f"more than {MAX_FILE_BYTES} bytes once decompressed: split the file")
            if total > RATIO_FLOOR and total > MAX_GZIP_RATIO * f.tell():
                raise DatasetError(where, None, f"decompresses more than {MAX_GZIP_RATIO} times its size (a gzip "
                                                f"bomb?): refused")
            parts.append(chunk)
    return b"".join(parts)

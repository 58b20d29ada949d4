"""A dataset from a file: JSONL (plain or ``.gz``) or Parquet, its columns mapped onto Tasks.

Guarantees:

- ``FieldMap`` says which column holds what: the prompt (a non-empty string, or a list of chat
  messages with ``role`` and ``content``), the label (any value; ``null``: the rows have none), the
  task type (a non-empty string; unset: the dataset's), the task id (a string or an integer,
  unique; unset: ``<dataset>-<line>``) and the metadata columns copied into each task.
- Every row passes the one door (``rayapp.core.convert``) into a row schema made from the mapping,
  so a row either fits or is rejected; nothing is converted by hand. A file with any bad row raises
  one ``DatasetError`` before anything is returned, naming the dataset, the file, the 1-based line
  (a Parquet file: row) and the column as a JSON path:
  ``dataset 'mine' ("tasks.jsonl") line 3: $.question: missing required field``.
- A file that is missing, unreadable, not a regular file, too large (``rows.MAX_FILE_BYTES``; a
  gzip bomb), of an unknown format, or without rows is one ``DatasetError`` naming the file.
  Reading Parquet needs ``pyarrow`` (the ``files`` extra); without it the error says so.
- Relative paths are read from the working directory of the process that loads the dataset (the
  manager's, on a cluster the head's): give absolute paths, or paths every node shares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from rayapp.core.convert import convert
from rayapp.core.regular_file import open_regular
from rayapp.envs.datasets.rows import MAX_FILE_BYTES, DatasetError, decode_rows, read_file
from rayapp.types import Task, TaskConfig

NonEmpty = Annotated[str, Meta(min_length=1)]
Column = Annotated[str, Meta(min_length=1, description="a column name of the file")]
SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


class ChatMessage(msgspec.Struct, frozen=True):
    role: NonEmpty
    content: str


class FieldMap(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Which column of a dataset file holds what."""

    prompt: Annotated[Column, Meta(description="column of the prompt: a string, or a list of chat messages "
                                               "({role, content})")] = "prompt"
    label: Annotated[Column | None, Meta(description="column of the label the verifier checks against; null: "
                                                     "rows have no label")] = "label"
    task_type: Annotated[Column | None, Meta(description="column of each row's task type (routes it to the "
                                                         "evaluator of that id); unset: the dataset's "
                                                         "task_type, else its env's name")] = None
    task_id: Annotated[Column | None, Meta(description="column of each row's unique id (string or integer); "
                                                       "unset: <dataset>-<line>")] = None
    metadata: Annotated[list[Column], Meta(description="columns copied into each task's metadata")] = []

    def columns(self) -> list[str]:
        """Every column the mapping names, in schema order."""
        named = [self.prompt, self.label, self.task_type, self.task_id]
        return [c for c in named if c is not None] + list(self.metadata)


def repeated_columns(fields: FieldMap) -> list[str]:
    """Columns named twice: one column cannot fill two fields (the recipe refuses it)."""
    columns = fields.columns()
    return sorted({c for c in columns if columns.count(c) > 1})


def row_schema(fields: FieldMap) -> type[msgspec.Struct]:
    """A Struct whose encoded names are the file's columns, so a bad row's path names its column."""
    spec: list[tuple[str, Any]] = [("prompt", NonEmpty | list[ChatMessage])]
    rename = {"prompt": fields.prompt}
    for attr, type_ in (("label", Any), ("task_type", NonEmpty), ("task_id", NonEmpty | int)):
        column = getattr(fields, attr)
        if column is not None:
            spec.append((attr, type_))
            rename[attr] = column
    for i, column in enumerate(fields.metadata):
        spec.append((f"meta_{i}", Any))
        rename[f"meta_{i}"] = column
    return msgspec.defstruct("Row", spec, rename=rename)


def row_task(row: Any, index: int, name: str, fields: FieldMap, task_type: str) -> Task:
    """A row of ``row_schema(fields)`` as a Task; without a task id column its id is ``<name>-<index>``."""
    prompt = row.prompt if isinstance(row.prompt, str) else [msgspec.structs.asdict(m) for m in row.prompt]
    task_id = getattr(row, "task_id", None)
    return Task(f"{name}-{index}" if task_id is None else str(task_id), prompt,
                TaskConfig(getattr(row, "task_type", None) or task_type),
                label=getattr(row, "label", None),
                metadata={column: getattr(row, f"meta_{i}") for i, column in enumerate(fields.metadata)})


def _parquet_rows(path: Path, name: str, schema: type[msgspec.Struct]) -> list[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DatasetError(f"dataset {name!r} ({str(path)!r})", None,
                           "reading Parquet needs pyarrow (pip install 'rayapp[files]')") from None
    try:
        f, _ = open_regular(path, MAX_FILE_BYTES)
        with f:
            records = pq.read_table(f).to_pylist()
    except (OSError, ValueError) as e:  # pyarrow's errors subclass these (ArrowInvalid, ArrowIOError)
        raise DatasetError(f"dataset {name!r} ({str(path)!r})", None, f"cannot read: {e}") from None
    rows, bad = [], []
    for i, record in enumerate(records, start=1):
        try:
            rows.append((i, convert(record, schema, f"dataset {name!r} ({str(path)!r}) row {i}",
                                    error=DatasetError)))
        except DatasetError as e:
            bad.append(e)
    if bad:
        more = f" (and {len(bad) - 1} more bad row{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
        raise DatasetError(bad[0].source, bad[0].path, bad[0].reason + more)
    return rows


def _jsonl_rows(path: Path, name: str, schema: type[msgspec.Struct], unique: str | None) -> list[tuple[int, Any]]:
    raw = read_file(path, f"dataset {name!r} ({str(path)!r})", gz=path.name.endswith(".gz"))
    lines = raw.splitlines()
    rows = decode_rows(lines, name, schema, source=str(path), unique=unique)
    numbers = [i for i, line in enumerate(lines, start=1) if line.strip()]  # blank lines keep their number
    return list(zip(numbers, rows, strict=True))


def load_file(path: str | Path, name: str, fields: FieldMap, *, task_type: str) -> list[Task]:
    """The tasks of a JSONL or Parquet file, one per row; ``task_type`` for rows whose mapping
    names no task-type column. One DatasetError for the first bad row (module docstring)."""
    path = Path(path)
    where = f"dataset {name!r} ({str(path)!r})"
    if not path.name.endswith(SUFFIXES):
        raise DatasetError(where, None, f"unknown format: expected a file ending in {', '.join(SUFFIXES)}")
    schema = row_schema(fields)
    unique = "task_id" if fields.task_id is not None else None
    if path.name.endswith(".parquet"):
        rows = _parquet_rows(path, name, schema)
        _check_unique(rows, unique, where)
    else:
        rows = _jsonl_rows(path, name, schema, unique)
    if not rows:
        raise DatasetError(where, None, "no rows")
    return [row_task(row, i, name, fields, task_type) for i, row in rows]


def _check_unique(rows: list[tuple[int, Any]], unique: str | None, where: str) -> None:
    if unique is None:
        return
    seen: dict[str, int] = {}
    for i, row in rows:
        key = str(getattr(row, unique))
        if key in seen:
            column = msgspec.structs.fields(type(row))
            encoded = next(f.encode_name for f in column if f.name == unique)
            raise DatasetError(f"{where} row {i}", f"$.{encoded}",
                               f"duplicate value {key!r} (first on row {seen[key]})")
        seen[key] = i

"""The cluster layout (spec §3): ``--env-cluster-layout`` read into ``{node: NodeSpec}``.

The layout is inline JSON, a file path, or an already-parsed dict. Each node is a GPU-id list
(shorthand) or a full ``{"gpus", "cpu", "memory_gb"}`` object; a missing cpu / memory_gb falls back to
``--env-num-cpus`` / ``--env-memory-gb``. No layout at all means no global pool: batches launch ungated.

What this module guarantees:

- ``parse_cluster_layout`` returns ``None`` (no layout) or a non-empty ``dict[str, NodeSpec]`` whose
  GPU ids are distinct ints >= 0 per node, whose cpu / memory_gb are finite floats >= 0, and whose every
  node offers something (a GPU, a CPU or memory).
- Any other outcome is exactly one ``LayoutError`` and nothing else (no KeyError, UnicodeError,
  RecursionError or msgspec error escapes). Its message names the source and where it went wrong::

      cluster layout "a.json": $.10.0.0.3.cpu: expected number, got "x"
      cluster layout "<inline>": malformed JSON: invalid character (byte 5)
      cluster layout "a.json": cannot read file: No such file or directory

  The source is the path as given, ``<inline>`` for inline JSON or a dict, or ``source_name``. Node
  names go into the JSON path after a dot as they are, even when they contain dots (node IPs do);
  only a name with unprintable characters is JSON-quoted there.

Pure Python: never imports ray, so the CLI can reject a bad layout before any cluster starts.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import msgspec

from rayapp.types import NodeSpec


class LayoutError(ValueError):
    """A cluster layout (or one of its defaults) that cannot be used; the message says why."""


_GpuId = Annotated[int, msgspec.Meta(ge=0)]
# The upper bound rejects inf (msgspec lets inf through ``ge=0``); NaN already fails ``ge``.
_Amount = Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)]


class _FullNode(msgspec.Struct, forbid_unknown_fields=True):
    gpus: list[_GpuId] = []
    # UNSET, not 0.0: an omitted field takes the CLI default, an explicit 0 stays 0.
    cpu: _Amount | msgspec.UnsetType = msgspec.UNSET
    memory_gb: _Amount | msgspec.UnsetType = msgspec.UNSET


_NodeForm = list[_GpuId] | _FullNode
_FIELDS = _FullNode.__struct_fields__
# float_hook=float turns an overflowing literal (1e400) into inf instead of failing inside decode with
# a path that names no node; the node check then reports it at its real path.
_DECODER = msgspec.json.Decoder(float_hook=float)
_AT = re.compile(r" - at `\$(.*)`$")  # msgspec's error suffix, e.g. " - at `$.gpus[1]`"
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")
_BOM = b"\xef\xbb\xbf"


def parse_cluster_layout(
    value: Any,
    default_cpus: float = 0.0,
    default_memory_gb: float = 0.0,
    *,
    source_name: str | None = None,
) -> dict[str, NodeSpec] | None:
    """Read and validate a cluster layout; ``None`` when none is given (batches launch ungated)."""
    blank = value is None or (isinstance(value, str) and not value.strip())
    inline = value.strip().startswith("{") if isinstance(value, str) else not isinstance(value, os.PathLike)
    source = source_name or (None if blank else "<inline>" if inline else os.fsdecode(value))
    # Defaults are checked even without a layout: a bad flag is an error whether or not it is used.
    cpus = _default(default_cpus, "--env-num-cpus", source)
    memory_gb = _default(default_memory_gb, "--env-memory-gb", source)
    if blank:
        return None
    if isinstance(value, str) and inline:
        data = _decode(value.strip(), source)
    elif inline:
        data = value  # already parsed (a dict, or something that is not one and fails below)
    else:
        data = _decode(_read(value, source), source)
    return _nodes(data, cpus, memory_gb, source)


def _error(source: str | None, where: str | None, reason: str) -> LayoutError:
    head = f'cluster layout "{source}"' if source else "cluster layout"
    return LayoutError(f"{head}: {where}: {reason}" if where else f"{head}: {reason}")


def _default(value: Any, flag: str, source: str | None) -> float:
    # Compared, not converted: math.isfinite(10**400) raises OverflowError; NaN fails both bounds.
    if _is_number(value) and 0 <= value <= sys.float_info.max:
        return float(value)
    raise _error(source, flag, _expect(value, number=True))


def _read(path: Any, source: str | None) -> bytes:
    try:
        raw = Path(path.strip() if isinstance(path, str) else path).read_bytes()
    except OSError as e:
        raise _error(source, None, f"cannot read file: {e.strerror or e}") from None
    except ValueError as e:  # an embedded NUL in the path
        raise _error(source, None, f"cannot read file: {e}") from None
    raw = raw.removeprefix(_BOM)  # editors on Windows write one; it is not JSON
    if not raw.strip():
        raise _error(source, None, "file is empty")
    return raw


def _decode(text: str | bytes, source: str | None) -> Any:
    try:
        data = _DECODER.decode(raw := text.encode() if isinstance(text, str) else text)
        dup = _duplicate_key(raw)
        if dup is None:
            return data
        reason = f"duplicate key {_show(dup)}: each node and field may appear once"
    except UnicodeEncodeError as e:  # a lone surrogate in inline text has no UTF-8 form
        reason = f"malformed JSON: {e.reason} (character {e.start})"
    except msgspec.DecodeError as e:  # ValidationError too: an integer literal too long to hold
        reason = "malformed JSON: " + _lower(_AT.sub("", str(e)).removeprefix("JSON is malformed: "))
    except RecursionError:
        reason = "malformed JSON: nested too deeply"
    raise _error(source, None, reason)


def _duplicate_key(raw: bytes) -> str | None:
    """msgspec keeps the last of repeated keys without a word; a second parse finds them, so a node
    written twice is reported instead of lost."""
    found: list[str] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen and not found:
                found.append(key)
            seen.add(key)
        return dict(pairs)

    try:
        json.loads(raw, object_pairs_hook=pairs_hook)
    except (ValueError, RecursionError):  # msgspec accepted it; stdlib quirks say nothing about keys
        return None
    return found[0] if found else None


def _nodes(data: Any, cpus: float, memory_gb: float, source: str | None) -> dict[str, NodeSpec]:
    if not isinstance(data, dict):
        raise _error(source, "$", f"expected an object mapping node names to nodes, got {_show(data)}")
    if not data:
        raise _error(source, "$", "expected at least one node, got {}")
    layout: dict[str, NodeSpec] = {}
    for name, raw in data.items():
        if not isinstance(name, str) or not name:
            raise _error(source, "$", f"expected node names to be non-empty strings, got {_show(name)}")
        where = "$." + (name if name.isprintable() else json.dumps(name))
        # Unknown keys are checked here rather than left to msgspec, whose error for them names
        # neither a JSON path for the key nor (for a non-string key) the key itself.
        for field in raw if isinstance(raw, dict) else ():
            if field not in _FIELDS:
                reason = f"unknown field {_show(field)} (expected gpus, cpu, memory_gb)"
                raise _error(source, where, reason)
        try:
            node = msgspec.convert(raw, _NodeForm)
        except msgspec.ValidationError as e:
            at = _AT.search(str(e))
            rel = at.group(1) if at else ""
            raise _error(source, where + rel, _why(rel, raw)) from None
        full = isinstance(node, _FullNode)
        gpus = node.gpus if full else node
        cpu = cpus if not full or node.cpu is msgspec.UNSET else node.cpu
        mem = memory_gb if not full or node.memory_gb is msgspec.UNSET else node.memory_gb
        seen: set[int] = set()
        for i, gpu in enumerate(gpus):
            if gpu in seen:
                raise _error(source, f"{where}{'.gpus' if full else ''}[{i}]", f"duplicate GPU id {gpu}")
            seen.add(gpu)
        if not gpus and cpu == 0 and mem == 0:
            # It could never admit anything, so it is surely a mistake (often missing defaults).
            raise _error(source, where, "node offers nothing (no gpus, cpu 0, memory_gb 0)")
        layout[name] = NodeSpec(gpus=tuple(gpus), cpu=float(cpu), memory_gb=float(mem))
    return layout


def _why(rel: str, node: Any) -> str:
    """The reason for a msgspec failure at ``rel`` inside ``node``, told from the offending value."""
    steps = _STEP.findall(rel)
    value = node
    for field, index in steps:
        value = value[field] if field else list(value)[int(index)]
    field, index = steps[-1] if steps else ("", "")
    if index:
        return _expect(value, number=False)
    if field == "gpus":
        return f"expected a list of GPU ids, got {_show(value)}"
    if field:  # cpu or memory_gb
        return _expect(value, number=True)
    return f"expected a list of GPU ids or an object, got {_show(value)}"


def _expect(value: Any, *, number: bool) -> str:
    # The wrong type gets the bare type name (as in the spec's example); a right type out of range
    # gets the range it must fall in.
    if number:
        want = "a finite number >= 0" if _is_number(value) else "number"
    else:
        want = "integer >= 0" if isinstance(value, int) and not isinstance(value, bool) else "integer"
    return f"expected {want}, got {_show(value)}"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(value: Any) -> str:
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
        return "an array" if value else "[]"
    return type(value).__name__


def _lower(text: str) -> str:
    return text[:1].lower() + text[1:]

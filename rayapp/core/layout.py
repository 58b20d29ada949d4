"""The cluster layout (docs/scheduler.md §3): ``--env-cluster-layout`` read into ``{node: NodeSpec}``.

It exists so the pool knows what it may hand out on each node, and so a bad layout is refused before
any cluster starts. The layout is inline JSON (a string starting with ``{``, ``[`` or ``"``), a file
path, or a parsed dict; each node a GPU-id list or a ``{"gpus", "cpu", "memory_gb"}`` object, a
missing cpu / memory_gb taken from ``--env-num-cpus`` / ``--env-memory-gb``; no layout means no
global pool. Invariant: ``parse_cluster_layout`` returns None or a valid non-empty layout, and
anything else is exactly one ``LayoutError`` naming the source, the JSON path and the value (nodes go
through ``rayapp.core.convert``, where outside input is checked). Forms and messages:
docs/cluster.md, "The cluster layout". Pure Python: never imports ray.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import msgspec

from rayapp.core.convert import InputError, convert, decode, show
from rayapp.core.regular_file import read_regular
from rayapp.core.units import CPU_UNIT, MEM_UNIT
from rayapp.types import FINITE, MAX_GPU_ID, NodeSpec


class LayoutError(InputError):
    """A cluster layout (or one of its defaults) that cannot be used; the message says why."""


_GpuId = Annotated[int, msgspec.Meta(ge=0, le=MAX_GPU_ID)]
_Amount = Annotated[float, msgspec.Meta(ge=0, le=FINITE)]  # the bounds NodeSpec's cpu and memory_gb carry
# The pool counts cpu and memory in integer units: an amount whose units overflow a float is refused here.
_MOST = {"cpu": FINITE / CPU_UNIT, "memory_gb": FINITE / MEM_UNIT}
# Inline JSON starts with one of these (after blanks); anything else is a file path.
_JSON_START = ("{", "[", '"')


class _FullNode(msgspec.Struct, forbid_unknown_fields=True):
    gpus: list[_GpuId] = []
    # UNSET, not 0.0: an omitted field takes the CLI default, an explicit 0 stays 0.
    cpu: _Amount | msgspec.UnsetType = msgspec.UNSET
    memory_gb: _Amount | msgspec.UnsetType = msgspec.UNSET


_NodeForm = list[_GpuId] | _FullNode
# float_hook=float turns an overflowing literal (1e400) into inf instead of failing inside decode with
# a path that names no node; the node's conversion then reports it at its real path.
_BOM = b"\xef\xbb\xbf"
MAX_LAYOUT_BYTES = 16 << 20  # thousands of nodes fit in a MB; more is not a layout (and is not read)


def parse_cluster_layout(
    value: Any,
    default_cpus: float = 0.0,
    default_memory_gb: float = 0.0,
    *,
    source_name: str | None = None,
) -> dict[str, NodeSpec] | None:
    """Read and validate a cluster layout; ``None`` when none is given (batches launch ungated)."""
    blank = value is None or (isinstance(value, str) and not value.strip())
    inline = is_inline(value)
    source = source_name or (None if blank else "<inline>" if inline else os.fsdecode(value))
    head = f'cluster layout "{source}"' if source else "cluster layout"
    # Defaults are checked even without a layout: a bad flag is an error whether or not it is used.
    cpus = convert(default_cpus, _Amount, head, root="--env-num-cpus", error=LayoutError)
    memory_gb = convert(default_memory_gb, _Amount, head, root="--env-memory-gb", error=LayoutError)
    _fits(cpus, "cpu", "--env-num-cpus", head)
    _fits(memory_gb, "memory_gb", "--env-memory-gb", head)
    if blank:
        return None
    if isinstance(value, str) and inline:
        data = _decode(value.strip(), head)
    elif inline:
        data = value  # already parsed (a dict, or something that is not one and fails below)
    else:
        data = _decode(_read(value, head), head)
    return _nodes(data, cpus, memory_gb, head)


def is_inline(value: Any) -> bool:
    """Whether ``value`` is the layout itself (a mapping, or text that starts as JSON does) rather than
    a file path: a string is JSON by its first character, never by whether a file of that name exists."""
    return value.lstrip().startswith(_JSON_START) if isinstance(value, str) else not isinstance(value, os.PathLike)


def _read(path: Any, head: str) -> bytes:
    try:
        raw = read_regular(path.strip() if isinstance(path, str) else path, MAX_LAYOUT_BYTES)
    except OSError as e:
        raise LayoutError(head, None, f"cannot read file: {e.strerror or e}") from None
    except ValueError as e:  # an embedded NUL in the path
        raise LayoutError(head, None, f"cannot read file: {e}") from None
    raw = raw.removeprefix(_BOM)  # editors on Windows write one; it is not JSON
    if not raw.strip():
        raise LayoutError(head, None, "file is empty")
    return raw


def _decode(text: str | bytes, head: str) -> Any:
    try:
        raw = text.encode() if isinstance(text, str) else text
    except UnicodeEncodeError as e:  # a lone surrogate in inline text has no UTF-8 form
        raise LayoutError(head, None, f"malformed JSON: {e.reason} (character {e.start})") from None
    data = decode(raw, Any, head, error=LayoutError, float_hook=float)
    dup = _duplicate_key(raw)
    if dup is not None:  # msgspec keeps the last of repeated keys without a word
        raise LayoutError(head, None, f"duplicate key {show(dup)}: each node and field may appear once")
    return data


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


def _fits(amount: Any, field: str, path: str, head: str) -> None:
    if amount is not msgspec.UNSET and amount > _MOST[field]:
        raise LayoutError(head, path, f"expected at most {_MOST[field]:g}, got {amount!r}")


def _no_set(raw: Any, where: str, head: str) -> None:
    """GPU ids come as a list: a set has no order, so the ids a node lists would not be the ones it uses
    (msgspec would take one as an array)."""
    gpus, at = (raw.get("gpus"), f"{where}.gpus") if isinstance(raw, dict) else (raw, where)
    if isinstance(gpus, set | frozenset):
        raise LayoutError(head, at, f"expected an array of GPU ids, got a set of {len(gpus)}")


def _nodes(data: Any, cpus: float, memory_gb: float, head: str) -> dict[str, NodeSpec]:
    if not isinstance(data, dict):
        raise LayoutError(head, "$", f"expected an object mapping node names to nodes, got {show(data)}")
    if not data:
        raise LayoutError(head, "$", "expected at least one node, got {}")
    layout: dict[str, NodeSpec] = {}
    for name, raw in data.items():
        if not isinstance(name, str) or not name:
            raise LayoutError(head, "$", f"expected node names to be non-empty strings, got {show(name)}")
        # The node's name goes into the path as it is (node IPs hold dots), JSON-quoted only when unprintable.
        where = "$." + (name if name.isprintable() else json.dumps(name))
        _no_set(raw, where, head)
        node = convert(raw, _NodeForm, head, root=where, error=LayoutError)
        full = isinstance(node, _FullNode)
        gpus = node.gpus if full else node
        cpu = cpus if not full or node.cpu is msgspec.UNSET else node.cpu
        mem = memory_gb if not full or node.memory_gb is msgspec.UNSET else node.memory_gb
        if full:
            _fits(node.cpu, "cpu", f"{where}.cpu", head)
            _fits(node.memory_gb, "memory_gb", f"{where}.memory_gb", head)
        duplicate = next((i for i, gpu in enumerate(gpus) if gpu in gpus[:i]), None)
        if duplicate is not None:
            raise LayoutError(head, f"{where}{'.gpus' if full else ''}[{duplicate}]",
                              f"duplicate GPU id {gpus[duplicate]}")
        if not gpus and cpu == 0 and mem == 0:
            # It could never admit anything, so it is surely a mistake (often missing defaults).
            raise LayoutError(head, where, "node offers nothing (no gpus, cpu 0, memory_gb 0)")
        layout[name] = NodeSpec(gpus=tuple(gpus), cpu=float(cpu), memory_gb=float(mem))
    return layout

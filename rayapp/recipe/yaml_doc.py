"""A recipe file read as YAML with bounds, so a crafted file is one clear error, never a crash or a hang.

PyYAML alone takes a file at its word: the last of two equal keys silently wins, a list nested
thousands deep overflows its recursive composer (RecursionError), aliases expand without limit
(a "billion laughs" file takes seconds here and forever in Serve's own parse), an anchor may hold
itself, and a FIFO or ``/dev/urandom`` given as the recipe is read forever. ``read_yaml`` refuses
each of these before anything is built:

- only a regular file of at most ``MAX_BYTES`` is opened (non-blocking, so a FIFO never waits);
- one streaming pass over PyYAML's events (its parser keeps a stack, not the call stack) checks the
  nesting depth, the number of aliases and the size of the document with every alias expanded, an
  alias used inside its own anchor, and repeated keys, each named by its JSON path;
- only then is the document composed and built (``yaml.SafeLoader``: plain data, no objects).
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from rayapp.core.regular_file import read_regular

MAX_BYTES = 1 << 20  # a recipe is a few KB; a MB is already a mistake
MAX_DEPTH = 64  # the deepest shipped recipe nests 7 levels
MAX_ALIASES = 64  # each alias re-uses a node: enough for shared sections, too few for a bomb
MAX_NODES = 100_000  # scalars and collections with every alias expanded


class YamlError(ValueError):
    """A file that is not a bounded, unambiguous YAML document: (JSON path or None, reason)."""

    def __init__(self, path: str | None, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}" if path else reason)


class _Frame:
    """An open collection: its kind, the key or index in hand, the keys seen, its anchor and the
    nodes counted before it (an anchor's expanded size is the difference at its end)."""

    def __init__(self, kind: str, anchor: str | None = None, before: int = 0):
        self.kind, self.anchor, self.before = kind, anchor, before
        self.at: Any = None
        self.want_key = False
        self.keys: set[str] = set()


class _Scan:
    """The bounds of the module docstring, checked over one document's events."""

    def __init__(self) -> None:
        self.stack: list[_Frame] = [_Frame("doc")]
        self.sizes: dict[str, int] = {}  # anchor -> nodes it expands to
        self.nodes = self.aliases = 0

    def where(self) -> str:
        path = "$"
        for f in self.stack[1:]:
            if f.kind == "map" and f.at is not None:
                path += f".{f.at}"
            elif f.kind == "seq" and f.at is not None:
                path += f"[{f.at}]"
        return path

    def enter(self) -> bool:
        """Count a node in its parent; True when it is a mapping's key."""
        f = self.stack[-1]
        if f.kind == "seq":
            f.at = 0 if f.at is None else f.at + 1
        elif f.kind == "map":
            f.want_key = not f.want_key
            return f.want_key
        return False

    def event(self, ev: yaml.Event) -> None:
        if isinstance(ev, yaml.AliasEvent):
            self.alias(ev)
        elif isinstance(ev, yaml.ScalarEvent):
            self.scalar(ev)
        elif isinstance(ev, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            self.start(ev)
        elif isinstance(ev, yaml.SequenceEndEvent | yaml.MappingEndEvent):
            f = self.stack.pop()
            if f.anchor:
                self.sizes[f.anchor] = self.nodes - f.before + 1
        if self.nodes > MAX_NODES:
            raise YamlError(self.where(), f"more than {MAX_NODES} values with aliases expanded")

    def alias(self, ev: yaml.AliasEvent) -> None:
        self.aliases += 1
        if self.enter():
            self.stack[-1].at = f"*{ev.anchor}"
        if any(f.anchor == ev.anchor for f in self.stack):
            raise YamlError(self.where(), f"alias *{ev.anchor} inside its own anchor (a recursive document)")
        if self.aliases > MAX_ALIASES:
            raise YamlError(self.where(), f"more than {MAX_ALIASES} aliases")
        self.nodes += self.sizes.get(ev.anchor, 1)

    def scalar(self, ev: yaml.ScalarEvent) -> None:
        self.nodes += 1
        if ev.anchor:
            self.sizes[ev.anchor] = 1
        if not self.enter():
            return
        f = self.stack[-1]
        f.at = ev.value
        if ev.value in f.keys and ev.value != "<<":  # "<<" merges: it may repeat
            raise YamlError(self.where(), f"duplicate key (again on line {ev.start_mark.line + 1}): the later one "
                                          f"would silently replace the earlier")
        f.keys.add(ev.value)

    def start(self, ev: yaml.SequenceStartEvent | yaml.MappingStartEvent) -> None:
        self.nodes += 1
        if self.enter():
            raise YamlError(self.where(), "a key that is a collection (keys are plain names)")
        if len(self.stack) > MAX_DEPTH:
            raise YamlError(self.where(), f"nested deeper than {MAX_DEPTH} levels")
        kind = "seq" if isinstance(ev, yaml.SequenceStartEvent) else "map"
        self.stack.append(_Frame(kind, ev.anchor, self.nodes))


def check_events(text: str) -> None:
    """The bounds of the module docstring over ``text``'s events; one YamlError for the first breach."""
    scan = _Scan()
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(ev, yaml.DocumentStartEvent):
            scan = _Scan()
        scan.event(ev)


def read_yaml(path: str | os.PathLike) -> Any:
    """The YAML document in ``path`` as plain data. OSError: the file cannot be read (or is not a
    regular file of at most MAX_BYTES); YamlError: malformed or past a bound, with the JSON path."""
    raw = read_regular(path, MAX_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise YamlError(None, f"malformed YAML: not UTF-8 text (byte {e.start})") from None
    try:
        check_events(text)
        return yaml.load(text, Loader=yaml.SafeLoader)
    except YamlError:
        raise
    except yaml.YAMLError as e:
        raise YamlError(None, f"malformed YAML: {' '.join(str(e).split())}") from None
    except ValueError as e:  # a scalar PyYAML cannot build: an integer past Python's 4300 digits
        raise YamlError(None, f"malformed YAML: {e}") from None
    except RecursionError:  # past MAX_DEPTH the events refuse it first; this is the last guard
        raise YamlError(None, f"malformed YAML: nested deeper than {MAX_DEPTH} levels") from None

"""Crash-safe whole-file writing: a reader finds the old version of a file or the new one, never a
mix, whenever the writing process dies or the machine loses power.

``atomic_write`` writes a temp file in the target's folder, fsyncs it, renames it over the target
(``os.replace`` is atomic within one file system) and fsyncs the folder so the rename survives too.
A failure of any of these (a full disk, a read-only folder) is one ``WriteError`` that names what was
being written and where, e.g. ``writing step result /ckpt/step_results/rollout_000003.msgpack: No
space left on device``; it is an OSError with the cause's errno.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


class WriteError(OSError):
    """A whole-file write that failed: the operation, the path and the cause's message."""

    def __init__(self, what: str, path: Path, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.what, self.path = what, path

    def __str__(self) -> str:
        return f"writing {self.what} {self.path}: {self.strerror}"

    def __reduce__(self) -> tuple:  # so that it crosses a process boundary (Ray) as itself
        return WriteError, (self.what, self.path, OSError(self.errno, self.strerror))


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened, as on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any], what: str = "file") -> Path:
    """Run ``write(f)`` into a temp file next to ``path``, fsync, rename it over ``path``. Whatever
    ``write`` raises, the temp file is removed and ``path`` is left as it was; an OSError comes out
    as a ``WriteError`` naming ``what`` and ``path``. A killed process may leave a ``.{name}.*.tmp``
    file behind, never a damaged ``path``."""
    path = Path(path)
    tmp: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        fsync_dir(path.parent)
    except WriteError:
        raise
    except OSError as e:
        raise WriteError(what, path, e) from e
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return path

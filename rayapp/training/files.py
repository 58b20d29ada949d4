"""Crash-safe whole-file writing: a reader finds the old version of a file or the new one, never a
mix, whenever the writing process dies or the machine loses power.

``atomic_write`` writes a temp file in the target's folder, fsyncs it, renames it over the target
(``os.replace`` is atomic within one file system) and fsyncs the folder so the rename survives too.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


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


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], Any]) -> Path:
    """Run ``write(f)`` into a temp file next to ``path``, fsync, rename it over ``path``. Whatever
    ``write`` raises, the temp file is removed and ``path`` is left as it was. A killed process
    may leave a ``.{name}.*.tmp`` file behind, never a damaged ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path

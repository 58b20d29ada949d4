"""Files named by outside input (a recipe, a layout, a dataset), opened so a crafted path cannot
hang or exhaust the reader: only a regular file is read, opened non-blocking (a FIFO is refused
at once instead of waiting for a writer; ``/dev/urandom`` is refused instead of read forever), and
never more than a bound the caller names."""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO


def open_regular(path: str | os.PathLike, limit: int) -> tuple[BinaryIO, int]:
    """``path`` opened for reading, with its size: OSError with a strerror that says why when it is
    not a regular file or holds more than ``limit`` bytes (ValueError: a NUL in the path)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fsdecode(path))
        if not stat.S_ISREG(info.st_mode):
            raise OSError(0, "not a regular file (only regular files are read)")
        if info.st_size > limit:
            raise OSError(0, f"{info.st_size} bytes, more than the {limit} read")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of ``path`` (``open_regular``'s refusals), never more than ``limit`` of them."""
    f, _ = open_regular(path, limit)
    with f:
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew while read
        raise OSError(0, f"more than the {limit} bytes read")
    return data

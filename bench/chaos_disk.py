"""The chaos run's "disk full mid-step" fault (``bench/chaos.py --faults disk``) and its check that a
repeated step id is answered as before.

The disk is faked in the manager replica's own process, so the bench needs no privileges: while it is
"full", every write to a file opened under the step results' folder fails with ENOSPC, as on a full
file system; other files are untouched. It fills until one such write failed (a step's result), then
frees, and the driver kills the manager replica, as in a restart. Linux: a file's path is read from
``/proc/self/fd``.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray


async def fill_disk(folder: str, wait_s: float) -> float | None:
    """Fill the disk under ``folder`` until a write there failed (or ``wait_s`` passed): the time it
    filled (monotonic), or None when no write came meanwhile. Call it in the process that writes."""
    failed, real = threading.Event(), os.fdopen

    def fdopen(fd, *args, **kwargs):
        f = real(fd, *args, **kwargs)
        return _FullFile(f, failed) if os.readlink(f"/proc/self/fd/{fd}").startswith(folder) else f

    at = time.monotonic()
    os.fdopen = fdopen
    try:
        while not failed.is_set() and time.monotonic() < at + wait_s:
            await asyncio.sleep(0.05)
    finally:
        os.fdopen = real
    return at if failed.is_set() else None


class _FullFile:
    """A file on a full disk: each write fails with ENOSPC (and says so to ``failed``)."""

    def __init__(self, f: Any, failed: threading.Event):
        self._f, self._failed = f, failed

    def write(self, data: bytes) -> int:
        self._failed.set()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _FullFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def disk_full(manager: Any, manager_replica: Callable[[], Any], wait_s: float) -> float | None:
    """The fault, from the driver: a full disk under the manager's step results until a step's result
    failed to be written, then the manager replica killed (Serve starts a new one). The fill's time,
    or None when no step wrote within ``wait_s``."""
    at = manager.fill_disk.remote(wait_s).result(timeout_s=wait_s + 30)
    if at is not None:
        ray.kill(manager_replica())
    return at


def repeats_differ(manager: Any, results: dict[int, Any], timeout_s: float) -> int:
    """Ask for every completed step again: how many answers differ from the first one received (each
    sample's response holds a nonce of its run, so a step run again is told apart)."""
    def samples(result: Any) -> list[tuple]:
        return [(s.task_id, s.index, s.response) for g in result.groups for s in g]
    return sum(samples(manager.generate.remote(rid).result(timeout_s=timeout_s)) != samples(first)
               for rid, first in results.items())

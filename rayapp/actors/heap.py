"""Freed memory back to the OS after each step: glibc's ``malloc_trim``.

A step allocates and frees tens of MB in the manager replica (samples, token lists, the tokenizer's
encodings, Ray's messages) from several threads: Serve's request loop, Ray's own, the ``to_thread``
workers. glibc keeps what they free in per-thread arenas for reuse, and a fragmented arena is
seldom given back: the replica's resident memory crept up 0.2-0.6 MB a step over 100-200 steps
while the Python heap stayed flat (tracemalloc over steps 15-75 of the local recipe). With
``malloc_trim(0)`` after each step the same run is flat (``bench/replica_memory.py``). The trim
walks the arenas (about 20 ms for 200 MB) in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import sys
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where there is none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Return the C heap's free pages to the OS; whether this platform could."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


def trim_soon() -> None:
    """``trim_heap`` in a worker thread, not awaited: a step's end neither waits for it nor, when the
    step is cancelled, skips it."""
    asyncio.get_running_loop().run_in_executor(None, trim_heap)

"""Run one spawned process to completion under a wall clock, keeping a bounded amount of output.

Guarantees of ``communicate``: it returns within ``wall_s`` + a few seconds of grace whatever the
process does; ``kill()`` (the caller's way to kill the whole process group) runs when the wall clock
expires, when the process exits (so nothing it left in the background keeps the pipes open or
outlives it) and when the awaiting task is cancelled; the process is reaped; at most ``cap`` bytes of
stdout and of stderr are kept, the rest is read and dropped so the writer never blocks on a full pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

_CHUNK = 1 << 16
# After the process exits and its group is killed, pipes normally close at once; a process that left
# the group (setsid) may still hold them. Stop reading after this long rather than hang.
_DRAIN_GRACE_S = 1.0
_REAP_TIMEOUT_S = 5.0  # SIGKILL is not ignorable; this only guards against a stuck kernel


@dataclass(frozen=True)
class Captured:
    returncode: int | None  # None only when the process could not be reaped
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    duration_s: float


class _Sink:
    """What one pipe delivered, kept up to ``cap`` bytes; filled in place so that a reader stopped
    early still leaves what it read."""

    def __init__(self, cap: int) -> None:
        self.cap, self.kept, self.dropped = cap, bytearray(), False

    async def drain(self, stream: asyncio.StreamReader | None) -> None:
        if stream is None:
            return
        with contextlib.suppress(OSError, ValueError):
            while chunk := await stream.read(_CHUNK):
                room = self.cap - len(self.kept)
                if room > 0:
                    self.kept += chunk[:room]
                self.dropped = self.dropped or len(chunk) > room


async def _feed(stream: asyncio.StreamWriter | None, data: bytes | None) -> None:
    if stream is None:
        return
    try:
        if data:
            stream.write(data)
            await stream.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the command did not read all of its stdin: its business
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            stream.close()


async def _exited(proc: asyncio.subprocess.Process, pidfd: int | None) -> None:
    """Until the process itself has exited. ``proc.wait()`` is not that: up to Python 3.11 it also
    waits for every pipe to close, i.e. for whatever the command left running in the background."""
    if pidfd is None:
        while proc.returncode is None:
            await asyncio.sleep(0.02)
        return
    loop = asyncio.get_running_loop()
    readable = loop.create_future()
    loop.add_reader(pidfd, lambda: readable.done() or readable.set_result(None))  # readable once it exits
    try:
        await readable
    finally:
        loop.remove_reader(pidfd)


async def _reaped(proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    # The child watcher reaps it (and sets returncode) right after it exits; SIGKILL is not ignorable.
    deadline = time.monotonic() + timeout_s
    while proc.returncode is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def communicate(proc: asyncio.subprocess.Process, *, stdin: bytes | None, wall_s: float, cap: int,
                      kill: Callable[[], None]) -> Captured:
    """Call right after spawning ``proc``, with no await in between (its pid must still be ours)."""
    t0 = time.monotonic()
    try:
        pidfd: int | None = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd (old kernel), or it already exited: poll instead
        pidfd = None
    out, err = _Sink(cap), _Sink(cap)
    readers = [asyncio.ensure_future(out.drain(proc.stdout)), asyncio.ensure_future(err.drain(proc.stderr))]
    feeder = asyncio.ensure_future(_feed(proc.stdin, stdin))
    timed_out = False
    try:
        try:
            async with asyncio.timeout(wall_s):
                await _exited(proc, pidfd)
        except TimeoutError:
            timed_out = True
        kill()  # the wall clock ran out, or the command is done: either way its group goes now
        await _reaped(proc, _REAP_TIMEOUT_S)
        kill()  # anything the group forked between the first kill and the reap
        await asyncio.wait([*readers, feeder], timeout=_DRAIN_GRACE_S)
    except BaseException:
        kill()  # cancelled: the command must not outlive the task that ran it
        raise
    finally:
        for task in (*readers, feeder):
            task.cancel()
        if pidfd is not None:
            os.close(pidfd)
    return Captured(proc.returncode, bytes(out.kept), bytes(err.kept), out.dropped or err.dropped, timed_out,
                    time.monotonic() - t0)

"""Time for the core: the running event loop's clock, real or virtual.

The core stamps times with ``loop_time()``, the clock ``asyncio.timeout``, ``asyncio.sleep`` and the
pool's admission timeouts already follow, so timestamps and timeouts always agree. Under
``run_virtual`` that clock is virtual: whenever nothing is ready to run and a timer is pending, time
jumps to the timer instead of waiting for it, so a step of hour-long episodes runs in milliseconds
with exact timings (simulations, tests). Real I/O still wakes the loop: with no timer pending it
blocks on its selector as usual, so a thread's ``call_soon_threadsafe`` (``asyncio.to_thread``)
is seen. Work the loop hands to an executor (``asyncio.to_thread``, ``run_in_executor``) takes no
virtual time, and no timer fires while it runs: the loop waits for it in real time with the clock
stopped, so a bound around thread work never expires early. Only what awaits the loop's timers has a
duration.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Clock(Protocol):
    """What the core reads the time from (an event loop is one): seconds, monotonic."""

    def time(self) -> float: ...


def loop_time() -> float:
    """The running loop's time: what its timeouts and sleeps are measured against."""
    clock: Clock = asyncio.get_running_loop()  # the core reads nothing else of it
    return clock.time()


class _VirtualSelector(selectors.BaseSelector):
    """Polls the real selector without blocking; when nothing is ready and the loop would sleep
    for ``timeout`` seconds, advances the virtual clock by that much instead."""

    def __init__(self, loop: VirtualEventLoop, inner: selectors.BaseSelector):
        self._loop, self._inner = loop, inner

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._inner.select(0)
        if events or timeout == 0:
            return events
        if timeout is None or self._loop.executor_busy:
            # No timer pending, or work in an executor that takes no virtual time: only real I/O (the
            # thread's completion, a signal) may move things on, and the clock stands still meanwhile.
            return self._inner.select(None)
        self._loop.advance(timeout)
        return []

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def get_map(self) -> Any:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose ``time()`` is virtual (module docstring). Starts at ``start`` seconds."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)
        self._in_executor = 0  # executor calls not yet finished
        super().__init__(_VirtualSelector(self, selectors.DefaultSelector()))

    def time(self) -> float:
        return self._now

    @property
    def executor_busy(self) -> bool:
        return self._in_executor > 0

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future:
        future = super().run_in_executor(executor, func, *args)
        self._in_executor += 1
        future.add_done_callback(self._executor_done)
        return future

    def _executor_done(self, _future: asyncio.Future) -> None:
        self._in_executor -= 1

    def advance(self, seconds: float) -> None:
        """Move virtual time forward (never back)."""
        if seconds > 0:
            self._now += seconds


def run_virtual(coro: Coroutine[Any, Any, T], *, start: float = 0.0, debug: bool | None = None) -> T:
    """``asyncio.run(coro)`` on a ``VirtualEventLoop`` starting at ``start`` seconds."""
    with asyncio.Runner(debug=debug, loop_factory=lambda: VirtualEventLoop(start)) as runner:
        return runner.run(coro)

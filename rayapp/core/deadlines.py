"""Time limits for many concurrent episode phases on one loop timer.

``asyncio.timeout`` arms a loop timer per use, and the loop keeps its timers in a heap ordered by
a Python-level comparison: with thousands of samples in flight, arming and cancelling one per phase
is a large share of a short episode's cost. ``Deadlines`` keeps the limits of one evaluator in a
heap of plain tuples and arms a single loop timer for the earliest. Limits that share a length (an
evaluator's verify phases all do) end in the order they began, so the heap mostly pops from the
front.

Semantics are ``asyncio.timeout``'s: the limit is on the running loop's clock (real or virtual,
``core.clock``); when it passes, the task inside is cancelled, and leaving the block turns that
cancellation into ``TimeoutError`` unless the task was also cancelled from elsewhere, which then
propagates as it is. Leaving the block before the limit disarms it.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from types import TracebackType

# The loop runs a timer up to its clock's resolution early (asyncio's own rule); so do we.
_RESOLUTION = time.get_clock_info("monotonic").resolution


class Limit:
    """One phase's limit: a context manager the caller enters around the awaited phase."""

    __slots__ = ("_cancelling", "_owner", "_task", "done", "expired", "when")

    def __init__(self, owner: Deadlines, when: float):
        self._owner, self.when = owner, when
        self._task: asyncio.Task | None = None
        self._cancelling = 0
        self.done = self.expired = False  # left the block / the limit passed inside it

    def __enter__(self) -> Limit:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Deadlines limit must be entered inside a task")
        self._task, self._cancelling = task, task.cancelling()
        self._owner._add(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.done = True
        self._owner._left(self)
        if self.expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc  # our cancellation, and no other one pending: it timed out

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()


class Deadlines:
    """The limits of one evaluator's phases (module docstring). The earliest limit in the heap is
    always one still in force, so the heap is empty once the last limit is left."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Limit]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None

    def limit(self, seconds: float) -> Limit:
        """A limit of ``seconds`` from now on the running loop's clock."""
        return Limit(self, asyncio.get_running_loop().time() + seconds)

    def _add(self, limit: Limit) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (limit.when, self._seq, limit))
        if self._timer is None or limit.when < self._timer.when():
            self._arm()

    def _left(self, limit: Limit) -> None:
        # The timer stays armed when the heap empties: the next limit, later than it, then arms
        # nothing (it re-arms when it fires early); ``idle`` disarms it when the evaluator is done.
        heap = self._heap
        if heap and heap[0][2] is limit:
            while heap and heap[0][2].done:
                heapq.heappop(heap)

    def idle(self) -> None:
        """No more limits for now: disarm the timer if none is in force (a stale timer would make
        a virtual clock jump to it)."""
        if not self._heap:
            self._disarm()

    def _arm(self) -> None:
        self._disarm()
        if self._heap:
            self._timer = asyncio.get_running_loop().call_at(self._heap[0][0], self._fire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        heap, end = self._heap, asyncio.get_running_loop().time() + _RESOLUTION
        while heap and (heap[0][0] < end or heap[0][2].done):
            _, _, limit = heapq.heappop(heap)
            if not limit.done:
                limit._expire()
        self._arm()


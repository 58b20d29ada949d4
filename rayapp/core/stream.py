"""A stream of groups to the trainer (issue 33, docs/streaming.md): rollout groups start continuously
through the TaskScheduler and reach the trainer as they finish, whole, in the mini-batches it asks
for, under a staleness bound enforced when a group starts, never by dropping one.

Invariants: no group is handed to a trainer at version v unless it started at version >= v - η
(``core.staleness``: admission and hand-over keep the Hall lines); a group stays the trainer's,
unacked, until it acks it, and at most ``max_unacked`` groups are admitted and unacked (at the cap
admission pauses); after ``close`` nothing of the stream runs, every token is back in the pool, and
every admitted group was either delivered or is named in the report as not delivered. Plain asyncio,
no Ray: under ``core.clock.run_virtual`` the same code runs a simulation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from rayapp.core.contracts import DataSource, require_async
from rayapp.core.scheduler import TaskScheduler
from rayapp.core.staleness import BUILT, AtBound, StalenessBound
from rayapp.core.stream_log import StreamGroup, StreamLog
from rayapp.core.uncancellable import run_to_end
from rayapp.record import WeightVersion
from rayapp.types import Sample, Task, TaskKey

_GROUP_ID = TaskKey.GROUP_ID.value
T = TypeVar("T")


class StreamConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    batch_size: Annotated[int, Meta(ge=1, description="B: groups the trainer trains on each weight version")]
    max_staleness: Annotated[int, Meta(ge=0, description=(
        "η: versions a group may be trained after the one its generation started on"))] = 1
    max_unacked: Annotated[int, Meta(ge=1, description=(
        "groups admitted and not yet acked (running, waiting, or with the trainer); at the cap no group "
        "starts; default (η + 2)·B"))] | None = None
    at_bound: Annotated[AtBound, Meta(description="what a group still running when it falls due does")] = AtBound.FINISH

    def cap(self) -> int:
        return self.max_unacked if self.max_unacked is not None else (self.max_staleness + 2) * self.batch_size


class StreamStatus(msgspec.Struct):
    version: int
    taken: int  # groups handed over at this version
    running: int  # admitted, not finished (waiting for the pool or running)
    waiting: int  # finished, not yet handed over
    unacked: int  # handed over, not acked
    capacity: int  # groups the staleness bound lets start now
    admitted: int
    delivered: int
    acked: int
    peak_finished_unacked: int  # the most groups ever finished and not acked at once
    exhausted: bool  # the data source has no more tasks
    closed: bool


class StreamReport(msgspec.Struct):
    """How a closed stream ended: every admitted group is delivered and acked, or named here."""

    delivered: int
    acked: int
    unacked: list[StreamGroup]  # delivered, not acked
    undelivered: list[StreamGroup]  # finished, never delivered
    cancelled: list[Task]  # started and cut short by close, or handed back and not started again


class GroupStream:
    """Groups of ``source``'s tasks run through ``scheduler`` and streamed to one trainer (module
    docstring). Start it with ``start()`` (or ``async with``); the trainer loops: ``next_batch()``,
    train, ``ack(ids)``, ``set_version(v + 1)``; ``close()`` ends it."""

    def __init__(self, scheduler: TaskScheduler, config: StreamConfig, *, source: DataSource | None = None,
                 version: WeightVersion = 0, log: StreamLog | None = None):
        source = source if source is not None else scheduler.data_source
        if source is None:
            raise ValueError("GroupStream needs a data source (source=, or the scheduler's data_source)")
        require_async(source, "get_tasks", "the stream's data source",
                      "async def get_tasks(self, n: int) -> list[Task]")
        self.bound = StalenessBound(config.batch_size, config.max_staleness, version)
        if config.at_bound not in BUILT:
            known = config.at_bound in AtBound.__members__.values()
            raise ValueError(f"StreamConfig.at_bound={config.at_bound!r} " + (
                "is designed but not built" if known else f"is none of {[a.value for a in AtBound]}") +
                f"; use {AtBound.FINISH.value!r} (docs/streaming.md)")
        if type(config.cap()) is not int or config.cap() < config.batch_size:
            raise ValueError(f"StreamConfig.max_unacked={config.max_unacked!r} must be an int >= batch_size "
                             f"({config.batch_size}): the trainer waits for a whole batch")
        self.scheduler, self.config, self.source, self.log = scheduler, config, source, log
        self._running: dict[str, tuple[Task, int, int]] = {}  # group id -> task, version, deadline
        self._waiting: dict[str, StreamGroup] = {}  # finished, in finish order
        self._unacked: dict[str, StreamGroup] = {}
        self._again: list[Task] = []  # started before a restart, not finished: run first
        self._waves: set[asyncio.Task] = set()
        self._admitter: asyncio.Task | None = None
        self._fetching = 0
        self._seq = 0
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._exhausted = self._closed = False
        self._report: StreamReport | None = None
        self.admitted = self.delivered = self.acked = self.peak = 0

    async def __aenter__(self) -> GroupStream:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def version(self) -> int:
        return self.bound.version

    async def start(self) -> None:
        """Take up what the log holds from before a restart, then begin admitting."""
        if self._admitter is not None or self._closed:
            raise RuntimeError("a GroupStream starts once")
        if self.log is not None:
            state = await self.log.load()
            self._seq, self._again = state.next_seq, list(state.unfinished)
            for g in state.finished:  # delivered again, with the deadline it had
                self.bound.restore(g.deadline)
                self._waiting[g.group_id] = g
        self._admitter = asyncio.create_task(self._admit_loop(), name="stream-admission")

    # -- the trainer's side ----------------------------------------------------------------------

    def set_version(self, version: WeightVersion) -> None:
        """The trainer publishes ``version`` (the next one) once the engines serve it; admission looks
        again at once."""
        self.bound.advance(version, drained=self._drained())
        self._notify()

    async def next_batch(self, n: int | None = None) -> list[StreamGroup]:
        """``n`` finished groups (default: what is left of this version's batch_size), due ones first,
        waiting as long as it takes. Fewer (none: the stream has ended) only once the source is
        exhausted and every group was handed over."""
        if self._admitter is None:
            raise RuntimeError("next_batch: start the stream first (await stream.start(), or async with)")
        left = self.bound.left
        n = left if n is None else n
        if type(n) is not int or not 1 <= n <= left:
            raise ValueError(f"next_batch(n={n!r}): version {self.version} has {left} of its batch_size groups left; "
                             f"ask for 1..{left}, or set_version({self.version + 1}) first" if left else
                             f"next_batch: version {self.version} took its {self.config.batch_size} groups; "
                             f"set_version({self.version + 1}) first")
        while True:
            self._raise_if_over()
            chosen = self._choose(n)
            if len(chosen) == n or self._drained():
                return self._hand_over(chosen)
            if not self._running and not self._fetching and self._room() < 1:
                raise RuntimeError(f"stream stalled: {self._unacked_count()} groups are unacked at max_unacked="
                                   f"{self.config.cap()} and none runs; ack the groups trained, or raise max_unacked")
            await self._wait()

    async def ack(self, group_ids: Iterable[str]) -> None:
        """The trainer is done with these delivered groups: never delivered again, and their room
        under ``max_unacked`` is free. An id not delivered-and-unacked is one error; nothing changes."""
        ids = list(group_ids)
        if self._closed:
            raise RuntimeError("ack: the stream is closed; its report names the groups left unacked")
        bad = [g for g in ids if g not in self._unacked]
        if bad:
            raise ValueError(f"ack: groups {bad[:5]} are not delivered and unacked (acked already, or never delivered)")
        if self.log is not None:
            await self.log.acked(ids)
        for gid in ids:
            if self._unacked.pop(gid, None) is not None:
                self.acked += 1
        self._notify()

    def status(self) -> StreamStatus:
        """The stream's counters now, for the trainer, a progress display and the tests."""
        return StreamStatus(self.version, self.bound.taken, len(self._running) + self._fetching, len(self._waiting),
                            len(self._unacked), self.bound.capacity(), self.admitted, self.delivered, self.acked,
                            self.peak, self._exhausted and not self._again, self._closed)

    async def close(self) -> StreamReport:
        """Cancel what runs and wait for its teardown (tokens back in the pool); the report names
        every admitted group not delivered and acked. Nothing of the stream runs after it returns."""
        if self._report is not None:
            return self._report
        self._closed = True
        self._notify()
        work = [t for t in [self._admitter, *self._waves] if t is not None]
        for t in work:
            t.cancel()
        await run_to_end(asyncio.gather(*work, return_exceptions=True))
        cancelled = [task for task, _, _ in self._running.values()] + self._again
        self._running.clear()
        self._report = StreamReport(self.delivered, self.acked, list(self._unacked.values()),
                                    list(self._waiting.values()), cancelled)
        return self._report

    # -- hand-over ---------------------------------------------------------------------------------

    def _choose(self, n: int) -> list[StreamGroup]:
        """Up to ``n`` waiting groups, earliest due first (finish order among equals), each only if the
        staleness bound's lines still hold after it; the first that may not ends the choice (every
        later one checks the same lines)."""
        plan = self.bound.plan()
        order = sorted(self._waiting.values(), key=lambda g: plan.due(g.deadline))  # stable: finish order
        chosen = []
        for g in order:
            if len(chosen) == n or not plan.may_take(g.deadline):
                break
            plan.take(g.deadline)
            chosen.append(g)
        return chosen

    def _hand_over(self, chosen: list[StreamGroup]) -> list[StreamGroup]:
        for g in chosen:
            self.bound.take(g.deadline)
            del self._waiting[g.group_id]
            g.trained_version, g.deliveries = self.version, g.deliveries + 1
            self._unacked[g.group_id] = g
        self.delivered += len(chosen)
        self._notify()
        return chosen

    def _drained(self) -> bool:
        """Nothing more will come: the source is exhausted, nothing runs or waits to run again."""
        return self._exhausted and not self._again and not self._running and not self._fetching

    def _raise_if_over(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the stream failed: {type(self._error).__name__}: {self._error}") from self._error
        if self._closed:
            raise RuntimeError("the stream is closed")

    # -- admission ---------------------------------------------------------------------------------

    def _unacked_count(self) -> int:
        return len(self._running) + self._fetching + len(self._waiting) + len(self._unacked)

    def _room(self) -> int:
        return self.config.cap() - self._unacked_count()

    async def _admit_loop(self) -> None:
        """Start groups whenever the bound and the cap leave room, until the stream fails or closes."""
        try:
            while self._error is None:
                k = min(self.bound.capacity(), self._room())
                if k > 0 and (self._again or not self._exhausted):
                    await self._admit(k)
                else:
                    await self._wait()
        except Exception as e:  # the source or the log failed: the trainer learns of it at its next call
            self._error = self._error or e
            self._notify()

    async def _admit(self, k: int) -> None:
        """Start up to ``k`` groups at the current version: those to run again first, then fresh tasks."""
        version = self.version
        deadlines = [self.bound.admit() for _ in range(k)]
        again, self._again = self._again[:k], self._again[k:]
        self._fetching = k
        ask = k - len(again)
        fetch = asyncio.ensure_future(self.source.get_tasks(ask)) if ask > 0 else None
        try:
            fresh = await run_to_end(fetch) if fetch is not None else []
            if not isinstance(fresh, list) or len(fresh) > ask or not all(isinstance(t, Task) for t in fresh):
                raise ValueError(f"the stream's data source {self.source!r}: get_tasks({ask}) must return "
                                 f"a list of at most that many Tasks, got {type(fresh).__name__}")
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and fetch is not None and fetch.done() and not fetch.cancelled():
                # closed while its fetch ran to its end: what it fetched is reported, never started
                again = again + [self._identified(t) for t in (fetch.result() if fetch.exception() is None else [])]
            self._again[:0] = again
            for d in deadlines:
                self.bound.drop(d)
            raise
        finally:
            self._fetching = 0
            self._notify()  # a source found exhausted may end the stream: a waiting trainer looks again
        self._exhausted = self._exhausted or (ask > 0 and not fresh)
        tasks = again + [self._identified(t) for t in fresh]
        for d in deadlines[len(tasks):]:  # fewer tasks than admitted
            self.bound.drop(d)
        if not tasks:
            return
        for t, d in zip(tasks, deadlines, strict=False):
            self._running[t.metadata[_GROUP_ID]] = (t, version, d)
        self.admitted += len(tasks)
        if self.log is not None:
            await run_to_end(self.log.admitted(tasks, self._seq))
        wave = asyncio.create_task(self._run_wave(version, tasks), name=f"stream-v{version}")
        self._waves.add(wave)

    def _identified(self, task: Task) -> Task:
        """``task`` as the group it starts, known by ``stream/<n>`` (a task fetched twice is two groups)."""
        meta = {**task.metadata, _GROUP_ID: f"stream/{self._seq}"}
        self._seq += 1
        return msgspec.structs.replace(task, metadata=meta)

    async def _run_wave(self, version: int, tasks: list[Task]) -> None:
        """One scheduler step over ``tasks`` (its rollout id is the version they started on); each
        group joins the waiting ones as it finishes."""
        async def fetch() -> list[Task]:
            return tasks

        try:
            await self.scheduler.execute_rollout(version, self._finished, fetch=fetch)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the trainer learns of it at its next call; close still tears down
            self._error = self._error or e
        finally:
            self._waves.discard(asyncio.current_task())
            self._notify()

    async def _finished(self, task: Task, samples: list[Sample]) -> None:
        gid = task.metadata[_GROUP_ID]
        _, version, deadline = self._running[gid]
        for s in samples:  # turns whose engine named no weights were made on the ones the group started on
            for t in s.episode.turn_records:
                if t.weight_version is None:
                    t.weight_version = version
        group = StreamGroup(gid, task, samples, version, deadline)
        try:
            if self.log is not None:
                await run_to_end(self.log.finished(group))
        except asyncio.CancelledError:  # recorded meanwhile: it finished
            self._land(group)
            raise
        self._land(group)

    def _land(self, group: StreamGroup) -> None:
        del self._running[group.group_id]
        self._waiting[group.group_id] = group
        self.peak = max(self.peak, len(self._waiting) + len(self._unacked))
        self._notify()

    # -- wake-ups ----------------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self) -> None:
        await self._changed.wait()


async def drive(scheduler: TaskScheduler, config: StreamConfig, trainer: Callable[[GroupStream], Awaitable[T]], *,
                source: DataSource | None = None, version: WeightVersion = 0,
                log: StreamLog | None = None) -> tuple[T, StreamReport]:
    """Run ``trainer(stream)`` against a stream started for it, then close the stream (also when the
    trainer raises): the trainer's result and how the stream ended. Under ``core.clock.run_virtual``
    this is the virtual-time driver: any agent the scheduler's specs bind, any trainer coroutine
    (which sleeps its train time on the loop's clock)."""
    stream = GroupStream(scheduler, config, source=source, version=version, log=log)
    await stream.start()
    try:
        result = await trainer(stream)
    finally:
        report = await stream.close()
    return result, report

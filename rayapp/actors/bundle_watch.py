"""Work that waits on a placement-group bundle ends as soon as Ray reports the group lost.

When a node dies, Ray fails the tasks and actor calls that were running there (``NodeDiedError``,
``RayActorError``). Work that was still waiting for its bundle there (a task or a sandbox host not
yet started on that node) is another matter: Ray keeps it pending while the group is RESCHEDULING,
until the group is placed again. The pool pins each node's group to its node's id, so that never
happens: such work used to wait for its own timeout (60 s in the chaos run, 120 s for a sandbox
start) and then aborted as a timeout instead of ``infra_sandbox``.

So every wait on bundle work goes through ``watched``: it checks, every ``LOST_POLL_S`` seconds
while the work is unfinished, the state of the work's group, and once the group is not CREATED
it cancels the work and raises ``SandboxError``. The states come from one reading of Ray's
placement group table per process and period, shared by every waiter (``GroupStates``), taken off
the event loop; a reading that fails keeps the previous one (a slow GCS is not a lost node).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

import ray

from rayapp.core.termination import SandboxError

log = logging.getLogger(__name__)

T = TypeVar("T")

LOST_POLL_S = 1.0  # how often a wait on bundle work checks its group: a lost node is seen within ~2x this
READ_TIMEOUT_S = 10.0  # one reading of the placement group table from the GCS


def read_group_states() -> dict[str, str]:
    """Every placement group Ray knows: id (hex) -> state."""
    return {pg_id: info.get("state", "") for pg_id, info in ray.util.placement_group_table().items()}


class GroupStates:
    """The groups' states as last read, read again when older than ``max_age_s``; callers that
    find the reading stale at once share one read (per event loop: a process may run several)."""

    def __init__(self, max_age_s: float = LOST_POLL_S, read: Callable[[], dict[str, str]] = read_group_states):
        self.max_age_s, self.read = max_age_s, read
        self._states: dict[str, str] = {}
        self._at = -math.inf  # loop time of the last reading
        self._reading: asyncio.Task | None = None

    async def state(self, group_id: str) -> str | None:
        """The group's state, or None while nothing was read yet (unknown is not lost)."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._at >= self.max_age_s:
            if self._reading is None or self._reading.done() or self._reading.get_loop() is not loop:
                self._reading = loop.create_task(self._read())
            await asyncio.shield(self._reading)
        return self._states.get(group_id) if self._states else None

    async def _read(self) -> None:
        try:
            self._states = await asyncio.wait_for(asyncio.to_thread(self.read), READ_TIMEOUT_S)
        except Exception as e:  # the GCS is slow or restarting: keep the last reading, try next period
            log.warning("reading placement group states failed: %s", e)
        self._at = asyncio.get_running_loop().time()


STATES = GroupStates()  # this process's shared reading


async def watched(work: Awaitable[T], group_id: str, where: str, states: GroupStates | None = None) -> T:
    """``work``'s result, unless the group ``group_id`` (where the work runs or waits to) is seen in a
    state other than CREATED first: then the work is cancelled, and ``SandboxError`` names ``where``.
    A group missing from the reading is unknown, not lost (the reading may predate it); Ray itself
    fails work in a group that was removed."""
    states = states or STATES
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=states.max_age_s)
            if done:
                return task.result()
            state = await states.state(group_id)
            if state is not None and state != "CREATED":
                raise SandboxError(f"{where} is lost while work waited there: its placement group is {state} "
                                   f"(its node died?)")
    finally:
        if not task.done():
            task.cancel()  # ``bounded`` cancels the Ray call itself
            await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: its error, if any, is reported by the caller or superseded

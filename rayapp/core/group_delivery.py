"""How a step hands its finished groups on (``TaskScheduler.run_all``): to the host's code (a step log,
``on_task_done``), counted in the step status once handed on, no more of them once a step is
complete after ``complete_after`` groups. Most steps hand nothing on (no step log, no callback): a
plain function then runs at once, in the worker that finished the group, and no task is started per
group (that was about a quarter of the scheduler's cost per sample in groups of 1).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

from tqdm.auto import tqdm

from rayapp.core.contracts import StepStatus
from rayapp.core.evaluator import GroupDone, TaskRun


async def _deliver(group_done: Callable[[int], Awaitable[None]], i: int) -> None:
    """``group_done(i)``: the host's code (step log, ``on_task_done``). Whatever it raises fails the step;
    a BaseException of its own (its own CancelledError, SystemExit, KeyboardInterrupt) as a RuntimeError,
    so that it neither passes for a cancelled batch nor ends the process. The step's own cancellation
    passes through."""
    try:
        await group_done(i)
    except Exception:
        raise
    except BaseException as e:
        task = asyncio.current_task()
        if isinstance(e, asyncio.CancelledError) and task is not None and task.cancelling():
            raise
        raise RuntimeError(f"handing on group {i} (step log, on_task_done) raised {type(e).__name__}: {e}") from e


class GroupDelivery:
    """``run_all``'s delivery of finished groups: ``finished(i)`` hands group ``i`` on (``group_done``) and
    counts it in the step status once delivered; a step complete after ``complete_after`` groups
    delivers no more and cancels its ``batches``. A plain ``group_done`` runs at once; a coroutine
    function's delivery is a coroutine for the batch to await, doing all of it (a task cancelled
    before it starts delivers nothing and counts nothing)."""

    __slots__ = ("at_once", "bar", "batches", "began", "complete_after", "group_done", "groups", "status")

    def __init__(self, group_done: GroupDone, groups: list[TaskRun], status: StepStatus, bar: tqdm,
                 complete_after: int | None):
        self.group_done, self.groups, self.status, self.bar = group_done, groups, status, bar
        self.at_once = not inspect.iscoroutinefunction(group_done)
        self.complete_after = complete_after
        self.batches: list[asyncio.Task] = []
        self.began = 0  # groups whose delivery began

    def finished(self, i: int) -> Awaitable[None] | None:
        if not self.at_once:
            return self._deliver(i)
        if self._begin():
            self.group_done(i)
            self._counted(i)
        return None

    def _begin(self) -> bool:
        if self.complete_after is not None and self.began >= self.complete_after:
            return False  # the step is complete without it
        self.began += 1
        return True

    async def _deliver(self, i: int) -> None:
        if self._begin():
            await _deliver(self.group_done, i)
            self._counted(i)  # a callback that raised did not finish its task

    def _counted(self, i: int) -> None:
        st = self.status
        st.tasks_done += 1
        st.samples_done += len(self.groups[i].samples)
        self.bar.update(1)
        if st.tasks_done == self.complete_after:
            for t in self.batches:  # a cancelled batch does not fail the TaskGroup: its tokens go back
                t.cancel()

"""Steps started over HTTP: a POST starts (or joins) a step and answers at once; a GET on the same
URL says how it stands. Plain asyncio, so the manager only translates.

- ``start(kind, id, run)`` starts ``run()`` as a job, or returns the job of that step when one is
  in flight or done (a repeated POST joins it: steps are idempotent underneath, ``steps.results``);
  a POST for another id of the same kind while one is in flight is a ``StepConflict`` (the steps
  would queue behind each other, which over HTTP is most often a client's mistake);
- ``get(kind, id)``: the job, or None; a job is ``running``, ``done`` (its result), ``failed`` (its
  error) or ``cancelled``. The latest ``keep`` jobs of each kind are kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from rayapp.types import StepKind

JobState = Literal["running", "done", "failed", "cancelled"]


class StepConflict(Exception):
    """A step was asked for while another of its kind is in flight."""


class StepJob:
    def __init__(self, kind: StepKind, rollout_id: int, task: asyncio.Task):
        self.kind, self.rollout_id, self.task = kind, rollout_id, task
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read by get(), or by no one

    @property
    def state(self) -> JobState:
        if not self.task.done():
            return "running"
        if self.task.cancelled():
            return "cancelled"
        return "failed" if self.task.exception() is not None else "done"

    @property
    def result(self) -> Any:
        return self.task.result()

    @property
    def error(self) -> BaseException | None:
        return self.task.exception() if self.state == "failed" else None


class StepJobs:
    def __init__(self, keep: int = 8):
        self.keep = keep
        self._jobs: dict[tuple[str, int], StepJob] = {}

    def start(self, kind: StepKind, rollout_id: int, run: Callable[[], Awaitable[Any]]) -> StepJob:
        job = self._jobs.get((kind, rollout_id))
        if job is not None and job.state in ("running", "done"):
            return job
        busy = [j for j in self._jobs.values() if j.kind == kind and j.state == "running"]
        if busy:
            raise StepConflict(f"{kind} {busy[0].rollout_id} is in flight: poll it until it is done, then ask for "
                               f"{kind} {rollout_id}")
        job = self._jobs[kind, rollout_id] = StepJob(kind, rollout_id, asyncio.ensure_future(run()))
        ours = sorted((k for k in self._jobs if k[0] == kind), key=lambda k: k[1])
        for key in ours[:-self.keep]:
            if self._jobs[key].state != "running":
                del self._jobs[key]
        return job

    def get(self, kind: StepKind, rollout_id: int) -> StepJob | None:
        return self._jobs.get((kind, rollout_id))

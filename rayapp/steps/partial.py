"""Partial rollouts: a step starts more groups than the trainer takes, returns once
``rollout_batch_size`` are complete, and carries the unfinished groups into the next step.

It exists to cut the long tail of a step without wasting the work in flight. ``PartialRollouts``
wraps the ``Rollouts`` below it (the scheduler, or ``ResumableRollouts`` with a checkpoint;
``PartialRollouts.over`` builds the stack) through the scheduler's general interface
(``execute_rollout(fetch=..., complete_after=n)``). A group is known by ``TaskKey.GROUP_ID``, never
by its task_id. Invariant: every fetched task comes back exactly once, complete, or is still carried,
and nothing returned is staler than ``max_staleness``. Policies, resume and metrics:
docs/scheduler.md, "Partial rollouts".
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rayapp.core.contracts import (
    DataSource,
    OnTaskDone,
    RolloutResult,
    UnfinishedGroup,
    identified,
    require_async,
)
from rayapp.core.scheduler import TaskScheduler
from rayapp.core.step_metrics import outcome_metrics
from rayapp.record import CarriedRun, TurnRecord
from rayapp.steps.checkpoint import CarriedGroup, ResumableRollouts, RolloutCheckpoint, in_thread
from rayapp.types import MAX_STEPS, Sample, Status, StepKind, Task, TaskKey

PartialPolicy = Literal["restart", "resume"]


class PartialConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    over_provision: Annotated[float, Meta(ge=1, le=16, description=(
        "groups a step starts, as a multiple of rollout_batch_size (rounded up); the step returns once "
        "rollout_batch_size are complete"))] = 1.25
    max_staleness: Annotated[int, Meta(ge=0, le=MAX_STEPS, description="steps a carried group may go on from "
                                                                       "before it starts afresh, whatever the "
                                                                       "policy")] = 1
    policy: Annotated[PartialPolicy, Meta(description=(
        "what an unfinished group does in the next step: resume (its samples that ended are kept, and each "
        "cut-short episode goes on from where it was cut: its last complete turn and the tokens its cut turn had "
        "generated, where its agent can) or restart (run afresh and whole, what it did is discarded)"))] = "resume"


def stamp_versions(samples: list[Sample], rollout_id: int) -> None:
    """Name the step's weights on every turn the engine left without a version (its resume point's
    records too), and drop the resume points the step was handed: they are no part of the result."""
    for s in samples:
        episode = s.episode
        episode.start = None
        point_turns: list[TurnRecord] = episode.resume.turn_records if episode.resume is not None else []
        for t in [*episode.turn_records, *point_turns]:
            if t.weight_version is None:
                t.weight_version = rollout_id


def staleness(sample: Sample, rollout_id: int) -> int:
    """Steps between ``rollout_id`` and the oldest weights that produced a turn of ``sample``."""
    steps = [t.weight_version if t.weight_version is not None else rollout_id for t in sample.episode.turn_records]
    return max(0, rollout_id - min(steps)) if steps else 0


def _ended(sample: Sample) -> bool:
    return sample.status is not Status.PENDING


def _to_run(group: CarriedGroup) -> Task | None:
    """The task a carried group runs as: only its samples that have not ended (``Task.carried``: their
    indices, and each cut-short one's resume point); the group's own task when it keeps nothing;
    None when nothing is left to run."""
    todo = sorted((s for s in group.samples if not _ended(s)), key=lambda s: s.index)
    if not group.samples or not todo:
        return None if group.samples else group.task
    points = [s.episode.resume for s in todo]
    if len(todo) == group.task.config.n_samples and not any(points):
        return group.task
    config = msgspec.structs.replace(group.task.config, n_samples=len(todo))
    carried = CarriedRun([s.index for s in todo], points if any(points) else [])
    return msgspec.structs.replace(group.task, config=config, carried=carried)


def _whole(group: CarriedGroup, samples: list[Sample]) -> list[Sample]:
    """A carried group put back together from what its task ran (``samples``, by their indices in the
    group) and the samples it kept, by index. A group whose samples are not exactly 0..n-1 is a bug
    here, and says so."""
    whole = sorted([*(s for s in group.samples if _ended(s)), *samples], key=lambda s: s.index)
    if [s.index for s in whole] != list(range(group.task.config.n_samples)):
        raise RuntimeError(f"task {group.task.task_id!r}: a carried group put back together has sample indices "
                           f"{[s.index for s in whole]}, not 0..{group.task.config.n_samples - 1}")
    return whole


def group_id(task: Task) -> str | None:
    """The identity of the group ``task`` runs as (``TaskKey.GROUP_ID``, set when it was first fetched)."""
    return task.metadata.get(TaskKey.GROUP_ID.value)


def _unidentified(task: Task) -> Task:
    """``task`` without its group identity, so that the step that takes it up gives it one."""
    meta = {k: v for k, v in task.metadata.items() if k != TaskKey.GROUP_ID.value}
    return msgspec.structs.replace(task, metadata=meta)


class PartialRollouts:
    """Rollout steps as partial rollouts (module docstring), over the scheduler, or a
    ``ResumableRollouts`` over it (then ``checkpoint`` is that one's, and the carried groups survive
    restarts). It fetches from ``source`` itself and hands the scheduler its tasks (``fetch``)."""

    def __init__(self, rollouts: TaskScheduler | ResumableRollouts, source: DataSource, rollout_batch_size: int,
                 config: PartialConfig | None = None, *, checkpoint: RolloutCheckpoint | None = None,
                 on_task_done: OnTaskDone | None = None):
        require_async(source, "get_tasks", "partial rollouts' data_source",
                      "async def get_tasks(self, n: int) -> list[Task]")
        if type(rollout_batch_size) is not int or rollout_batch_size < 1:
            raise ValueError(f"rollout_batch_size must be an int >= 1, got {rollout_batch_size!r}")
        self.rollouts, self.source, self.size = rollouts, source, rollout_batch_size
        self.config, self.checkpoint, self.on_task_done = config or PartialConfig(), checkpoint, on_task_done
        self._carry: dict[int, list[CarriedGroup]] = {}  # what the latest steps (by id) carried on
        # Without a checkpoint: the last attempt of a step, and every group it holds (returned or carried).
        # Asked for that step again, its result never reached the trainer (the step failed after it
        # returned): the retry starts from them, so no fetched task is lost.
        self._owed: tuple[int, list[CarriedGroup]] | None = None

    @classmethod
    def over(cls, scheduler: TaskScheduler, config: PartialConfig | None = None,
             checkpoint: RolloutCheckpoint | None = None) -> PartialRollouts:
        """Partial rollouts over ``scheduler`` (through a ``ResumableRollouts`` with a checkpoint),
        with its data source, batch size and default callback."""
        if scheduler.data_source is None:
            raise ValueError("partial rollouts need a scheduler with a data_source")
        inner = scheduler if checkpoint is None else ResumableRollouts.over(scheduler, checkpoint)
        return cls(inner, scheduler.data_source, scheduler.config.rollout_batch_size, config,
                   checkpoint=checkpoint, on_task_done=scheduler.on_task_done)

    def carried(self) -> list[CarriedGroup]:
        """The groups the last step carried on (a copy of the list)."""
        return list(self._carry[max(self._carry)]) if self._carry else []

    async def execute_rollout(self, rollout_id: int, on_task_done: OnTaskDone | None = None) -> RolloutResult:
        """One partial step (module docstring): ``groups`` are the ``rollout_batch_size`` complete
        groups in fetch order (carried ones first), each whole; the unfinished ones stay here for
        the next step."""
        start = math.ceil(self.size * self.config.over_provision)
        carried_in = await self._carried_into(rollout_id)
        carried = [self._attempt(g, rollout_id) for g in carried_in]
        runs = [(g, _to_run(g)) for g in carried]
        done_already = [g for g, t in runs if t is None]  # every sample ended: complete, nothing to run
        ready, waiting = done_already[:self.size], done_already[self.size:]
        ready_groups = [_whole(g, []) for g in ready]
        running = [(g, t) for g, t in runs if t is not None]
        by_id = {group_id(g.task): g for g, _ in running}
        left = self.size - len(ready)  # 0: the step is complete with what was carried in, nothing runs
        fetched: list[Task] = []
        tasks: list[Task] = []  # what the scheduler runs, each with the identity it gives it
        callback = on_task_done or self.on_task_done

        async def fetch() -> list[Task]:
            fetched[:] = await self.source.get_tasks(max(0, start - len(carried))) if left else []
            tasks[:] = identified(rollout_id, [t for _, t in running] + fetched)
            return list(tasks)

        async def whole_done(task: Task, samples: list[Sample]) -> None:  # the trainer sees whole groups
            g = by_id.get(group_id(task))
            await callback(task, samples) if g is None else await callback(g.task, _whole(g, samples))

        def carry(result: RolloutResult) -> list[CarriedGroup]:
            return [self._carried(u, by_id, rollout_id, ran=left > 0) for u in result.unfinished] + waiting

        for g, samples in zip(ready, ready_groups, strict=True):
            if callback is not None:
                await callback(g.task, samples)
        try:
            # a checkpoint below saves what the step carries on with the step's end
            saved = {"carry": carry} if isinstance(self.rollouts, ResumableRollouts) else {}
            result = await self.rollouts.execute_rollout(
                rollout_id, whole_done if callback is not None else None, fetch=fetch, complete_after=left, **saved)
        except BaseException:
            if self.checkpoint is None:  # its checkpoint takes a resumed step up again; without one, this does
                fresh = [CarriedGroup(t, rollout_id) for t in tasks[len(running):]]
                self._owed = (rollout_id, [*carried_in, *fresh])
            raise
        going_on = carry(result)
        self._carry = {r: c for r, c in self._carry.items() if r == rollout_id - 1} | {rollout_id: going_on}
        ids = {group_id(t): t for t in tasks}
        groups = ready_groups + [_whole(by_id[i], g) if (i := _sample_group(g)) in by_id else g for g in result.groups]
        for g in groups:
            stamp_versions(g, rollout_id)
        if self.checkpoint is None:
            returned = [CarriedGroup(g.task, g.since, s) for g, s in zip(ready, ready_groups, strict=True)]
            returned += [CarriedGroup(by_id[i].task if i in by_id else ids[i], rollout_id, g)
                         for g in groups[len(ready):] if (i := _sample_group(g)) is not None]
            self._owed = (rollout_id, returned + going_on)
        ages = [staleness(s, rollout_id) for g in groups for s in g]
        metrics = {"carried": len(going_on), "fetched": len(fetched),
                   "restarted": sum(t is g.task for g, t in runs), "resumed": sum(t is not g.task for g, t in runs),
                   "kept_samples": sum(_ended(s) for g in carried for s in g.samples),
                   "staleness_mean": sum(ages) / len(ages) if ages else 0.0, "staleness_max": max(ages, default=0)}
        # The scheduler counted what it ran; the step returns whole groups (kept samples, complete
        # carried groups): count those, replacing its counts key by key.
        result.metrics |= outcome_metrics(StepKind.ROLLOUT, (s for g in groups for s in g))
        result.metrics |= {f"rollout/partial/{k}": float(v) for k, v in metrics.items()}
        return msgspec.structs.replace(result, groups=groups, unfinished=[])

    async def _carried_into(self, rollout_id: int) -> list[CarriedGroup]:
        """What step ``rollout_id`` starts from: when it ran here before and was asked for again
        without a checkpoint, everything that attempt held (its result never reached the trainer);
        else what step ``rollout_id - 1`` carried on: kept here, else its checkpoint's (a restarted
        manager, or a trainer that went back a step). Without a checkpoint, a step out of order (a
        trainer that went back, or skipped ahead) takes up what the latest step here carried on,
        afresh (it ran on weights of another line of steps) and as fetched by this step (a new
        ``TaskKey.GROUP_ID``: its old one may be one this step gives again): dropped, they would be lost."""
        if self._owed is not None and self._owed[0] == rollout_id:
            return list(self._owed[1])
        if rollout_id - 1 in self._carry:
            return list(self._carry[rollout_id - 1])
        if self.checkpoint is not None:
            if rollout_id == 0:
                return []
            return await in_thread(self.checkpoint.carried, rollout_id - 1) or []
        return [CarriedGroup(_unidentified(g.task), rollout_id) for g in self.carried()]

    def _attempt(self, group: CarriedGroup, rollout_id: int) -> CarriedGroup:
        """How a carried group runs in step ``rollout_id``: afresh under ``restart``, or once its
        attempt is older than ``max_staleness`` steps."""
        if self.config.policy == "restart" or rollout_id - group.since > self.config.max_staleness:
            return CarriedGroup(group.task, rollout_id)
        return group

    def _carried(self, group: UnfinishedGroup, by_id: dict[str | None, CarriedGroup], rollout_id: int, *,
                 ran: bool) -> CarriedGroup:
        """An unfinished group of step ``rollout_id`` as the next step takes it up: whole (a carried
        one put back together, its own task), its attempt begun when it was first carried in, or now.
        A carried group the step did not run (``ran`` false) goes on as it came in."""
        carried = by_id.get(group_id(group.task))
        if carried is not None and not ran:
            return carried
        if carried is not None:
            task, since, samples = carried.task, carried.since, _whole(carried, group.samples)
        else:
            task, since, samples = group.task, rollout_id, group.samples
        stamp_versions(samples, rollout_id)
        return CarriedGroup(task, since, [] if self.config.policy == "restart" else samples)


def _sample_group(samples: list[Sample]) -> str | None:
    """The identity of the group ``samples`` are (their ``TaskKey.GROUP_ID``)."""
    return samples[0].metadata.get(TaskKey.GROUP_ID.value) if samples else None

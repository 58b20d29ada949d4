"""Partial rollouts: a step starts more groups than the trainer takes and returns as soon as
``rollout_batch_size`` of them are complete; the unfinished groups are carried into the next step.

``PartialRollouts`` wraps a TaskScheduler (with a ``RolloutCheckpoint``, through ``ResumableRollouts``)
the way ``ResumableRollouts`` does; the scheduler itself knows only its general seam
(``execute_rollout(fetch=..., complete_after=n)``: complete after ``n`` groups, the rest cancelled and
handed back as unfinished). Each step:

- the carried groups come first, oldest first, then only as many new tasks as it takes to start
  ``ceil(rollout_batch_size x over_provision)`` groups;
- the step completes after ``rollout_batch_size`` groups; the others are carried on: under
  ``policy: restart`` each starts afresh in the next step (what it did is discarded); under
  ``policy: resume`` each cut-short sample goes on from its last complete turn (its ``ResumePoint``,
  handed to the agent in the task's ``RESUME_POINTS``: kept tokens, log-probs, mask and turn records
  as they are; the cut turn is generated again), while a sample that ended, or one cut before a
  point was kept, runs again; an agent that cannot rebuild its state (``resumable`` false: the
  single-turn chat agent, whose one turn is all it has) starts afresh. A carried group restarts whatever the
  policy once its attempt is older than ``max_staleness`` steps;
- nothing is lost or duplicated: every fetched task comes back exactly once, complete, or is still
  carried. With a checkpoint the carried groups are saved with the step's end (the FINISHED record),
  so a restarted manager takes them up again;
- every turn of what a step returns or carries names the weights that produced it
  (``TurnRecord.weight_version``): the engine's report, else the step that ran it. The step's
  metrics count ``rollout/partial/{carried,restarted,resumed,fetched}`` and the staleness of what
  it returns (``rollout/partial/staleness_{mean,max}``: current step minus the step of the oldest
  weights in each returned sample; an integer weight version is read as that step, as the trainer
  loads new weights once a step).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from rayapp.core.contracts import OnTaskDone, RolloutResult, UnfinishedGroup
from rayapp.core.scheduler import TaskScheduler
from rayapp.episode import RESUME_POINTS, EpisodeKey
from rayapp.training.checkpoint import CarriedGroup, ResumableRollouts, RolloutCheckpoint
from rayapp.types import Sample, Task

PartialPolicy = Literal["restart", "resume"]


class PartialConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    over_provision: Annotated[float, Meta(ge=1, le=16, description=(
        "groups a step starts, as a multiple of rollout_batch_size (rounded up); the step returns once "
        "rollout_batch_size are complete"))] = 1.25
    max_staleness: Annotated[int, Meta(ge=0, description="steps a carried group may go on from before it starts "
                                                         "afresh, whatever the policy")] = 1
    policy: Annotated[PartialPolicy, Meta(description=(
        "what an unfinished group does in the next step: restart (run afresh, what it did is discarded) or "
        "resume (each cut-short episode goes on from its last complete turn, where its agent can)"))] = "restart"


def _turns(sample: Sample) -> list[dict]:
    return sample.metadata.get(EpisodeKey.TURN_PLACEMENT.value) or []


def stamp_versions(samples: list[Sample], rollout_id: int) -> None:
    """Name the step's weights on every turn the engine left without a version (its resume point's
    records too), and drop the resume points the step was handed: they are no part of the result."""
    for s in samples:
        s.metadata.pop(RESUME_POINTS, None)
        point = s.metadata.get(EpisodeKey.RESUME.value) or {}
        for t in [*_turns(s), *point.get("turn_records", [])]:
            if not t.get("weight_version"):
                t["weight_version"] = str(rollout_id)


def staleness(sample: Sample, rollout_id: int) -> int:
    """Steps between ``rollout_id`` and the oldest weights that produced a turn of ``sample``."""
    steps = []
    for t in _turns(sample):
        v = str(t.get("weight_version") or "")
        steps.append(int(v) if v.lstrip("-").isdigit() else rollout_id)
    return max(0, rollout_id - min(steps)) if steps else 0


def _resumed(group: CarriedGroup) -> Task:
    """The group's task, handing each cut-short sample its resume point (``RESUME_POINTS``, by
    sample index); the task itself when none has one: the group starts afresh."""
    points: list = [None] * group.task.config.n_samples
    for s in group.samples:
        if 0 <= s.index < len(points):
            points[s.index] = s.metadata.get(EpisodeKey.RESUME.value)
    if not any(points):
        return group.task
    return msgspec.structs.replace(group.task, metadata={**group.task.metadata, RESUME_POINTS: points})


class PartialRollouts:
    """A TaskScheduler's rollout steps as partial rollouts (module docstring). With a checkpoint,
    a step cut short resumes as ``ResumableRollouts`` does, and the carried groups survive restarts."""

    def __init__(self, scheduler: TaskScheduler, config: PartialConfig | None = None,
                 checkpoint: RolloutCheckpoint | None = None):
        if scheduler.data_source is None:
            raise ValueError("partial rollouts need a scheduler with a data_source")
        self.scheduler, self.config = scheduler, config or PartialConfig()
        self._resumable = ResumableRollouts(scheduler, checkpoint) if checkpoint is not None else None
        self._carry: dict[int, list[CarriedGroup]] = {}  # what the last step (by id) carried on

    def carried(self) -> list[CarriedGroup]:
        """The groups the last step carried on (a copy of the list)."""
        return [g for gs in self._carry.values() for g in gs]

    async def execute_rollout(self, rollout_id: int, on_task_done: OnTaskDone | None = None) -> RolloutResult:
        """One partial step (module docstring): ``groups`` are the ``rollout_batch_size`` complete
        groups in fetch order (carried ones first); the unfinished ones stay here for the next step."""
        size = self.scheduler.config.rollout_batch_size
        start = math.ceil(size * self.config.over_provision)
        carried = [self._attempt(g, rollout_id) for g in await self._carried_into(rollout_id)]
        fetched: list[Task] = []

        async def fetch() -> list[Task]:
            fetched[:] = await self.scheduler.data_source.get_tasks(max(0, start - len(carried)))
            return [_resumed(g) for g in carried] + list(fetched)

        def carry(result: RolloutResult) -> list[CarriedGroup]:
            return [self._carried(u, carried, rollout_id) for u in result.unfinished]

        if self._resumable is not None:
            result = await self._resumable.execute_rollout(rollout_id, on_task_done, fetch=fetch,
                                                           complete_after=size, carry=carry)
        else:
            result = await self.scheduler.execute_rollout(rollout_id, on_task_done, fetch=fetch,
                                                          complete_after=size)
        going_on = carry(result)
        self._carry = {rollout_id: going_on}
        for g in result.groups:
            stamp_versions(g, rollout_id)
        ages = [staleness(s, rollout_id) for g in result.groups for s in g]
        metrics = {"carried": len(going_on), "fetched": len(fetched),
                   "restarted": sum(_resumed(g) is g.task for g in carried),
                   "resumed": sum(_resumed(g) is not g.task for g in carried),
                   "staleness_mean": sum(ages) / len(ages) if ages else 0.0, "staleness_max": max(ages, default=0)}
        result.metrics |= {f"rollout/partial/{k}": float(v) for k, v in metrics.items()}
        return msgspec.structs.replace(result, unfinished=[])

    async def _carried_into(self, rollout_id: int) -> list[CarriedGroup]:
        """What step ``rollout_id - 1`` carried on: kept here, else its checkpoint's (a restarted
        manager, or a trainer that went back a step), else nothing."""
        if rollout_id - 1 in self._carry:
            return list(self._carry[rollout_id - 1])
        if self._resumable is not None and rollout_id > 0:
            return list(await self._resumable.carried(rollout_id - 1) or [])
        return []

    def _attempt(self, group: CarriedGroup, rollout_id: int) -> CarriedGroup:
        """How a carried group runs in step ``rollout_id``: afresh under ``restart``, or once its
        attempt is older than ``max_staleness`` steps."""
        if self.config.policy == "restart" or rollout_id - group.since > self.config.max_staleness:
            return CarriedGroup(group.task, rollout_id)
        return group

    def _carried(self, group: UnfinishedGroup, carried: list[CarriedGroup], rollout_id: int) -> CarriedGroup:
        """An unfinished group of step ``rollout_id`` as the next step takes it up (its attempt
        began when it was first carried in, or now)."""
        # a carried group keeps its own task: the one it ran as held the resume points it was handed
        task, since = (carried[group.index].task, carried[group.index].since) if group.index < len(carried) \
            else (group.task, rollout_id)
        stamp_versions(group.samples, rollout_id)
        return CarriedGroup(task, since, [] if self.config.policy == "restart" else group.samples)

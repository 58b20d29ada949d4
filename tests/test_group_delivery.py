"""How a step hands its finished groups on (``core.group_delivery``): a task per group only where there is
something to await, and the same step either way."""

import asyncio

import pytest

from rayapp.core.agent import FunctionAgent
from rayapp.core.pool import PlacementPool
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.types import AgentResult, EvaluatorSpec, NodeSpec, Resource, Task, TaskConfig

RESULT = AgentResult(tokens=[1, 2], response_length=1, response="4", termination_reason="stop")


async def _run(sample, ctx):
    return RESULT


async def _verify(sample, result):
    return {"score": 1.0}


class Source:
    def __init__(self, n, group):
        self.tasks = [Task(f"t{i}", "p", TaskConfig("noop", n_samples=group), label="4") for i in range(n)]

    async def get_tasks(self, n):
        return self.tasks[:n]


def scheduler(n_tasks, group, on_task_done=None):
    spec = EvaluatorSpec("noop", FunctionAgent(_run, _verify), batch_size=8, run_resource=Resource(cpu=1),
                         resource=Resource(concurrency=8, cpu=8))
    pool = PlacementPool({"n0": NodeSpec(cpu=16, memory_gb=64)})
    return TaskScheduler([spec], Source(n_tasks, group), pool,
                         SchedulerConfig(rollout_batch_size=n_tasks, progress=False), on_task_done=on_task_done)


def tasks_started(coro):
    """``asyncio.run(coro)``'s result and how many tasks the loop started meanwhile."""
    started = 0

    async def main():
        nonlocal started
        loop = asyncio.get_running_loop()

        def factory(loop, c, **kw):
            nonlocal started
            started += 1
            return asyncio.Task(c, loop=loop, **kw)

        loop.set_task_factory(factory)
        return await coro

    return asyncio.run(main()), started


@pytest.mark.parametrize("group", [1, 4])
def test_a_step_with_nothing_to_hand_on_starts_no_task_per_group(group):
    result, started = tasks_started(scheduler(64, group).execute_rollout(0))
    ids = sorted(s.task_id for g in result.groups for s in g)
    assert ids == sorted(f"t{i}" for i in range(64) for _ in range(group))
    # the batches, their workers and admission: a few per batch, not one per group
    assert started < 64


@pytest.mark.parametrize("group", [1, 4])
def test_a_callback_still_sees_every_group_once_and_the_step_counts_them_once_handed_on(group):
    seen = []

    async def on_done(task, samples):
        await asyncio.sleep(0)
        seen.append(task.task_id)

    sched = scheduler(64, group, on_done)
    result, started = tasks_started(sched.execute_rollout(0))
    assert sorted(seen) == sorted(f"t{i}" for i in range(64)) and len(result.groups) == 64
    assert started >= 64  # each hand-on awaited in a task of its own
    assert sched.status().tasks_done == 64 and sched.status().samples_done == 64 * group


@pytest.mark.parametrize("callback", [False, True])
@pytest.mark.parametrize("n", [0, 1, 5, 64])
def test_complete_after_n_returns_n_groups_whether_or_not_groups_are_handed_on(callback, n):
    seen = []

    async def on_done(task, samples):
        seen.append(task.task_id)

    sched = scheduler(64, 2, on_done if callback else None)
    result = asyncio.run(sched.execute_rollout(0, complete_after=n))
    assert len(result.groups) == n and len(result.unfinished) == 64 - n
    assert len({g[0].task_id for g in result.groups} | {u.task.task_id for u in result.unfinished}) == 64
    assert sched.status().tasks_done == n
    if callback:
        assert sorted(seen) == sorted(g[0].task_id for g in result.groups)

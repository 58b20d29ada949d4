"""The core in virtual time (``rayapp.core.clock``): a step of hour-long episodes, a run-phase
timeout and an acquire timeout, finished at once with exact timings."""

import asyncio
import threading
import time

import pytest

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import VirtualEventLoop, loop_time, run_virtual
from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool
from rayapp.core.scheduler import SchedulerConfig, StepState, TaskScheduler
from rayapp.envs.datasets.source import DatasetSpec, MultiDataSource
from rayapp.steps.checkpoint import ResumableRollouts, RolloutCheckpoint
from rayapp.trainers.converters import trainer_metadata
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Status, StoppingCriteria, Task, TaskConfig

HOUR = 3600.0
ONE_GPU = '{"n0": {"gpus": [0], "cpu": 8, "memory_gb": 64}}'


def test_sleeps_and_timeouts_follow_virtual_time():
    async def main():
        assert loop_time() == 100.0
        await asyncio.sleep(3 * 24 * HOUR)  # longer than asyncio's 24 h cap on one select()
        assert loop_time() == 100 + 3 * 24 * HOUR
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(10):
                await asyncio.sleep(HOUR)
        assert loop_time() == 100 + 3 * 24 * HOUR + 10
        ends = []

        async def wake(after):
            await asyncio.sleep(after)
            ends.append(loop_time())

        await asyncio.gather(wake(5), wake(1), wake(2.5))
        return ends

    assert run_virtual(main(), start=100.0) == [100 + 3 * 24 * HOUR + 10 + d for d in (1, 2.5, 5)]


def test_a_thread_wakes_the_loop_and_takes_no_virtual_time():
    release = threading.Event()

    async def main():
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualEventLoop)
        waiting = asyncio.ensure_future(asyncio.to_thread(release.wait, 30))
        loop.call_soon(release.set)
        # No timer pending: the loop blocks on real I/O until the thread's result wakes it.
        assert await waiting is True
        return loop_time()

    assert run_virtual(main()) == 0.0


def _scheduler(pool, acquire_timeout_s, log):
    """One GPU; each batch's budget takes all of it, so batch 2 waits for batch 1. Episodes sleep
    their task's ``hours``; the run phase is cut at 5 h."""

    async def run_fn(sample, ctx):
        log.append((sample.task_id, "start", loop_time()))
        await asyncio.sleep(sample.metadata["hours"] * HOUR)
        log.append((sample.task_id, "end", loop_time()))
        return AgentResult(tokens=[1, 2], response_length=1, response="ok")

    spec = EvaluatorSpec("sim", FunctionAgent(run_fn, lambda s, r: {"score": 1.0}), batch_size=2,
                         resource=Resource(gpu=1.0, concurrency=2, cpu=2, memory_gb=2),
                         run_resource=Resource(gpu=0.5, cpu=1, memory_gb=1),
                         default_stopping=StoppingCriteria(timeout_s=5 * HOUR))
    tasks = [Task(f"t{i}", "p", TaskConfig("sim"), metadata={"hours": h}) for i, h in enumerate([1, 2, 10, 3])]

    class Source:
        async def get_tasks(self, n):
            return tasks[:n]

    return TaskScheduler([spec], Source(), pool,
                         SchedulerConfig(rollout_batch_size=4, acquire_timeout_s=acquire_timeout_s, progress=False))


def test_a_rollout_of_hour_long_episodes_runs_in_virtual_time_with_exact_timings(make_pool):
    log = []
    sched = _scheduler(make_pool(ONE_GPU), 3 * HOUR, log)

    async def main():
        result = await sched.execute_rollout(0)
        return result, loop_time()

    result, makespan = run_virtual(main())
    # batch 1 (t0, t1) holds the GPU until its slowest ends at 2 h; batch 2 (t2, t3) is admitted then,
    # within its 3 h acquire timeout; t3 ends at 5 h, t2 is cut at 2 h + 5 h.
    assert sorted(log) == sorted([("t0", "start", 0.0), ("t1", "start", 0.0), ("t0", "end", HOUR),
                                  ("t1", "end", 2 * HOUR), ("t2", "start", 2 * HOUR), ("t3", "start", 2 * HOUR),
                                  ("t3", "end", 5 * HOUR)])
    assert makespan == 7 * HOUR
    statuses = [g[0].status for g in result.groups]
    assert statuses == [Status.COMPLETED, Status.COMPLETED, Status.ABORTED, Status.COMPLETED]
    cut = trainer_metadata(result.groups[2][0])
    assert cut["_termination_reason"] == "agent_timeout"
    assert cut["_abort"]["window"] == [2 * HOUR, 7 * HOUR] and cut["_abort"]["elapsed_s"] == 5 * HOUR
    st = sched.status()
    assert st.state is StepState.DONE and st.started_at == 0.0 and st.tasks_done == 4


def test_an_acquire_timeout_fails_the_step_at_its_virtual_deadline(make_pool):
    log = []
    sched = _scheduler(make_pool(ONE_GPU), HOUR, log)

    async def main():
        with pytest.raises(ExceptionGroup) as info:
            await sched.execute_rollout(0)
        assert info.group_contains(TimeoutError)
        return loop_time()

    assert run_virtual(main()) == HOUR  # batch 2 gave up after 1 h; batch 1 was cancelled with it
    assert sorted((t, when) for t, what, when in log if what == "start") == [("t0", 0.0), ("t1", 0.0)]
    assert sched.status().state is StepState.FAILED


def test_virtual_time_a_timeout_does_not_fire_while_thread_work_runs():
    """clock.py: work outside the loop takes no virtual time, so a 1 h bound around 0.1 s of thread
    work must not expire. It does: with a timer pending, the virtual selector jumps to it at once."""

    async def main():
        t0 = loop_time()
        await asyncio.wait_for(asyncio.to_thread(time.sleep, 0.1), 3600)
        return loop_time() - t0

    assert run_virtual(main()) == 0.0


def test_virtual_time_a_checkpointed_step_with_an_acquire_timeout_is_not_failed_by_a_checkpoint_write(tmp_path):
    """The same bug through the house: one GPU, two whole-GPU batches; the second waits (1 h bound)
    while the first runs a 10 s episode and its group is checkpointed (asyncio.to_thread). The step
    takes 20 s of virtual time; instead the queued acquire times out while the write's thread runs."""

    async def ten_seconds(sample, ctx):
        await asyncio.sleep(10)
        return AgentResult(tokens=[1, 2], response_length=1, response="x", loss_mask=[1], rollout_log_probs=[-0.1])

    rows = [Task(f"q{i}", "p", TaskConfig("x", n_samples=1)) for i in range(2)]
    spec = EvaluatorSpec("x", FunctionAgent(ten_seconds, lambda sample, result: {"score": 1.0}),
                         Resource(gpu=1, concurrency=1), Resource(gpu=1), batch_size=1)
    pool = PlacementPool(parse_cluster_layout(ONE_GPU, 8, 64))
    sched = TaskScheduler([spec], MultiDataSource([DatasetSpec("a", rows)], seed=0), pool,
                          SchedulerConfig(rollout_batch_size=2, acquire_timeout_s=3600, progress=False))
    steps = ResumableRollouts.over(sched, RolloutCheckpoint(tmp_path))

    async def main():
        t0 = loop_time()
        result = await steps.execute_rollout(0)
        return result, loop_time() - t0

    result, took = run_virtual(main())
    assert [s.status for g in result.groups for s in g] == [Status.COMPLETED] * 2
    assert took == 20.0

"""A rollout group's own identity (``TaskKey.GROUP_ID``), and what partial rollouts owe across a
failed step: a small dataset hands out the same task twice in one step and again each epoch, and
every group stays itself; a step that fails (before or after the scheduler returned) takes back
everything it held on the retry, with or without a checkpoint. Virtual time throughout."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_partial_carry import KEEP, Resuming
from test_partial_rollouts import LAYOUT, LongTail, Stream, make

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import run_virtual
from rayapp.core.contracts import SchedulerConfig
from rayapp.core.scheduler import TaskScheduler
from rayapp.envs.datasets.source import DatasetSpec, MultiDataSource
from rayapp.record import EpisodeRecord, TurnRecord
from rayapp.steps.checkpoint import CarriedGroup, RolloutCheckpoint
from rayapp.steps.filters import Verdict
from rayapp.steps.partial import PartialConfig, PartialRollouts
from rayapp.steps.runner import StepRunner
from rayapp.types import EvaluatorSpec, Resource, Sample, Status, Task, TaskConfig, TaskKey

GID = TaskKey.GROUP_ID.value


def two_rows(group=2):
    rows = [Task(f"row{i}", "p", TaskConfig("x", n_samples=group)) for i in range(2)]
    return MultiDataSource([DatasetSpec("tiny", rows, shuffle=False)], seed=0)


def gid(group):
    return group[0].metadata[GID]


def test_a_dataset_smaller_than_the_fetch_gives_each_group_its_own_identity(make_pool):
    agent = LongTail()
    sched, _ = make(make_pool, agent, two_rows(), batch=4)
    result = run_virtual(sched.execute_rollout(0))
    assert [g[0].task_id for g in result.groups] == ["row0", "row1", "row0", "row1"]
    assert [gid(g) for g in result.groups] == ["0/0", "0/1", "0/2", "0/3"]  # 4 groups, nothing merged
    assert all(s.metadata[GID] == gid(g) and [x.index for x in g] == [0, 1] for g in result.groups for s in g)
    keys = [(s.metadata[GID], s.index) for g in result.groups for s in g]
    assert len(keys) == len(set(keys)) == 8


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_partial_rollouts_over_a_small_dataset_keep_every_group_apart(make_pool, seed, batch):
    """The same task_id comes back each epoch while a group of it is carried: each group is put back
    together from its own samples only, and every fetched group comes back once or is still carried."""
    agent = Resuming(seed=seed)
    sched, _ = make(make_pool, agent, two_rows(group=3), batch=batch)
    partial = PartialRollouts.over(sched, PartialConfig(over_provision=2.0, max_staleness=3, policy="resume"))

    async def steps():
        return [await partial.execute_rollout(r) for r in range(6)]

    results = run_virtual(steps())
    returned = [gid(g) for r in results for g in r.groups]
    carried = [g.task.metadata[GID] for g in partial.carried()]
    fetched = sum(r.metrics["rollout/partial/fetched"] for r in results)
    assert len(returned) == len(set(returned)) == 6 * batch
    assert sorted(returned + carried) == sorted(set(returned + carried)) and len(returned + carried) == fetched
    for r in results:
        for g in r.groups:
            assert [s.index for s in g] == [0, 1, 2] and {s.metadata[GID] for s in g} == {gid(g)}


class FailOnce:
    """A filter (a plug-in) that raises on its first group: the step fails after the scheduler returned."""

    name = "fail_once"

    def __init__(self):
        self.failed = False

    def judge(self, group):
        if not self.failed:
            self.failed = True
            raise RuntimeError("filter broke")
        return Verdict(kept=list(group))


class FlakyPool:
    """A pool whose ``fail_at``-th acquire raises: the step fails inside the scheduler, after its fetch."""

    def __init__(self, pool, fail_at):
        self.pool, self.fail_at, self.calls = pool, fail_at, 0

    async def acquire_batch(self, request):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionError("pool unreachable")
        return await self.pool.acquire_batch(request)

    async def release_batch(self, tokens):
        await self.pool.release_batch(tokens)

    async def release_tokens(self, tokens):
        await self.pool.release_tokens(tokens)

    async def max_tokens_for(self, per_sample):
        return await self.pool.max_tokens_for(per_sample)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("fault", ["filter", "pool"])
def test_a_failed_step_retried_loses_and_repeats_no_fetched_task(make_pool, tmp_path, fault, checkpoint):
    agent, source = Resuming(seed=7), Stream(group=2)
    inner = make_pool(LAYOUT)
    pool = FlakyPool(inner, fail_at=5 if fault == "pool" else 0)
    spec = EvaluatorSpec("x", FunctionAgent(agent.run, agent.verify), batch_size=1,
                         resource=Resource(gpu=math.inf, concurrency=8), run_resource=Resource(gpu=0.25))
    sched = TaskScheduler([spec], source, pool, SchedulerConfig(rollout_batch_size=2, progress=False))
    runner = StepRunner(sched, filters=[FailOnce()] if fault == "filter" else [], partial=KEEP,
                        checkpoint=RolloutCheckpoint(tmp_path) if checkpoint else None)
    if fault == "filter":
        runner.filters[0].failed = True  # step 0 passes; step 1 fails once

    async def steps():
        delivered = [await runner.rollout(0)]
        if fault == "filter":
            runner.filters[0].failed = False
        with pytest.raises(Exception):  # noqa: B017 -- the filter's RuntimeError, or the batch's group of errors
            await runner.rollout(1)
        delivered += [await runner.rollout(1), await runner.rollout(2)]
        return delivered

    delivered = run_virtual(steps())
    returned = [g[0].task_id for r in delivered for g in r.groups]
    carried = [g.task.task_id for g in runner._rollouts.carried()]
    assert len(returned) == len(set(returned)) == 6  # nothing handed to the trainer twice
    assert sorted(returned + carried) == sorted(f"t{i}" for i in range(source.cursor))  # nothing lost
    assert inner.held == 0


class FailAt:
    """A filter that raises on its ``at``-th group (counted across steps)."""

    name = "fail_at"

    def __init__(self, at):
        self.at, self.seen = at, 0

    def judge(self, group):
        self.seen += 1
        if self.seen == self.at:
            raise RuntimeError("filter broke")
        return Verdict(kept=list(group))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 3), over=st.sampled_from([1.0, 1.5, 2.0]),
       policy=st.sampled_from(["restart", "resume"]), fail_pool_at=st.integers(0, 12),
       fail_filter_at=st.integers(0, 8))
def test_without_a_checkpoint_every_fetched_task_comes_back_once_or_is_still_carried(
        seed, batch, over, policy, fail_pool_at, fail_filter_at):
    agent, source = (Resuming if policy == "resume" else LongTail)(seed=seed), Stream(group=2)
    from rayapp.core.layout import parse_cluster_layout
    from rayapp.core.pool import PlacementPool

    inner = PlacementPool(parse_cluster_layout(LAYOUT, 8, 64))
    before = inner.snapshot()
    spec = EvaluatorSpec("x", FunctionAgent(agent.run, agent.verify), batch_size=1,
                         resource=Resource(gpu=math.inf, concurrency=8), run_resource=Resource(gpu=0.25))
    sched = TaskScheduler([spec], source, FlakyPool(inner, fail_pool_at),
                          SchedulerConfig(rollout_batch_size=batch, progress=False))
    runner = StepRunner(sched, filters=[FailAt(fail_filter_at)],
                        partial=PartialConfig(over_provision=over, max_staleness=2, policy=policy))

    async def steps():
        delivered = []
        for r in range(4):
            for _ in range(3):  # a failed step is asked for again, as a trainer does
                try:
                    delivered.append(await runner.rollout(r))
                    break
                except Exception:  # the faults under test
                    continue
        return delivered

    delivered = run_virtual(steps())
    assert len(delivered) == 4
    returned = [g[0].task_id for r in delivered for g in r.groups]
    carried = [g.task.task_id for g in runner._rollouts.carried()]
    assert len(returned) == len(set(returned)) == 4 * batch
    assert sorted(returned + carried) == sorted(f"t{i}" for i in range(source.cursor))
    assert inner.snapshot() == before


def test_a_carried_group_already_complete_is_returned_with_a_batch_of_one(make_pool, tmp_path):
    agent, source = Resuming(seed=5), Stream(group=2)
    task = run_virtual(source.get_tasks(1))[0]
    ended = [Sample(task.task_id, i, task.prompt, status=Status.COMPLETED,
                    episode=EpisodeRecord(turn_records=[TurnRecord(1, "e", weight_version=0)]))
             for i in (0, 1)]
    ck = RolloutCheckpoint(tmp_path)
    ck.begin(0, source.state_dict())
    ck.finish(0, source.state_dict(), [CarriedGroup(task, 0, ended)])
    sched, pool = make(make_pool, agent, source, batch=1)
    before = pool.snapshot()
    partial = PartialRollouts.over(sched, KEEP, RolloutCheckpoint(tmp_path))
    result = run_virtual(partial.execute_rollout(1))
    assert [g[0].task_id for g in result.groups] == [task.task_id]  # returned at once, not re-run when stale
    assert [s.index for s in result.groups[0]] == [0, 1] and not agent.started
    assert result.metrics["rollout/partial/fetched"] == 0 and pool.snapshot() == before
    # the next step runs fresh tasks as usual
    assert len(run_virtual(partial.execute_rollout(2)).groups) == 1


def test_the_scheduler_and_both_wrappers_are_one_rollouts_protocol_with_extras_by_keyword_only(make_pool,
                                                                                                 tmp_path):
    import inspect

    from rayapp.core.contracts import Rollouts
    from rayapp.steps.checkpoint import ResumableRollouts

    sched, _ = make(make_pool, LongTail())
    stack = [sched, ResumableRollouts.over(sched, RolloutCheckpoint(tmp_path)),
             PartialRollouts.over(sched, KEEP, RolloutCheckpoint(tmp_path))]
    assert all(isinstance(r, Rollouts) for r in stack)
    want = list(inspect.signature(Rollouts.execute_rollout).parameters.values())
    for r in stack:  # the protocol's parameters, then what a wrapper passes down: by keyword, with a default
        params = list(inspect.signature(type(r).execute_rollout).parameters.values())
        assert params[:len(want)] == want, type(r).__name__
        assert all(p.kind is p.KEYWORD_ONLY and p.default is None for p in params[len(want):]), type(r).__name__

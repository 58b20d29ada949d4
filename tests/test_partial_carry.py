"""Partial rollouts' carried groups across steps: none lost or duplicated whatever the episode
lengths (a property), and none lost or duplicated when the step's FINISHED record cannot be written
and a new manager takes over. Virtual time throughout (``core.clock.run_virtual``)."""

import asyncio
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_partial_rollouts import LAYOUT, TURNS, H, LongTail, Stream, ids, make

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import run_virtual
from rayapp.core.contracts import SchedulerConfig
from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool
from rayapp.core.scheduler import TaskScheduler
from rayapp.record import EpisodeRecord, ResumePoint, TurnRecord
from rayapp.steps import checkpoint as checkpoint_module
from rayapp.steps.checkpoint import CarriedGroup, RolloutCheckpoint
from rayapp.steps.partial import PartialConfig, PartialRollouts
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Sample, Status


class Resuming(LongTail):
    """LongTail keeping a resume point after each turn but the last, and going on from one, as the
    multi-turn agent does."""

    async def run(self, sample, ctx):
        point = ctx.record.start
        done = 0
        if point is not None:
            done = point.turns
            ctx.record.turns = done
            ctx.record.turn_records = list(point.turn_records)
            ctx.record.resume = point
        key = (sample.task_id, sample.index)  # a carried group runs only its samples not ended, by their index
        self.started[key] += 1
        hours = min(self.rng.lognormvariate(0, 1.1), 40.0)
        for turn in range(done + 1, TURNS + 1):
            await asyncio.sleep(hours * H / TURNS)
            ctx.record_turn(turn, "e")
            if turn < TURNS:
                ctx.record.resume = ResumePoint(turn, [], 0, [], [], list(ctx.record.turn_records))
        self.ended[key] += 1
        return AgentResult(tokens=[1, 2, 3], response_length=2)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 4), over=st.sampled_from([1.0, 1.25, 1.5, 2.0, 3.0]),
       policy=st.sampled_from(["restart", "resume"]), max_staleness=st.integers(0, 4), steps=st.integers(2, 5))
def test_no_group_is_lost_or_duplicated_across_steps(seed, batch, over, policy, max_staleness, steps):
    agent, source = (Resuming if policy == "resume" else LongTail)(seed=seed), Stream()
    pool = PlacementPool(parse_cluster_layout(LAYOUT, 8, 64))
    spec = EvaluatorSpec("x", FunctionAgent(agent.run, agent.verify), batch_size=1,
                         resource=Resource(gpu=math.inf, concurrency=8), run_resource=Resource(gpu=0.25))
    sched = TaskScheduler([spec], source, pool, SchedulerConfig(rollout_batch_size=batch, progress=False))
    cfg = PartialConfig(over_provision=over, max_staleness=max_staleness, policy=policy)
    partial = PartialRollouts.over(sched, cfg)
    before = pool.snapshot()

    async def run():
        return [await partial.execute_rollout(i) for i in range(steps)]

    results = run_virtual(run())
    returned = [t for r in results for t in ids(r.groups)]
    assert all(len(r.groups) == batch for r in results)
    assert len(returned) == len(set(returned))
    assert sorted(returned + [g.task.task_id for g in partial.carried()]) == sorted(
        f"t{i}" for i in range(source.cursor))
    assert all(s.status.value == "completed" for r in results for g in r.groups for s in g)
    assert all(r.metrics["rollout/partial/staleness_max"] <= max_staleness for r in results)
    turns = [[t.turn for t in s.episode.turn_records] for r in results for g in r.groups for s in g]
    assert all(t == list(range(1, TURNS + 1)) for t in turns)  # a resumed episode repeats no done turn
    assert pool.snapshot() == before and pool.held == 0
    n = source.group
    everything = [g for r in results for g in r.groups] + [g.samples for g in partial.carried() if g.samples]
    assert all([s.index for s in g] == list(range(n)) for g in everything)  # whole: 0..n-1, each once
    if policy == "resume" and max_staleness >= steps - 1:  # no group aged out: none restarted whole
        assert max(agent.ended.values(), default=0) <= 1  # a sample that ended is kept, never run again


class FailingFinish(RolloutCheckpoint):
    """A checkpoint whose FINISHED write of ``rollout`` fails its first ``fails`` tries."""

    def __init__(self, dir, rollout, fails):
        super().__init__(dir)
        self.rollout, self.fails, self.tries = rollout, fails, 0

    def finish(self, rollout_id, next_source_state=None, carried=None):
        if rollout_id == self.rollout:
            self.tries += 1
            if self.tries <= self.fails:
                raise OSError("disk full")
        super().finish(rollout_id, next_source_state, carried)


CFG = PartialConfig(over_provision=2.0)
KEEP = PartialConfig(over_provision=2.0, max_staleness=10, policy="resume")


@pytest.mark.parametrize("seed", [3, 17])
def test_resume_keeps_the_samples_that_ended_and_runs_only_the_others(seed):
    agent, source = Resuming(seed=seed), Stream(group=4)
    pool = PlacementPool(parse_cluster_layout(LAYOUT, 8, 64))
    spec = EvaluatorSpec("x", FunctionAgent(agent.run, agent.verify), batch_size=1,
                         resource=Resource(gpu=math.inf, concurrency=8), run_resource=Resource(gpu=0.25))
    sched = TaskScheduler([spec], source, pool, SchedulerConfig(rollout_batch_size=2, progress=False))
    partial, seen = PartialRollouts.over(sched, KEEP), []

    async def on_done(task, samples):
        seen.append((task.task_id, task.config.n_samples, [s.index for s in samples]))

    async def run():
        return [await partial.execute_rollout(i, on_done) for i in range(4)]

    results = run_virtual(run())
    kept = sum(r.metrics["rollout/partial/kept_samples"] for r in results)
    assert kept > 0  # some carried group had samples that ended: the case under test happened
    assert max(agent.ended.values()) == 1  # ... and none of them ran again
    # the trainer's callback and the step's groups see whole groups, under the group's own task
    assert all(n == 4 and idx == [0, 1, 2, 3] for _, n, idx in seen)
    assert sorted(t for t, _, _ in seen) == sorted(ids([g for r in results for g in r.groups]))
    # a kept sample keeps the weights that produced it: the staleness shows
    assert max(r.metrics["rollout/partial/staleness_max"] for r in results) >= 1


def test_restart_runs_a_carried_group_whole_again():
    agent, source = Resuming(seed=3), Stream(group=4)
    pool = PlacementPool(parse_cluster_layout(LAYOUT, 8, 64))
    spec = EvaluatorSpec("x", FunctionAgent(agent.run, agent.verify), batch_size=1,
                         resource=Resource(gpu=math.inf, concurrency=8), run_resource=Resource(gpu=0.25))
    sched = TaskScheduler([spec], source, pool, SchedulerConfig(rollout_batch_size=2, progress=False))
    partial = PartialRollouts.over(sched, PartialConfig(over_provision=2.0, max_staleness=10, policy="restart"))
    results = run_virtual(partial.execute_rollout(0)), run_virtual(partial.execute_rollout(1))
    assert results[1].metrics["rollout/partial/kept_samples"] == 0
    assert all(r.metrics["rollout/partial/staleness_max"] == 0 for r in results)


def test_kept_samples_survive_a_manager_restart(make_pool, tmp_path):
    agent0 = Resuming(seed=3)
    sched0, _ = make(make_pool, agent0, Stream(group=4), batch=2)
    run_virtual(PartialRollouts.over(sched0, KEEP, RolloutCheckpoint(tmp_path)).execute_rollout(0))
    saved = RolloutCheckpoint(tmp_path).carried(0)
    kept = {(g.task.task_id, s.index) for g in saved for s in g.samples if s.status.value != "pending"}
    assert kept and all([s.index for s in g.samples] == [0, 1, 2, 3] for g in saved if g.samples)

    agent1, source = Resuming(seed=4), Stream(group=4)
    sched1, _ = make(make_pool, agent1, source, batch=2)
    again = PartialRollouts.over(sched1, KEEP, RolloutCheckpoint(tmp_path))
    later = [run_virtual(again.execute_rollout(i)) for i in (1, 2, 3)]
    assert not kept & set(agent1.started)  # the new manager did not run a kept sample again
    returned = [(s.task_id, s.index) for r in later for g in r.groups for s in g]
    assert len(returned) == len(set(returned)) and kept <= set(returned) | {
        (g.task.task_id, s.index) for g in again.carried() for s in g.samples}


def test_a_finished_write_that_fails_then_succeeds_keeps_the_carried_groups(make_pool, tmp_path):
    sched, _ = make(make_pool, LongTail(seed=41), Stream(), batch=3)
    ck = FailingFinish(tmp_path, rollout=0, fails=checkpoint_module.FINISH_TRIES - 1)
    result = run_virtual(PartialRollouts.over(sched, CFG, ck).execute_rollout(0))
    assert ck.tries == checkpoint_module.FINISH_TRIES
    carried = RolloutCheckpoint(tmp_path).carried(0)
    assert len(result.groups) == 3 and len(carried) == 3
    assert not {g.task.task_id for g in carried} & set(ids(result.groups))


@pytest.mark.parametrize("agent_type,cfg", [(LongTail, CFG), (Resuming, KEEP)])
def test_a_failed_finished_write_fails_the_step_and_a_restarted_manager_loses_and_repeats_nothing(
        make_pool, tmp_path, agent_type, cfg):
    sched0, _ = make(make_pool, agent_type(seed=51), Stream(group=4), batch=3)
    first = run_virtual(PartialRollouts.over(sched0, cfg, RolloutCheckpoint(tmp_path)).execute_rollout(0))
    carried0 = {g.task.task_id for g in RolloutCheckpoint(tmp_path).carried(0)}

    # step 1 completes, but its FINISHED record (with what it carries on) cannot be written
    sched1, _ = make(make_pool, agent_type(seed=52), Stream(group=4), batch=3)
    ck = FailingFinish(tmp_path, rollout=1, fails=10 ** 6)
    with pytest.raises(RuntimeError, match=r"rollout 1: could not save the \d+ groups it carries on"):
        run_virtual(PartialRollouts.over(sched1, cfg, ck).execute_rollout(1))
    assert ck.tries == checkpoint_module.FINISH_TRIES
    assert RolloutCheckpoint(tmp_path).carried(1) is None  # nothing half-written
    # under resume, step 1's own checkpoint holds parts of carried groups (their samples not ended)
    parts = [g for g in RolloutCheckpoint(tmp_path).resume(1).groups.values() if len(g) < 4]
    assert bool(parts) == (cfg.policy == "resume")

    # a new manager over the same folder: the trainer runs step 1 again, then step 2
    source = Stream(group=4)
    sched2, _ = make(make_pool, agent_type(seed=53), source, batch=3)
    again = PartialRollouts.over(sched2, cfg, RolloutCheckpoint(tmp_path))
    second = run_virtual(again.execute_rollout(1))
    assert second.metrics["rollout/resumed_groups"] == 3.0  # the groups step 1 finished are not run again
    assert carried0 <= {g.task.task_id for g in RolloutCheckpoint(tmp_path).carried(0)}
    third = run_virtual(again.execute_rollout(2))
    returned = ids(first.groups) + ids(second.groups) + ids(third.groups)
    assert len(returned) == len(set(returned)) == 9
    assert carried0 <= set(returned) | {g.task.task_id for g in again.carried()}
    assert sorted(returned + [g.task.task_id for g in again.carried()]) == sorted(
        f"t{i}" for i in range(source.cursor))
    assert all([s.index for s in g] == [0, 1, 2, 3] for r in (first, second, third) for g in r.groups)


def test_a_carried_group_whose_samples_all_ended_is_returned_without_running(make_pool, tmp_path):
    agent, source = Resuming(seed=5), Stream(group=2)
    task = (run_virtual(source.get_tasks(1)))[0]
    ended = [Sample(task.task_id, i, task.prompt, status=Status.COMPLETED,
                    episode=EpisodeRecord(turn_records=[TurnRecord(1, "e", weight_version=0)]))
             for i in (1, 0)]
    ck = RolloutCheckpoint(tmp_path)
    ck.begin(0, source.state_dict())
    ck.finish(0, source.state_dict(), [CarriedGroup(task, 0, ended)])
    sched, _ = make(make_pool, agent, source, batch=2)
    seen = []

    async def on_done(t, samples):
        seen.append((t.task_id, [s.index for s in samples]))

    result = run_virtual(PartialRollouts.over(sched, KEEP, RolloutCheckpoint(tmp_path)).execute_rollout(1, on_done))
    assert ids(result.groups)[0] == task.task_id and [s.index for s in result.groups[0]] == [0, 1]
    assert (task.task_id, [0, 1]) in seen and len(seen) == 2
    assert not {k for k in agent.started if k[0] == task.task_id}  # nothing of it ran again
    assert result.metrics["rollout/partial/staleness_max"] == 1.0

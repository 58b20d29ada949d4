"""Partial rollouts: the scheduler's ``complete_after`` hook, and ``PartialRollouts`` over it (carried
groups, restart, staleness, metrics, the checkpoint). Everything runs in virtual time
(``core.clock.run_virtual``): episodes last hours and the loop's times are exact."""

import asyncio
import itertools
import math
import random
from collections import Counter

import msgspec
import pytest

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import run_virtual
from rayapp.core.contracts import SchedulerConfig, StepState
from rayapp.core.scheduler import TaskScheduler
from rayapp.record import EpisodeRecord, ResumePoint, TurnRecord
from rayapp.steps.checkpoint import CarriedGroup, RolloutCheckpoint
from rayapp.steps.partial import PartialConfig, PartialRollouts, staleness, stamp_versions
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Sample, Status, Task, TaskConfig

H = 3600.0
LAYOUT = '{"n0": {"gpus": [0, 1], "cpu": 64, "memory_gb": 256}}'  # 8 samples of gpu 0.25 at once
TURNS = 3


class Stream:
    """An endless seeded task stream with a cursor it saves and restores (a checkpointable source)."""

    def __init__(self, group=2):
        self.cursor, self.group, self.asked = 0, group, []

    async def get_tasks(self, n):
        self.asked.append(n)
        out = [Task(f"t{self.cursor + i}", "p", TaskConfig("x", n_samples=self.group)) for i in range(n)]
        self.cursor += n
        return out

    def state_dict(self):
        return {"cursor": self.cursor}

    def load_state_dict(self, state):
        self.cursor = state["cursor"]


class LongTail:
    """Episodes of ``TURNS`` turns whose length is lognormal in hours (seeded per sample and attempt);
    records every start and every run that ended."""

    def __init__(self, seed=0, version=None):
        self.rng, self.version = random.Random(seed), version
        self.started: Counter = Counter()
        self.ended: Counter = Counter()

    async def run(self, sample, ctx):
        key = (sample.task_id, sample.index)
        self.started[key] += 1
        hours = min(self.rng.lognormvariate(0, 1.1), 40.0)
        for turn in range(1, TURNS + 1):
            await asyncio.sleep(hours * H / TURNS)
            ctx.record_turn(turn, "e", weight_version=self.version(ctx) if self.version else None)
        self.ended[key] += 1
        return AgentResult(tokens=[1, 2, 3], response_length=2)

    async def verify(self, sample, result):
        return {"score": 1.0}


def make(make_pool, agent, source=None, batch=4, concurrency=8):
    spec = EvaluatorSpec("x", FunctionAgent(agent.run, agent.verify), batch_size=1,
                         resource=Resource(gpu=math.inf, concurrency=concurrency), run_resource=Resource(gpu=0.25))
    pool = make_pool(LAYOUT)
    sched = TaskScheduler([spec], source or Stream(), pool, SchedulerConfig(rollout_batch_size=batch, progress=False))
    return sched, pool


def ids(groups):
    return [g[0].task_id for g in groups]


# ---- the scheduler's hook -------------------------------------------------------------------------

def test_complete_after_returns_n_groups_and_hands_back_the_rest_with_their_turns(make_pool):
    agent = LongTail(seed=1)
    sched, pool = make(make_pool, agent, batch=6)
    before = pool.snapshot()
    result = run_virtual(sched.execute_rollout(0, complete_after=3))
    assert len(result.groups) == 3 and len(result.unfinished) == 3
    assert sched.status().state is StepState.DONE
    assert pool.snapshot() == before and pool.held == 0  # every cancelled episode's token is back
    assert sorted(ids(result.groups) + [u.task.task_id for u in result.unfinished]) == sorted(f"t{i}" for i in range(6))
    assert [u.index for u in result.unfinished] == sorted(u.index for u in result.unfinished)
    assert all(s.status is Status.COMPLETED for g in result.groups for s in g)
    cut = [s for u in result.unfinished for s in u.samples if s.status is Status.PENDING]
    assert cut, "some sample was cut short"
    for s in cut:  # what it did so far is on record: turns that ended, with the step's placement
        done = s.episode.turn_records
        assert len(done) == (s.episode.turns or 0) < TURNS
        assert agent.ended[(s.task_id, s.index)] == 0


def test_complete_after_is_checked():
    sched = TaskScheduler([EvaluatorSpec("x", FunctionAgent(lambda s, c: None, lambda s, r: {}))], Stream())
    with pytest.raises(ValueError, match="complete_after must be an int >= 0"):
        run_virtual(sched.execute_rollout(0, complete_after=-1))


def test_complete_after_zero_runs_nothing_and_hands_every_group_back(make_pool):
    agent = LongTail()
    sched, pool = make(make_pool, agent)
    before = pool.snapshot()
    result = run_virtual(sched.execute_rollout(0, complete_after=0))
    assert result.groups == [] and len(result.unfinished) == 4 and not agent.started
    assert all(s.status is Status.PENDING for u in result.unfinished for s in u.samples)
    assert pool.snapshot() == before


def test_without_complete_after_nothing_is_unfinished(make_pool):
    sched, _ = make(make_pool, LongTail())
    result = run_virtual(sched.execute_rollout(0))
    assert len(result.groups) == 4 and result.unfinished == []


# ---- partial rollouts over several steps -------------------------------------------------------------

def test_every_task_comes_back_exactly_once_across_steps(make_pool):
    agent, source = LongTail(seed=7), Stream()
    sched, pool = make(make_pool, agent, source, batch=4)
    partial = PartialRollouts.over(sched, PartialConfig(over_provision=1.5, max_staleness=1, policy="restart"))
    before = pool.snapshot()

    async def steps():
        out = []
        for i in range(6):
            out.append(await partial.execute_rollout(i))
            assert pool.snapshot() == before and pool.held == 0  # the pool is whole after every step
        return out

    results = run_virtual(steps())
    returned = [t for r in results for t in ids(r.groups)]
    carried = [g.task.task_id for g in partial.carried()]
    assert all(len(r.groups) == 4 for r in results)
    assert len(returned) == len(set(returned))  # no group returned twice
    fetched = [f"t{i}" for i in range(source.cursor)]
    assert sorted(returned + carried) == sorted(fetched)  # none lost, none duplicated
    carried_on = [r.metrics["rollout/partial/carried"] for r in results]
    assert source.asked == [6] + [6 - c for c in carried_on[:-1]]  # only enough new tasks to start 6 groups
    assert sum(r.metrics["rollout/partial/carried"] for r in results) > 0, "the long tail left groups unfinished"
    for prev, r in itertools.pairwise(results):  # carried groups come first, then the new ones
        assert r.metrics["rollout/partial/restarted"] == prev.metrics["rollout/partial/carried"]
        assert r.metrics["rollout/partial/resumed"] == 0
    assert all(r.metrics["rollout/partial/staleness_max"] <= 1 for r in results)
    assert all(r.unfinished == [] for r in results)


def test_carried_groups_are_the_unfinished_ones_and_restart_discards_their_turns(make_pool):
    agent, source = LongTail(seed=3), Stream()
    sched, _ = make(make_pool, agent, source, batch=2)
    partial = PartialRollouts.over(sched, PartialConfig(over_provision=2.0, policy="restart"))

    async def two():
        first = await partial.execute_rollout(0)
        carried = partial.carried()
        second = await partial.execute_rollout(1)
        return first, carried, second

    first, carried, second = run_virtual(two())
    assert sorted(ids(first.groups) + [g.task.task_id for g in carried]) == ["t0", "t1", "t2", "t3"]
    assert all(g.samples == [] and g.since == 0 for g in carried)  # restart keeps nothing of them
    again = [s for g in second.groups for s in g if s.task_id in {c.task.task_id for c in carried}]
    assert again, "a carried group came back in the next step"
    for s in again:
        assert agent.started[(s.task_id, s.index)] >= 2  # ran again from its first turn
        turns = s.episode.turn_records
        assert [t.turn for t in turns] == list(range(1, TURNS + 1))
        assert {t.weight_version for t in turns} == {1}  # all of this step's attempt


class Resumable(LongTail):
    """A LongTail agent that resumes: turn k's token is 100 x attempt + k, so a kept turn shows the
    attempt that made it; it keeps a ResumePoint after each turn, as a resumable agent does."""

    async def run(self, sample, ctx):
        key = (sample.task_id, sample.index)
        self.started[key] += 1
        point = ctx.record.start
        tokens = list(point.tokens) if point else [0]
        if point:
            ctx.record.turns, ctx.record.turn_records, ctx.record.resume = point.turns, list(point.turn_records), point
        hours = min(self.rng.lognormvariate(0, 1.1), 40.0)
        for turn in range((point.turns if point else 0) + 1, TURNS + 1):
            await asyncio.sleep(hours * H / TURNS)
            tokens.append(100 * self.started[key] + turn)
            ctx.record_turn(turn, "e")
            ctx.record.resume = ResumePoint(turn, list(tokens), 1, [1] * (len(tokens) - 1),
                                            [0.0] * (len(tokens) - 1), list(ctx.record.turn_records))
        self.ended[key] += 1
        return AgentResult(tokens=tokens, response_length=len(tokens) - 1)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_resume_keeps_completed_turns_and_staleness_stays_bounded(make_pool, max_staleness):
    agent, source = Resumable(seed=21), Stream()
    sched, _ = make(make_pool, agent, source, batch=4)
    partial = PartialRollouts.over(sched, PartialConfig(over_provision=1.5, max_staleness=max_staleness,
                                                        policy="resume"))
    cut: dict[tuple[str, int], list[int]] = {}  # the tokens each cut-short sample had kept

    async def steps():
        out = []
        for i in range(6):
            out.append(await partial.execute_rollout(i))
            for g in partial.carried():
                for s in g.samples:
                    if s.episode.resume is not None:
                        cut[(s.task_id, s.index)] = s.episode.resume.tokens
        return out

    results = run_virtual(steps())
    returned = [t for r in results for t in ids(r.groups)]
    assert len(returned) == len(set(returned))
    fetched = [f"t{i}" for i in range(source.cursor)]
    assert sorted(returned + [g.task.task_id for g in partial.carried()]) == sorted(fetched)
    assert all(r.metrics["rollout/partial/staleness_max"] <= max_staleness for r in results)
    # kept turns count as stale: some returned sample went on from an earlier step's turns
    assert (max(r.metrics["rollout/partial/staleness_max"] for r in results) > 0) == (max_staleness > 0)
    n_resumed = sum(r.metrics["rollout/partial/resumed"] for r in results)
    if max_staleness == 0:  # nothing may go on from an earlier step: every carried group restarts
        assert n_resumed == 0 and not cut.keys() & {(s.task_id, s.index) for r in results for g in r.groups
                                                    for s in g if s.tokens[1:2] and s.tokens[1] < 200}
        return
    assert n_resumed > 0
    resumed = 0
    for r in results:
        for g in r.groups:
            for s in g:
                kept = cut.get((s.task_id, s.index))
                if kept and agent.started[(s.task_id, s.index)] >= 2 and s.tokens[:len(kept)] == kept:
                    resumed += 1
                assert s.episode.start is None  # what the step was handed is no part of its result
    assert resumed > 0, "some returned sample went on from the turns it had kept"


def test_staleness_is_measured_from_the_engines_weight_versions(make_pool):
    # an engine one weight update behind the step: every turn is one step stale
    agent = LongTail(seed=5, version=lambda ctx: ctx.rollout_id - 1)
    sched, _ = make(make_pool, agent)
    partial = PartialRollouts.over(sched, PartialConfig(over_provision=1.0))
    result = run_virtual(partial.execute_rollout(3))
    assert result.metrics["rollout/partial/staleness_max"] == 1.0
    assert result.metrics["rollout/partial/staleness_mean"] == 1.0
    assert all(staleness(s, 3) == 1 for g in result.groups for s in g)


def test_weight_version_0_is_a_version_and_a_turn_without_one_is_the_steps():
    turns = [TurnRecord(1, "e", weight_version=0), TurnRecord(2, "e")]  # the engine's start, then no report
    s = Sample("t", 0, "p", episode=EpisodeRecord(turn_records=turns))
    stamp_versions([s], 3)
    assert [t.weight_version for t in s.episode.turn_records] == [0, 3] and staleness(s, 3) == 3


def test_a_restarted_manager_takes_up_the_carried_groups_from_the_checkpoint(make_pool, tmp_path):
    agent, source = LongTail(seed=11), Stream()
    sched, _ = make(make_pool, agent, source, batch=3)
    cfg = PartialConfig(over_provision=2.0, policy="restart")
    first = run_virtual(PartialRollouts.over(sched, cfg, RolloutCheckpoint(tmp_path)).execute_rollout(0))
    carried = [g.task.task_id for g in RolloutCheckpoint(tmp_path).carried(0)]
    assert len(carried) == 3 and not set(carried) & set(ids(first.groups))

    # a new process: a fresh source, scheduler and wrapper over the same folder
    source2 = Stream()
    sched2, _ = make(make_pool, LongTail(seed=12), source2, batch=3)
    again = PartialRollouts.over(sched2, cfg, RolloutCheckpoint(tmp_path))
    second = run_virtual(again.execute_rollout(1))
    assert source2.cursor == 6 + 3  # went on from where step 0 left the stream: 3 new tasks after 3 carried
    returned = ids(first.groups) + ids(second.groups) + [g.task.task_id for g in again.carried()]
    assert sorted(returned) == sorted(f"t{i}" for i in range(9))
    assert second.metrics["rollout/partial/restarted"] == 3.0


def test_carried_groups_survive_the_checkpoints_encoding(tmp_path):
    ck = RolloutCheckpoint(tmp_path)
    ck.begin(0, {"cursor": 0})
    task = Task("t9", [{"role": "user", "content": "hi"}], TaskConfig("x", n_samples=2),
                metadata={"_dataset_cfg": {"temperature": 0.5}})
    ck.finish(0, {"cursor": 10}, [CarriedGroup(task, 0)])
    [back] = RolloutCheckpoint(tmp_path).carried(0)
    assert msgspec.to_builtins(back) == msgspec.to_builtins(CarriedGroup(task, 0))
    assert RolloutCheckpoint(tmp_path).carried(1) is None


def test_the_recipe_turns_partial_rollouts_on_and_refuses_a_bad_setting(tmp_path):
    import yaml

    from rayapp.cli import ROOT
    from rayapp.recipe import RecipeError, build_step_runner, parse_recipe

    args = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())["applications"][0]["args"]
    assert parse_recipe(args).scheduler.partial is None
    args["scheduler"] = {**args.get("scheduler", {}), "partial": {"over_provision": 1.5, "max_staleness": 2},
                         "checkpoint_dir": str(tmp_path)}
    cfg = parse_recipe(args)
    assert cfg.scheduler.partial == PartialConfig(over_provision=1.5, max_staleness=2, policy="resume")

    async def not_called(*a, **kw):
        raise AssertionError("the wiring must not run or open anything")

    runner = build_step_runner(cfg, {"student": object()}, None, executor=not_called, open_sandbox=not_called)
    assert isinstance(runner._rollouts, PartialRollouts) and runner._rollouts.config == cfg.scheduler.partial
    for bad in ({"over_provision": 0.5}, {"policy": "later"}, {"max_staleness": -1}, {"overprovision": 2}):
        args["scheduler"]["partial"] = bad
        with pytest.raises(RecipeError, match=r"\$\.scheduler\.partial"):
            parse_recipe(args)


def test_a_partial_step_cut_short_resumes_with_the_same_carried_and_new_tasks(make_pool, tmp_path):
    cfg = PartialConfig(over_provision=2.0)
    sched, _ = make(make_pool, LongTail(seed=31), Stream(), batch=3)
    first = run_virtual(PartialRollouts.over(sched, cfg, RolloutCheckpoint(tmp_path)).execute_rollout(0))
    carried = {g.task.task_id for g in RolloutCheckpoint(tmp_path).carried(0)}

    async def killed_mid_step():  # the manager dies once step 1 has finished some of its groups
        sched1, _ = make(make_pool, LongTail(seed=32), Stream(), batch=3)
        done = []

        async def on_done(task, samples):
            done.append(task.task_id)

        wrapper = PartialRollouts.over(sched1, cfg, RolloutCheckpoint(tmp_path))
        step = asyncio.create_task(wrapper.execute_rollout(1, on_done))
        while not done:
            await asyncio.sleep(60)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        return done

    done_before = run_virtual(killed_mid_step())
    sched2, _ = make(make_pool, LongTail(seed=33), Stream(), batch=3)
    again = PartialRollouts.over(sched2, cfg, RolloutCheckpoint(tmp_path))
    second = run_virtual(again.execute_rollout(1))
    assert second.metrics["rollout/resumed_groups"] == len(done_before)  # not run again
    assert set(done_before) <= set(ids(second.groups))
    returned = ids(first.groups) + ids(second.groups) + [g.task.task_id for g in again.carried()]
    assert sorted(returned) == sorted(f"t{i}" for i in range(9)) and carried <= set(returned)


def test_a_resumed_step_counts_every_sample_it_returns(make_pool):
    """Kept samples were run by an earlier step, but the step returns them: its failure classes and
    sample statistics count what it returns, not only what it ran."""
    sched, _ = make(make_pool, Resumable(seed=21), Stream(), batch=4)
    partial = PartialRollouts.over(sched, PartialConfig(over_provision=1.5, max_staleness=2, policy="resume"))

    async def steps():
        return [await partial.execute_rollout(i) for i in range(6)]

    results = run_virtual(steps())
    assert sum(r.metrics["rollout/partial/kept_samples"] for r in results) > 0, "some step brought kept samples"
    for r in results:
        returned = sum(len(g) for g in r.groups)
        assert r.metrics["rollout/success"] == returned  # every sample of this agent is solved
        assert r.metrics["rollout/default/n_samples"] == returned


def test_a_trainer_that_goes_back_without_a_checkpoint_loses_no_carried_group(make_pool):
    """Steps 0..2, then the trainer asks step 0 again (its own checkpoint was older): the groups step 2
    carried on are taken up, afresh, by the steps that follow, not dropped."""
    agent, source = Resumable(seed=21), Stream()
    sched, _ = make(make_pool, agent, source, batch=4)
    partial = PartialRollouts.over(sched, PartialConfig(over_provision=2.0, max_staleness=2, policy="resume"))

    async def steps(order):
        return [await partial.execute_rollout(i) for i in order]

    run_virtual(steps([0, 1, 2]))
    outstanding = {g.task.task_id for g in partial.carried()}
    assert outstanding, "step 2 carried groups on"
    again = run_virtual(steps([0, 1, 2, 3]))
    returned = [t for r in again for t in ids(r.groups)]
    assert len(returned) == len(set(returned))
    assert outstanding <= set(returned) | {g.task.task_id for g in partial.carried()}
    assert again[0].metrics["rollout/partial/restarted"] == len(outstanding)

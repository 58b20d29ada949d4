"""Early release: a batch's token goes back to the global pool as soon as its sample ended and no
sample of the batch waits for one; a pool whose ``release_tokens`` frees nothing (``"hold"`` here)
keeps the spec's hold-until-the-batch-ends. Everything runs in virtual time
(``core.clock.run_virtual``): episodes last hours, and the times asserted are the loop's, exact."""

import asyncio
import contextlib
import logging
import math
import random

import pytest
from conftest import run

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import loop_time, run_virtual
from rayapp.core.contracts import StepContext
from rayapp.core.evaluator import Evaluator, TaskRun
from rayapp.core.scheduler import SchedulerConfig, StepState, TaskScheduler
from rayapp.recipe import RecipeError, parse_recipe
from rayapp.types import (
    AgentResult,
    EvaluatorSpec,
    Resource,
    Sample,
    SamplingParams,
    Status,
    StoppingCriteria,
    Task,
    TaskConfig,
    Token,
)

H = 3600.0
ONE_GPU = '{"n0": {"gpus": [0], "cpu": 8, "memory_gb": 64}}'  # two samples of gpu 0.5 at once


class RecordingPool:
    """The core pool behind the scheduler's Pool protocol, checking as it goes that a token is never
    released twice and never while its sample runs (``running``: token ids of running samples)."""

    def __init__(self, pool, running, hold=False):
        self.pool, self.running, self.hold = pool, running, hold
        self.granted: list[tuple[float, list[int]]] = []  # (when, token ids) per admitted batch
        self.early: list[tuple[float, int]] = []  # (when, token id) per early release
        self.closed: list[list[int]] = []  # token ids of each release_batch
        self.fail_early = False

    async def acquire_batch(self, request):
        tokens = await self.pool.acquire_batch(request)
        self.granted.append((loop_time(), [t.token_id for t in tokens]))
        return tokens

    async def release_tokens(self, tokens):
        if self.hold:  # a pool that frees nothing before release_batch
            return
        released = {tid for _, tid in self.early}
        for t in tokens:
            assert t.token_id not in self.running, f"token {t.token_id} released while its sample runs"
            assert t.token_id not in released, f"token {t.token_id} released twice"
            assert not any(t.token_id in c for c in self.closed), f"token {t.token_id} released after its batch"
        if self.fail_early:
            raise ConnectionError("pool went away")
        self.early += [(loop_time(), t.token_id) for t in tokens]
        await self.pool.release_tokens(tokens)

    async def release_batch(self, tokens):
        ids = [t.token_id for t in tokens]
        assert not self.running.intersection(ids), "a batch closed while one of its samples runs"
        self.closed.append(ids)
        await self.pool.release_batch(tokens)

    async def max_tokens_for(self, per_sample):
        return await self.pool.max_tokens_for(per_sample)


class Timed:
    """An agent whose sample (task_id, index) runs ``hours[...]`` hours (default 1); it records the
    tokens its running samples hold, when each started and on which token, and how often each ran."""

    def __init__(self, hours=None):
        self.hours = hours or {}
        self.running: set[int] = set()
        self.started: dict[tuple[str, int], tuple[float, int | None]] = {}
        self.runs: dict[tuple[str, int], int] = {}

    async def run(self, sample, ctx):
        key = (sample.task_id, sample.index)
        self.runs[key] = self.runs.get(key, 0) + 1
        tid = ctx.token.token_id if ctx.token else None
        assert tid not in self.running, "two running samples share a token"
        self.running.add(tid)
        self.started[key] = (loop_time(), tid)
        hours = self.hours.get(key, 1)
        try:
            if hours:  # 0: an episode that ends without ever waiting on the loop
                await asyncio.sleep(hours * H)
        except BaseException:  # cancelled: the episode ends here
            self.running.discard(tid)
            raise
        return AgentResult(tokens=[1, 2], response_length=1, response="x")

    async def evaluate(self, sample, result, ctx):
        try:
            if self.hours.get((sample.task_id, sample.index), 1):
                await asyncio.sleep(0)  # the verify phase still holds the token
        finally:
            self.running.discard(ctx.token.token_id if ctx.token else None)
        return {"score": 1.0}


class Source:
    def __init__(self, tasks):
        self.tasks = tasks

    async def get_tasks(self, n):
        return list(self.tasks[:n])


def tasks_of(*n_samples):
    return [Task(f"t{i}", "p", TaskConfig("x", n_samples=n)) for i, n in enumerate(n_samples)]


def scheduler(make_pool, agent, tasks, release="early", concurrency=2, pool=None):
    spec = EvaluatorSpec("x", agent, batch_size=1, resource=Resource(gpu=math.inf, concurrency=concurrency),
                         run_resource=Resource(gpu=0.5))
    core = pool or make_pool(ONE_GPU)
    recording = RecordingPool(core, agent.running, hold=release == "hold")
    sched = TaskScheduler([spec], Source(tasks), recording,
                          SchedulerConfig(rollout_batch_size=len(tasks), progress=False))
    return sched, recording, core


# ---- a later batch starts while an earlier batch's slow sample still runs ---------------------------

@pytest.mark.parametrize(("release", "second_starts"), [("early", 1 * H), ("hold", 10 * H)])
def test_a_later_batch_is_admitted_while_a_slow_sample_runs_only_with_early_release(make_pool, release,
                                                                                    second_starts):
    # t0: two samples (10 h and 1 h) holding both tokens of the pool; t1: one sample, one token.
    agent = Timed({("t0", 0): 10})
    sched, pool, _ = scheduler(make_pool, agent, tasks_of(2, 1), release)
    result = run_virtual(sched.execute_rollout(0))
    assert agent.started[("t1", 0)][0] == second_starts
    assert [s.status for g in result.groups for s in g] == [Status.COMPLETED] * 3
    if release == "early":
        assert [when for when, _ in pool.early] == [1 * H, 2 * H, 10 * H]  # each token when its sample ended
    else:
        assert pool.early == []
    assert sorted(map(sorted, pool.closed)) == sorted(sorted(ids) for _, ids in pool.granted)


def test_samples_reuse_the_batch_tokens_before_any_goes_back(make_pool):
    # one batch of 4 samples on 2 tokens: samples 2 and 3 wait for tokens, then take the batch's own
    agent = Timed({("t0", 0): 1, ("t0", 1): 1, ("t0", 2): 1, ("t0", 3): 5})
    sched, pool, _ = scheduler(make_pool, agent, tasks_of(4))
    run_virtual(sched.execute_rollout(0))
    [(_, granted)] = pool.granted
    assert [agent.started[("t0", i)][0] for i in range(4)] == [0, 0, 1 * H, 1 * H]
    assert {agent.started[("t0", i)][1] for i in range(4)} == set(granted)  # only the batch's tokens
    # none went back while a sample waited (before 1 h); each once, when its last sample ended
    assert sorted(pool.early) == sorted([(2 * H, agent.started[("t0", 2)][1]), (6 * H, agent.started[("t0", 3)][1])])


def test_with_a_holding_pool_every_token_stays_until_the_batch_closes(make_pool):
    agent = Timed({("t0", 0): 1, ("t0", 1): 3, ("t0", 2): 1})
    sched, pool, core = scheduler(make_pool, agent, tasks_of(3, 1), release="hold")

    async def main():
        step = asyncio.ensure_future(sched.execute_rollout(0))
        await asyncio.sleep(2.5 * H)  # t0's samples 0 and 2 ended; sample 1 runs; t1 waits
        held, waiting = core.held, core.waiting
        await step
        return held, waiting

    assert run_virtual(main()) == (2, 1)
    assert pool.early == [] and agent.started[("t1", 0)][0] == 3 * H


def test_a_failing_early_release_leaves_the_token_to_the_batch_close(make_pool, caplog):
    agent = Timed({("t0", 0): 3})
    sched, pool, core = scheduler(make_pool, agent, tasks_of(2, 1))
    pool.fail_early = True
    with caplog.at_level(logging.WARNING, logger="rayapp.core.evaluator"):
        result = run_virtual(sched.execute_rollout(0))
    assert [s.status for g in result.groups for s in g] == [Status.COMPLETED] * 3
    assert "early release of 1 tokens failed" in caplog.text
    assert agent.started[("t1", 0)][0] == 3 * H  # nothing went back early: t1 waited for t0's close
    assert core.batches() == []


def test_tokens_beyond_the_concurrency_ceiling_go_back_at_once():
    # a batch granted 3 tokens that may run only 1 sample at a time can never use 2 of them
    released = []

    async def release(tokens):
        released.append((loop_time(), sorted(t.token_id for t in tokens)))

    agent = Timed()
    task = Task("t", "p", TaskConfig("x", n_samples=3))
    group = TaskRun(task, [Sample("t", i, "p") for i in range(3)], StoppingCriteria(), SamplingParams())
    toks = [Token(i, "n0", (0,), 0.25, 0.0, 0.0) for i in range(3)]
    ev = Evaluator(EvaluatorSpec("x", agent, Resource(concurrency=1)), StepContext(0), tokens=toks, release=release)
    run_virtual(ev.run([group]))
    used = agent.started[("t", 0)][1]
    assert released == [(0, sorted(set(range(3)) - {used})), (3 * H, [used])]
    assert {tid for _, tid in agent.started.values()} == {used}


def test_tokens_no_worker_needs_go_back_once_the_first_sample_waits():
    # samples 0 and 1 end without ever waiting on the loop; sample 2 runs 5 h on the same worker's
    # token: the batch's other two tokens are of no use to it and go back at 0 h, not at 5 h
    released, ran = [], []

    async def release(tokens):
        released.append((loop_time(), sorted(t.token_id for t in tokens)))

    async def run_fn(sample, ctx):
        ran.append((sample.index, ctx.token.token_id))
        if sample.index == 2:
            await asyncio.sleep(5 * H)
        return AgentResult(tokens=[1, 2], response_length=1, response="x")

    task = Task("t", "p", TaskConfig("x", n_samples=3))
    group = TaskRun(task, [Sample("t", i, "p") for i in range(3)], StoppingCriteria(), SamplingParams())
    toks = [Token(i, "n0", (0,), 0.25, 0.0, 0.0) for i in range(3)]
    async def verify(sample, result):  # a coroutine: a plain function would wait for its thread
        return {"score": 1.0}

    spec = EvaluatorSpec("x", FunctionAgent(run_fn, verify), Resource(concurrency=3))
    run_virtual(Evaluator(spec, StepContext(0), tokens=toks, release=release).run([group]))
    [used] = {tid for _, tid in ran}
    assert [i for i, _ in ran] == [0, 1, 2]
    assert released == [(0, sorted(set(range(3)) - {used})), (5 * H, [used])]


# ---- every sample once, the pool whole, whatever happens ------------------------------------------

def _random_tasks(rng):
    tasks = tasks_of(*(rng.randint(1, 4) for _ in range(rng.randint(1, 6))))
    hours = {(t.task_id, i): rng.choice([0, 0.5, 1, 2, 7]) for t in tasks for i in range(t.config.n_samples)}
    return tasks, hours


@pytest.mark.parametrize("release", ["early", "hold"])
def test_every_sample_comes_back_once_and_the_pool_is_whole_after_each_step(make_pool, release):
    rng = random.Random(7)
    core = make_pool('{"n0": {"gpus": [0, 1], "cpu": 8, "memory_gb": 64}}')
    initial = core.snapshot()

    async def steps():
        for step in range(40):
            tasks, hours = _random_tasks(rng)
            agent = Timed(hours)
            sched, pool, _ = scheduler(None, agent, tasks, release, concurrency=rng.randint(1, 3), pool=core)
            result = await sched.execute_rollout(step)
            assert [(s.task_id, s.index) for g in result.groups for s in g] == list(hours)
            assert agent.runs == dict.fromkeys(hours, 1)
            assert all(s.status is Status.COMPLETED for g in result.groups for s in g)
            assert core.snapshot() == initial and core.batches() == [] and core.waiting == 0
            early = [tid for _, tid in pool.early]
            assert len(early) == len(set(early)) and set(early) <= {t for _, ids in pool.granted for t in ids}

    run_virtual(steps())


@pytest.mark.parametrize("release", ["early", "hold"])
def test_a_step_cancelled_at_random_moments_or_failed_by_a_callback_leaves_the_pool_whole(make_pool, release):
    rng = random.Random(11)
    core = make_pool('{"n0": {"gpus": [0, 1], "cpu": 8, "memory_gb": 64}}')
    initial = core.snapshot()

    async def steps():
        outcomes = set()
        for step in range(120):
            tasks, hours = _random_tasks(rng)
            agent = Timed(hours)
            sched, pool, _ = scheduler(None, agent, tasks, release, concurrency=rng.randint(1, 3), pool=core)
            bad = rng.choice([None, *(t.task_id for t in tasks)])

            async def on_done(task, samples, bad=bad):
                if task.task_id == bad:
                    raise RuntimeError("collector broke")

            run_step = asyncio.ensure_future(sched.execute_rollout(step, on_task_done=on_done))
            await asyncio.sleep(rng.choice([0, rng.uniform(0, 8 * H)]))
            run_step.cancel()
            try:
                await run_step
                outcomes.add("done")
            except asyncio.CancelledError:
                outcomes.add("cancelled")
                assert sched.status().state is StepState.CANCELLED
            except ExceptionGroup as e:
                assert e.subgroup(RuntimeError) is not None
                outcomes.add("failed")
                assert sched.status().state is StepState.FAILED
            assert not agent.running, "a sample still runs after its step ended"
            assert core.snapshot() == initial and core.batches() == [] and core.waiting == 0
            early = [tid for _, tid in pool.early]
            assert len(early) == len(set(early))
        return outcomes

    assert run_virtual(steps()) == {"done", "cancelled", "failed"}


# ---- settings ----------------------------------------------------------------------------------------

def test_a_pool_without_release_tokens_is_refused_with_the_way_to_hold(make_pool):
    class OldPool:
        async def acquire_batch(self, request): ...

        async def release_batch(self, tokens): ...

        async def max_tokens_for(self, per_sample): ...

    spec = EvaluatorSpec("x", Timed())
    with pytest.raises(TypeError, match=r"pool OldPool\.release_tokens: missing.*no-op"):
        TaskScheduler([spec], Source([]), OldPool(), SchedulerConfig())


@pytest.mark.parametrize(("section", "key", "value", "now"), [
    ("scheduler", "release", "batch_end", "release: early"), ("scheduler", "release", "early", "release: early"),
    ("pool", "work", "tasks", "work: hosts"), ("pool", "work", "hosts", "work: hosts")])
def test_an_old_recipe_setting_a_removed_mode_is_refused_naming_the_key(section, key, value, now):
    import yaml

    from rayapp.cli import ROOT

    args = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())["applications"][0]["args"]
    assert not hasattr(parse_recipe(args).scheduler, "release")
    args[section] = {**args.get(section, {}), key: value}
    with pytest.raises(RecipeError, match=rf"\$\.{section}\.{key}: {key}: '{value}' removed: .*{now}.*delete the key"):
        parse_recipe(args)


def test_the_pool_client_gives_tokens_back_in_one_bounded_call():
    from rayapp.actors.pool_client import PoolClient
    from rayapp.actors.pool_wire import unpack_tokens

    calls = []

    class Method:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args):
            return asyncio.ensure_future(self.fn(*args))

    async def release_tokens(tokens):
        calls.append(tokens)

    async def hang(tokens):
        await asyncio.sleep(3600)

    tokens = [Token(1, "n0", (0,), 0.5, 0.0, 0.0)]
    run(PoolClient(type("H", (), {"release_tokens": Method(release_tokens)})(), owner="m").release_tokens(tokens))
    assert [unpack_tokens(c, "release_tokens") for c in calls] == [tokens]
    slow = PoolClient(type("H", (), {"release_tokens": Method(hang)})(), owner="m", call_timeout_s=0.01)
    with pytest.raises(TimeoutError):
        run(slow.release_tokens(tokens))


class LatePool:
    """A pool whose calls arrive ``delay_s`` late (a remote pool over a slow link): a call cancelled
    on its way never reaches the pool. Records when each call arrives."""

    def __init__(self, pool, delay_s, hold=False):
        self.pool, self.delay_s, self.hold, self.arrived = pool, delay_s, hold, []

    async def _arrive(self, name):
        await asyncio.sleep(self.delay_s)
        self.arrived.append((loop_time(), name))

    async def acquire_batch(self, request):
        await self._arrive("acquire_batch")
        return await self.pool.acquire_batch(request)

    async def release_tokens(self, tokens):
        if self.hold:  # a pool that frees nothing before release_batch
            return
        await self._arrive("release_tokens")
        await self.pool.release_tokens(tokens)

    async def release_batch(self, tokens):
        await self._arrive("release_batch")
        await self.pool.release_batch(tokens)

    async def max_tokens_for(self, per_sample):
        return await self.pool.max_tokens_for(per_sample)


@pytest.mark.parametrize("release", ["early", "hold"])
@pytest.mark.parametrize("seed", range(6))
def test_a_release_in_flight_lands_when_complete_after_or_a_cancellation_cuts_the_batches(make_pool, release, seed):
    """Batches finish one after another while the step completes (``complete_after``) or is cancelled:
    a finished batch's ``release_batch`` is on its way then, and still reaches the pool; the pool is
    back to its snapshot when the step returns, and no call reaches it afterwards."""

    rng = random.Random(seed)
    hours = {(f"t{i}", 0): rng.choice([0.5, 1, 1.5, 2, 8]) for i in range(5)}
    core = make_pool('{"n0": {"gpus": [0, 1, 2], "cpu": 8, "memory_gb": 64}}')
    before = core.snapshot()
    late = LatePool(core, delay_s=rng.choice([0.25, 0.5, 1.0]) * H, hold=release == "hold")
    spec = EvaluatorSpec("x", Timed(hours), batch_size=1, resource=Resource(gpu=math.inf, concurrency=2),
                         run_resource=Resource(gpu=1))
    sched = TaskScheduler([spec], Source(tasks_of(1, 1, 1, 1, 1)), late,
                          SchedulerConfig(rollout_batch_size=5, progress=False))
    cancel_at = rng.choice([None, 1.2 * H, 2.7 * H])

    async def step():
        run_step = asyncio.ensure_future(sched.execute_rollout(0, complete_after=rng.randint(1, 4)))
        if cancel_at is not None:
            await asyncio.sleep(cancel_at)
            run_step.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run_step
        returned = loop_time()
        await asyncio.sleep(100 * H)  # anything still on its way arrives by then
        return returned

    returned = run_virtual(step())
    assert core.snapshot() == before and core.held == 0
    assert all(when <= returned for when, _ in late.arrived), "a pool call arrived after the step returned"

"""The group stream (``core.stream``) in virtual time (``core.clock.run_virtual``): the staleness bound
holds for every trained group whatever the episode lengths, trainer times and batch sizes; every
group is delivered once or reported; the cap on unacked groups holds the buffer; close leaves nothing
running and the pool as it was; a restart delivers again what was not acked, never what was."""

import asyncio
import math
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import loop_time, run_virtual
from rayapp.core.contracts import SchedulerConfig
from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool
from rayapp.core.scheduler import TaskScheduler
from rayapp.core.stream import GroupStream, StreamConfig, drive
from rayapp.core.stream_log import MemoryStreamLog
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Status, Task, TaskConfig

H = 3600.0
LAYOUT = '{"n0": {"gpus": [0, 1], "cpu": 64, "memory_gb": 256}}'  # 8 samples of gpu 0.25 at once


class Source:
    """``limit`` tasks (None: endless), ``group`` samples each; counts what it handed out."""

    def __init__(self, limit=None, group=2, delay=0.0):
        self.cursor, self.limit, self.group, self.delay = 0, limit, group, delay

    async def get_tasks(self, n):
        if self.delay:
            await asyncio.sleep(self.delay)  # a remote dataset: a close may come while it answers
        n = n if self.limit is None else min(n, self.limit - self.cursor)
        out = [Task(f"t{self.cursor + i}", "p", TaskConfig("x", n_samples=self.group)) for i in range(n)]
        self.cursor += n
        return out


class Agent:
    """Episodes of two turns, lognormal in hours (seeded); ``version()`` is what the engine reports
    for a turn (None: it names no weights). Counts starts and what runs now."""

    def __init__(self, seed=0, version=None, spread=1.1):
        self.rng, self.version, self.spread = random.Random(seed), version, spread
        self.started, self.running = 0, 0

    async def run(self, sample, ctx):
        self.started += 1
        self.running += 1
        try:
            hours = min(self.rng.lognormvariate(0, self.spread), 30.0)
            for turn in (1, 2):
                await asyncio.sleep(hours * H / 2)
                ctx.record_turn(turn, "e", weight_version=self.version() if self.version else None)
            return AgentResult(tokens=[1, 2, 3], response_length=2)
        finally:
            self.running -= 1

    async def verify(self, sample, result):
        return {"score": 1.0}


def make(agent, source, gpu=0.25):
    pool = PlacementPool(parse_cluster_layout(LAYOUT, 8, 64))
    spec = EvaluatorSpec("x", FunctionAgent(agent.run, agent.verify), batch_size=2,
                         resource=Resource(gpu=math.inf, concurrency=8), run_resource=Resource(gpu=gpu))
    return TaskScheduler([spec], source, pool, SchedulerConfig(progress=False)), pool


def accounted(source, delivered, report):
    """Every task the source handed out is delivered once, or named once in the report."""
    got = Counter(g.task.task_id for g in delivered)
    got.update(g.task.task_id for g in report.undelivered)
    got.update(t.task_id for t in report.cancelled)
    return got == Counter(f"t{i}" for i in range(source.cursor))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 4), eta=st.sampled_from([0, 1, 2]),
       tasks=st.integers(1, 14), group=st.integers(1, 3), train_h=st.floats(0.0, 3.0),
       extra_cap=st.integers(0, 4), engine_reports=st.booleans(), minibatch=st.integers(1, 4))
def test_every_trained_group_is_within_the_bound_and_delivered_once(seed, batch, eta, tasks, group, train_h,
                                                                     extra_cap, engine_reports, minibatch):
    rng = random.Random(seed)
    streams = []
    agent = Agent(seed, version=(lambda: streams[0].version) if engine_reports else None)
    source = Source(limit=tasks, group=group)
    sched, pool = make(agent, source)
    before = pool.snapshot()
    cap = batch + extra_cap
    config = StreamConfig(batch_size=batch, max_staleness=eta, max_unacked=cap)

    async def trainer(stream):
        streams.append(stream)
        trained = []
        while True:
            n = min(minibatch, stream.bound.left)
            got = await stream.next_batch(n)
            assert stream.status().waiting + stream.status().unacked <= cap
            trained += got
            if got:
                await asyncio.sleep(rng.uniform(0, train_h) * H)  # the train step, on the loop's clock
                await stream.ack(g.group_id for g in got)
            if len(got) < n:
                return trained  # the source ran dry and every group was handed over
            if stream.bound.left == 0:
                stream.set_version(stream.version + 1)

    trained, report = run_virtual(drive(sched, config, trainer))
    ids = [g.group_id for g in trained]
    assert len(ids) == len(set(ids)) == tasks  # all delivered, once each
    assert not report.unacked and not report.undelivered and not report.cancelled
    for g in trained:
        assert g.trained_version - g.version <= eta, (g.group_id, g.version, g.trained_version)
        assert g.staleness() <= eta
        assert [s.index for s in g.samples] == list(range(group))
        assert all(s.status is Status.COMPLETED for s in g.samples)
        assert all(t.weight_version is not None for s in g.samples for t in s.episode.turn_records)
    assert streams[0].peak <= cap
    assert accounted(source, trained, report)
    assert pool.snapshot() == before and pool.held == 0 and not pool.batches()


def test_a_straggler_is_waited_for_at_its_deadline_and_trained_within_the_bound():
    """B = 1, η = 1: one group runs 10 h, the others 1 h. Taking groups in finish order would train
    the straggler versions after it started; the stream hands it over at its deadline instead."""
    lengths = iter([10.0] + [1.0] * 20)

    class Fixed(Agent):
        async def run(self, sample, ctx):
            await asyncio.sleep(next(lengths) * H)
            ctx.record_turn(1, "e")
            return AgentResult(tokens=[1, 2, 3], response_length=2)

    source = Source(limit=6, group=1)
    sched, _ = make(Fixed(), source)

    async def trainer(stream):
        out = []
        while batch := await stream.next_batch():
            out.append((batch[0].task.task_id, batch[0].version, stream.version, loop_time() / H))
            await stream.ack([batch[0].group_id])
            stream.set_version(stream.version + 1)
        return out

    trained, _ = run_virtual(drive(sched, StreamConfig(batch_size=1, max_staleness=1), trainer))
    assert all(v - s <= 1 for _, s, v, _ in trained)
    assert trained[0][0] == "t1" and trained[1][0] == "t0"  # t1 (1 h) first, then t0 at its deadline, 1
    assert trained[1][2] == 1 and trained[1][3] == pytest.approx(10.0)  # the trainer waited for it


def test_a_trainer_that_stops_consuming_pauses_admission_at_the_cap_and_resuming_resumes_it():
    agent, source = Agent(3), Source()
    sched, _ = make(agent, source)
    config = StreamConfig(batch_size=2, max_staleness=2, max_unacked=3)  # the bound alone would allow 6
    seen = {}

    async def trainer(stream):
        first = await stream.next_batch()
        await asyncio.sleep(200 * H)  # holds its batch, unacked, and asks for nothing
        seen["held"] = (source.cursor, stream.status())
        await asyncio.sleep(200 * H)
        seen["still"] = source.cursor
        await stream.ack(g.group_id for g in first)
        stream.set_version(1)
        for _ in range(3):
            batch = await stream.next_batch()
            await stream.ack(g.group_id for g in batch)
            stream.set_version(stream.version + 1)
        seen["resumed"] = source.cursor

    run_virtual(drive(sched, config, trainer))
    cursor, status = seen["held"]
    assert cursor == seen["still"] == 3  # three groups admitted, then none while the cap is full
    assert status.running == 0 and status.unacked == 2 and status.waiting == 1
    assert status.waiting + status.unacked <= 3
    assert seen["resumed"] > cursor


def test_a_trainer_holding_its_batch_unacked_past_the_cap_is_told_so():
    sched, _ = make(Agent(1), Source())

    async def trainer(stream):
        await stream.next_batch()
        stream.set_version(1)
        await stream.next_batch()  # the first batch is still unacked, and the cap is one batch

    with pytest.raises(RuntimeError, match=r"stalled.*max_unacked=2"):
        run_virtual(drive(sched, StreamConfig(batch_size=2, max_staleness=1, max_unacked=2), trainer))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), after_h=st.floats(0.0, 20.0), batch=st.integers(1, 3),
       eta=st.sampled_from([0, 1, 2]), ack=st.booleans(), fetch_h=st.sampled_from([0.0, 0.5, 3.0]))
def test_close_at_any_moment_leaves_nothing_running_and_every_group_accounted_for(seed, after_h, batch, eta, ack,
                                                                                 fetch_h):
    agent, source = Agent(seed), Source(delay=fetch_h * H)
    sched, pool = make(agent, source)
    before = pool.snapshot()
    delivered = []

    async def trainer(stream):
        while True:
            got = await stream.next_batch()
            delivered.extend(got)
            await asyncio.sleep(0.5 * H)
            if ack:
                await stream.ack(g.group_id for g in got)
            stream.set_version(stream.version + 1)

    async def main():
        stream = GroupStream(sched, StreamConfig(batch_size=batch, max_staleness=eta, max_unacked=8))
        await stream.start()
        consumer = asyncio.create_task(trainer(stream))
        await asyncio.sleep(after_h * H)
        report = await stream.close()
        running, started = agent.running, agent.started
        await asyncio.sleep(50 * H)  # nothing of the stream goes on after close
        with pytest.raises(RuntimeError, match=r"closed|stalled"):
            await consumer
        return report, running, started

    report, running, started = run_virtual(main())
    assert running == 0 and agent.running == 0 and agent.started == started
    assert pool.snapshot() == before and pool.held == 0 and not pool.batches()
    assert accounted(source, delivered, report)
    assert report.delivered == len(delivered) and len({g.group_id for g in delivered}) == len(delivered)
    assert all(g.trained_version - g.version <= eta for g in delivered)
    if ack:
        assert len(report.unacked) <= batch  # at most the batch in training when it closed


def test_a_restart_delivers_again_what_was_not_acked_and_never_what_was():
    log, source = MemoryStreamLog(), Source(limit=12, group=1)
    acked = []

    async def first(stream):
        for _ in range(3):
            batch = await stream.next_batch()
            if stream.version < 2:  # the third batch is delivered, never acked: the trainer died in its step
                await stream.ack(g.group_id for g in batch)
                acked.extend(g.task.task_id for g in batch)
                stream.set_version(stream.version + 1)

    async def second(stream):
        out = []
        while batch := await stream.next_batch():
            out += batch
            await stream.ack(g.group_id for g in batch)
            if stream.bound.left == 0:
                stream.set_version(stream.version + 1)
        return out

    config = StreamConfig(batch_size=2, max_staleness=1)
    sched, pool = make(Agent(5), source)
    _, report = run_virtual(drive(sched, config, first, log=log))
    assert len(report.unacked) == 2 and accounted(source, [], report) is False  # four were acked
    sched, pool = make(Agent(6), source)  # a new scheduler and pool; the same source and log
    later, _ = run_virtual(drive(sched, config, second, version=2, log=log))
    again = {g.group_id: g for g in later}
    assert len(again) == len(later)
    for g in report.unacked:  # delivered again, and counted as such
        assert again[g.group_id].deliveries == 2
    assert Counter([g.task.task_id for g in later] + acked) == Counter(f"t{i}" for i in range(12))
    assert all(g.trained_version - g.version <= 1 for g in later if g.deliveries == 1)
    assert pool.held == 0


def test_bad_calls_are_one_clear_error_and_change_nothing():
    sched, _ = make(Agent(2), Source(limit=4, group=1))
    with pytest.raises(RuntimeError, match="start the stream first"):
        run_virtual(GroupStream(sched, StreamConfig(batch_size=2)).next_batch())
    with pytest.raises(ValueError, match="at_bound='restart' is designed but not built"):
        GroupStream(sched, StreamConfig(batch_size=2, at_bound="restart"))
    with pytest.raises(ValueError, match="max_unacked=1 must be an int >= batch_size"):
        GroupStream(sched, StreamConfig(batch_size=2, max_unacked=1))

    async def trainer(stream):
        with pytest.raises(ValueError, match=r"next_batch\(n=3\).*1\.\.2"):
            await stream.next_batch(3)
        with pytest.raises(ValueError, match="took 0 of the 2 groups of version 0"):
            stream.set_version(1)
        batch = await stream.next_batch()
        with pytest.raises(ValueError, match="not delivered and unacked"):
            await stream.ack([batch[0].group_id, "stream/99"])
        assert stream.status().unacked == 2  # nothing acked
        with pytest.raises(ValueError, match="publish 1 next"):
            stream.set_version(2)
        await stream.ack(g.group_id for g in batch)
        with pytest.raises(ValueError, match="not delivered and unacked"):
            await stream.ack([batch[0].group_id])  # acked already
        return True

    assert run_virtual(drive(sched, StreamConfig(batch_size=2), trainer))[0]


def test_a_failing_step_reaches_the_trainer_and_close_still_tears_down():
    agent, source = Agent(4), Source(group=3)
    sched, pool = make(agent, source, gpu=1.0)  # the pool holds 2 samples of a whole GPU: a group of 3 never fits
    before = pool.snapshot()

    async def trainer(stream):
        await stream.next_batch()

    with pytest.raises(RuntimeError, match="stream failed: DeadlockError"):
        run_virtual(drive(sched, StreamConfig(batch_size=1), trainer))
    assert pool.snapshot() == before and agent.running == 0


def test_steps_run_side_by_side_on_one_scheduler_each_count_their_own_batches():
    """A stream runs its waves as concurrent steps of one scheduler: no step's batches land in
    another step's status."""
    sched, pool = make(Agent(7), Source())

    async def main():
        async def one(rid):
            async def fetch():
                return [Task(f"s{rid}", "p", TaskConfig("x", n_samples=1))]
            await sched.execute_rollout(rid, fetch=fetch)

        await asyncio.gather(one(0), one(1))
        return sched.status()  # the step started last

    st = run_virtual(main())
    assert (st.batches, st.batches_done, st.batches_waiting, st.batches_running) == (1, 1, 0, 0)
    assert st.tasks_done == 1 and pool.held == 0


def test_the_simulator_streams_every_group_once_within_the_bound():
    """bench/sim_stream.py drives this stream over the simulator's workloads: it stays runnable."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    sim_stream, workloads = importlib.import_module("sim_stream"), importlib.import_module("sim_workloads")
    traces = workloads.workload("multiturn", 8, 0)
    r = sim_stream.run(traces, 2, 4, 1, 20.0)  # exits the process if a group was lost or repeated
    assert r["samples"] == 8 * workloads.GROUP and max(r["ages"]) <= 1

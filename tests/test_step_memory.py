"""A long run's memory: 200 steps through the StepRunner (checkpoint folder, step results on disk,
eval details and timelines written, a rollout and an eval per step) keep what they hold bounded, so a
manager replica that serves a whole training run does not grow with it. Virtual time: the agent
sleeps, the steps take none of it."""

import asyncio
import contextlib
import gc
import logging
import os
import pathlib
import tracemalloc

from test_step_runner import _counting

from rayapp.core.clock import run_virtual
from rayapp.steps import timeline
from rayapp.steps.artifacts import EvalDetailsWriter
from rayapp.steps.checkpoint import RolloutCheckpoint
from rayapp.steps.jobs import StepJobs
from rayapp.steps.runner import StepRunner

STEPS, MEASURED_FROM = 200, 50
GROWTH_BOUND = 64 * 1024  # bytes over 150 steps: well under one step's samples kept per step


@contextlib.contextmanager
def logs_written_not_kept():
    """Log lines as a replica handles them (written to a file, here one that drops them, at INFO) and
    not as pytest does (it keeps every record of a test in memory, at whatever level an earlier test
    left the loggers): the harness's records are not the pipeline's memory."""
    ours = logging.getLogger("rayapp")
    saved = ours.handlers, ours.level, ours.propagate
    with open(os.devnull, "w") as sink:
        ours.handlers, ours.propagate = [logging.StreamHandler(sink)], False
        ours.setLevel(logging.INFO)
        try:
            yield
        finally:
            ours.handlers, ours.propagate = saved[0], saved[2]
            ours.setLevel(saved[1])


def interned_by_pathlib() -> list[tracemalloc.Filter]:
    """Filters that leave out what pathlib's ``sys.intern`` of each file name allocates: that is the
    interpreter's table of interned strings, which grows by doubling and never shrinks, so a doubling
    lands in the measured window or not by what the whole test session interned before (7.5 MB at once
    after the rest of the suite), not by what the steps keep."""
    source = pathlib.Path(pathlib.__file__).read_text().splitlines()
    lines = [n for n, text in enumerate(source, 1) if "sys.intern(" in text]
    return [tracemalloc.Filter(False, pathlib.__file__, lineno=n) for n in lines]


def test_two_hundred_steps_plateau(make_pool, tmp_path, monkeypatch):
    # the timelines' traces are written, their PNGs not: matplotlib's drawing is most of a step's time here
    # (338 s for the 200 steps with it); the replica's memory with PNGs is bench/replica_memory.py's
    monkeypatch.setattr(timeline, "_pyplot", False)
    log = []
    runner = StepRunner(_counting(make_pool, log, checkpointable=True), checkpoint=RolloutCheckpoint(tmp_path),
                        details=EvalDetailsWriter(tmp_path))
    jobs = StepJobs()
    traced = {}

    async def steps():
        for i in range(STEPS):
            await jobs.start("rollout", i, lambda i=i: runner.rollout(i)).task  # as the HTTP surface starts it
            await runner.evaluate(i)
            await asyncio.sleep(30.0)  # the trainer's update between steps
            log.clear()  # the test's own record of what ran
            if i + 1 in (MEASURED_FROM, STEPS):
                gc.collect()
                # no snapshot outlives its sum: the step-50 one (~2 MB of traces) would be counted at step 200
                traced[i + 1] = sum(t.size for t in tracemalloc.take_snapshot().filter_traces(
                    interned_by_pathlib()).traces)

    tracemalloc.start()
    try:
        with logs_written_not_kept():
            run_virtual(steps())
    finally:
        tracemalloc.stop()
    assert traced[STEPS] - traced[MEASURED_FROM] < GROWTH_BOUND, traced
    # what holds per-step state stays within its bounds
    assert all(len(memo) <= runner.results.keep for memo in runner.results._memo.values())
    assert not runner.results._flight and not runner.results._waiters
    assert len(jobs._jobs) <= jobs.keep and runner.details.open_streams == []
    assert sorted(p.name for p in (tmp_path / "step_results").iterdir()) == [
        "eval_000198.msgpack", "eval_000199.msgpack", "rollout_000198.msgpack", "rollout_000199.msgpack"]


def test_two_hundred_steps_of_verifier_tasks_add_no_task_names():
    """Ray keeps nine ``ray_tasks{Name=...}`` series per task name for good, in the manager's core worker
    and the node's metrics agent: the work a manager starts for 200 steps of episodes goes by one name."""
    from rayapp.actors.pool_service import work_name
    from rayapp.episode import EPISODE

    def verify():
        pass

    names = set()
    for step in range(STEPS):
        for sample in range(4):
            token = EPISODE.set(f"rollout{step}/math-{sample}#0")
            try:
                names.add(work_name(verify))
            finally:
                EPISODE.reset(token)
    assert names == {"verify"}

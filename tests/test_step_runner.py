"""The step pipeline without Ray or fastapi: the real TaskScheduler over the core PlacementPool and a
FunctionAgent, driven through StepRunner as the Serve manager drives it."""

import asyncio
import importlib.util
import json
from pathlib import Path

import msgspec
import pytest
from conftest import ended, run

from rayapp.core.agent import FunctionAgent
from rayapp.core.scheduler import RolloutResult, SchedulerConfig, TaskScheduler
from rayapp.envs.arithmetic import ArithmeticSource, arithmetic_spec
from rayapp.envs.datasets.source import DatasetSpec, MultiDataSource
from rayapp.recipe import FiltersConfig
from rayapp.record import Actor, EpisodeRecord
from rayapp.steps.artifacts import EvalDetailsWriter, read_jsonl
from rayapp.steps.checkpoint import RolloutCheckpoint
from rayapp.steps.filters import FinishOnlyFilter, RejectionFilter
from rayapp.steps.reuse import MAIN_FILE, ReusePolicy
from rayapp.steps.runner import StepRunner, filter_step
from rayapp.types import AgentResult, Sample, Status

ONE_NODE = '{"n0": {"gpus": [0], "cpu": 8, "memory_gb": 64}}'


def _scheduler(make_pool, log=None, gate=None):
    """Four tasks of two samples a step; every sample has one teacher and one student turn. Tasks
    0 and 2 are all correct (the rejection filter drops them), 1 and 3 mixed (kept)."""

    async def run_fn(sample, ctx):
        if gate is not None:
            await gate.wait()
        if log is not None:
            log.append(sample.task_id)
        ctx.record_turn(1, "teacher", Actor.TEACHER)
        ctx.record_turn(2, "student", Actor.STUDENT)
        return AgentResult(tokens=[1, 2], response_length=1, response="x", termination_reason="stop", turns=2)

    def verify_fn(sample, result):
        i = int(sample.task_id.rsplit("-", 1)[1])
        return {"score": 1.0 if i % 2 == 0 or sample.index == 0 else 0.0}

    spec = arithmetic_spec(batch_size=4)
    spec.handler = FunctionAgent(run_fn, verify_fn)
    return TaskScheduler([spec], ArithmeticSource(seed=3, n_samples=2), make_pool(ONE_NODE),
                         SchedulerConfig(rollout_batch_size=4, progress=False),
                         eval_datasets={"arith": ArithmeticSource(seed=9).take(2)})


def test_filter_step_keeps_survivors_and_counts_every_drop():
    def s(task, score, status=Status.COMPLETED, reason="stop"):
        return Sample(task, 0, "p", reward={"score": score}, status=status, episode=ended(reason))

    groups = [[s("a", 1), s("a", 1)],                                   # all correct: rejected
              [s("b", 0), s("b", 0)],                                   # all wrong: rejected
              [s("c", 1), s("c", 0, Status.TRUNCATED, "max_turns")],    # mixed: finish-only drops one
              [s("d", 1), s("d", 0)]]                                   # mixed, both finished: kept
    cfg = FiltersConfig(rejection=RejectionFilter(), finish_only=FinishOnlyFilter())
    out, report = filter_step(RolloutResult(3, groups, {"rollout/success": 3.0}), cfg.chain(), cfg.abort_cap)
    assert report.groups == out.groups and report.kept_samples == 3
    assert [[x.task_id for x in g] for g in out.groups] == [["c"], ["d", "d"]]
    m = out.metrics
    assert m["filter/rejection/dropped_groups/all_correct"] == 1 and m["filter/rejection/dropped_groups/all_wrong"] == 1
    assert m["filter/rejection/dropped/all_correct"] == 2 and m["filter/finish_only/dropped/truncated"] == 1
    assert m["filter/kept_samples"] == 3 and m["rollout/success"] == 3.0
    assert (m["filter/input_groups"], m["filter/input_samples"], m["filter/kept_groups"]) == (4, 8, 2)


def test_no_filter_and_no_cap_leave_the_step_as_it_is():
    result = RolloutResult(0, [[Sample("a", 0, "p")]], {"rollout/success": 1.0})
    assert filter_step(result, [], None) == (result, None) and filter_step(result, [], None)[0] is result


def test_roll_in_metrics_count_every_sample_before_the_filters_drop_any(make_pool):
    runner = StepRunner(_scheduler(make_pool), filters=[RejectionFilter()])
    result = run(runner.rollout(0))
    assert [g[0].task_id for g in result.groups] == ["arithmetic-3-1", "arithmetic-3-3"]
    m = result.metrics
    assert m["filter/input_samples"] == 8 and m["filter/kept_samples"] == 4
    assert m["filter/rejection/dropped_groups/all_correct"] == 2
    assert m["dagger/turns/teacher"] == m["dagger/turns/student"] == 8  # the dropped groups' turns too
    assert result.artifacts == {}  # no trajectory folder, no details, no checkpoint


def timeline(root, stem):
    """The timeline artifacts a step with details writes: the trace, and the PNG where matplotlib is."""
    out = {"timeline": str(root / "timeline" / f"{stem}.trace.json")}
    if importlib.util.find_spec("matplotlib") is not None:
        out["timeline_png"] = str(root / "timeline" / f"{stem}.png")
    return out


def test_a_fresh_rollout_names_its_files_by_kind_and_a_later_one_reuses_them(make_pool, tmp_path):
    ran = []
    traj, details = tmp_path / "traj", tmp_path / "out"
    runner = StepRunner(_scheduler(make_pool, ran), filters=[RejectionFilter()], trajectory_dir=traj,
                        details=EvalDetailsWriter(details), reuse=ReusePolicy())
    first = run(runner.rollout(0))
    assert first.artifacts == {"trajectory": str(traj / MAIN_FILE),
                               "trajectory_iter": str(traj / "trajectory_sft_samples_iter_000.pt"),
                               "train_summary": str(details / "eval_details" / "train_0.summary.json"),
                               **timeline(details, "train_0")}
    assert all(Path(p).exists() for p in first.artifacts.values())
    assert len(ran) == 8

    again = run(runner.rollout(1))  # neither reuse knob: iteration 0's data again, nothing runs
    assert len(ran) == 8
    assert again.artifacts == {"reused": str(traj / MAIN_FILE),
                               "train_summary": str(details / "eval_details" / "train_1.summary.json")}
    assert again.metrics["rollout/reused"] == 1.0
    # the file holds the step before the filters, so the reused step is filtered afresh
    assert again.metrics["filter/input_groups"] == 4
    assert [g[0].task_id for g in again.groups] == [g[0].task_id for g in first.groups]

    runner.reuse = ReusePolicy(force_fresh=True, save_per_iter_pt=False)
    fresh = run(runner.rollout(2))
    assert len(ran) == 16 and set(fresh.artifacts) == {"trajectory", "train_summary", *timeline(details, "train_2")}


def test_an_eval_step_writes_its_details_and_names_them(make_pool, tmp_path):
    runner = StepRunner(_scheduler(make_pool), filters=[RejectionFilter()], details=EvalDetailsWriter(tmp_path))
    result = run(runner.evaluate(0))
    d = tmp_path / "eval_details"
    assert result.artifacts == {"samples": str(d / "0.jsonl"), "placement": str(d / "0.placement.jsonl"),
                                "summary": str(d / "0.summary.json"), **timeline(tmp_path, "eval_0")}
    assert len(read_jsonl(d / "0.jsonl")) == 2 and set(result.samples) == {"arith"}


def test_what_a_previous_host_held_is_released_before_the_first_step_only(make_pool):
    log = []

    async def release_previous():
        log.append("release")
        if log.count("release") == 1:
            raise TimeoutError("the pool did not answer")
        return 2

    runner = StepRunner(_scheduler(make_pool, log), release_previous=release_previous)
    with pytest.raises(TimeoutError):
        run(runner.rollout(0))
    assert log == ["release"]  # nothing ran before the release
    run(runner.rollout(0))
    run(runner.evaluate(0))
    assert log.count("release") == 2 and log[1] == "release" and len(log) == 2 + 8 + 2


def test_one_step_at_a_time_and_work_between_steps_waits_for_the_running_one(make_pool):
    async def scenario():
        gate, log = asyncio.Event(), []
        runner = StepRunner(_scheduler(make_pool, log, gate))
        step = asyncio.create_task(runner.rollout(0))
        while not runner.busy:
            await asyncio.sleep(0)
        assert runner.status()["busy"]

        async def between():
            async with runner.between_steps():
                log.append("weights")

        async def second_step():
            await runner.evaluate(0)
            log.append("eval done")

        waiting = [asyncio.create_task(between()), asyncio.create_task(second_step())]
        await asyncio.sleep(0.05)
        assert log == []  # both wait while the rollout's samples are held at the gate
        gate.set()
        await asyncio.gather(step, *waiting)
        # the lock is fair: the rollout's eight samples, then the weights, then the eval step
        assert len(log) == 12 and log[8] == "weights" and log[11] == "eval done"
        assert sorted(log[9:11]) == ["arithmetic-9-0", "arithmetic-9-1"]
        assert not runner.status()["busy"]

    run(scenario())


# ---- idempotent steps ---------------------------------------------------------------------------

def _counting(make_pool, log, *, checkpointable=False, gate=None):
    """Like ``_scheduler``, but each sample's response is the number of samples run before it, so a
    re-run is told apart from a served result; ``checkpointable``: a data source that saves its state."""

    async def run_fn(sample, ctx):
        if gate is not None:
            await gate.wait()
        log.append((ctx.rollout_id, sample.task_id, sample.index))
        return AgentResult(tokens=[1, 2], response_length=1, response=str(len(log)), termination_reason="stop")

    spec = arithmetic_spec(batch_size=4)
    spec.handler = FunctionAgent(run_fn, lambda s, r: {"score": float(s.index)})
    source = (MultiDataSource([DatasetSpec("a", ArithmeticSource(seed=1).take(40), n_samples_per_prompt=2)], seed=3)
              if checkpointable else ArithmeticSource(seed=3, n_samples=2))
    return TaskScheduler([spec], source, make_pool(ONE_NODE), SchedulerConfig(rollout_batch_size=4, progress=False),
                         eval_datasets={"arith": ArithmeticSource(seed=9).take(2)})


def _samples(result):
    groups = result.groups if isinstance(result, RolloutResult) else list(result.samples.values())
    return [(s.task_id, s.index, s.response, s.status) for g in groups for s in g]


def test_concurrent_and_repeated_requests_for_a_step_run_it_once(make_pool):
    async def scenario():
        gate, log = asyncio.Event(), []
        runner = StepRunner(_counting(make_pool, log, gate=gate))
        calls = [asyncio.create_task(runner.rollout(5)) for _ in range(3)]
        calls += [asyncio.create_task(runner.evaluate(5)) for _ in range(2)]
        await asyncio.sleep(0.05)
        gate.set()
        r1, r2, r3, e1, e2 = await asyncio.gather(*calls)
        assert r1 is r2 is r3 and e1 is e2
        assert len(log) == 8 + 2  # one rollout (4 tasks x 2) and one eval (2 tasks x 1) ran
        assert await runner.rollout(5) is r1 and await runner.evaluate(5) is e1  # later: served, not run
        assert len(log) == 10 and len({x[2] for x in _samples(r1)}) == 8
        status = runner.status()
        assert status["steps_run"] == {"rollout": 1, "eval": 1} and status["steps_served"] == {"rollout": 3, "eval": 2}

    run(scenario())


@pytest.mark.parametrize("bad", [-1, 2**31, 10**20, True, 1.0, "5", None])
def test_a_step_id_outside_the_range_is_one_error_and_runs_nothing(make_pool, bad):
    log = []
    runner = StepRunner(_counting(make_pool, log))
    for call in (runner.rollout, runner.evaluate):
        with pytest.raises(ValueError, match=r"rollout_id must be an int in 0 \.\. 2147483647"):
            run(call(bad))
    assert log == [] and not runner.busy
    assert len(run(runner.rollout(2**31 - 1)).groups) == 4  # the bounds themselves are steps


def test_a_failed_step_fails_every_request_waiting_on_it_and_a_retry_runs_it(make_pool):
    log, tries = [], []

    async def release_previous():
        tries.append(1)
        if len(tries) == 1:
            raise TimeoutError("the pool did not answer")
        return 0

    async def twice():
        return await asyncio.gather(runner.rollout(0), runner.rollout(0), return_exceptions=True)

    runner = StepRunner(_counting(make_pool, log), release_previous=release_previous)
    assert [type(e) for e in run(twice())] == [TimeoutError, TimeoutError] and tries == [1]
    assert log == []
    assert len(run(runner.rollout(0)).groups) == 4 and len(log) == 8


def test_a_cancelled_request_leaves_the_step_to_the_others_and_the_last_one_cancels_it(make_pool):
    async def scenario():
        gate, log = asyncio.Event(), []
        runner = StepRunner(_counting(make_pool, log, gate=gate))
        first, second = (asyncio.create_task(runner.rollout(1)) for _ in range(2))
        while not runner.busy:
            await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0.01)
        assert runner.busy and not second.done()  # the step goes on for the other request
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert not runner.busy  # the step was cancelled, and had ended, before the last request raised
        gate.set()
        result = await runner.rollout(1)  # nothing was kept: it runs afresh
        assert len(result.groups) == 4 and len(log) == 8

    run(scenario())


def test_an_old_step_no_longer_kept_runs_afresh(make_pool):
    log = []
    runner = StepRunner(_counting(make_pool, log))
    first = run(runner.rollout(0))
    for r in (1, 2):
        run(runner.rollout(r))
    assert len(log) == 24
    again = run(runner.rollout(0))  # the two latest (1, 2) are kept; 0 is not
    assert len(log) == 32 and _samples(again) != _samples(first)
    assert run(runner.rollout(2)) is not None and len(log) == 32


def test_after_a_restart_a_finished_step_comes_back_from_the_checkpoint_folder(make_pool, tmp_path):
    log = []

    def runner():
        return StepRunner(_counting(make_pool, log, checkpointable=True), checkpoint=RolloutCheckpoint(tmp_path))

    first = runner()
    r0, e0 = run(first.rollout(0)), run(first.evaluate(0))
    r1 = run(first.rollout(1))
    assert len(log) == 8 + 2 + 8
    restarted = runner()  # a new process on the same folder
    again = run(restarted.rollout(1))
    assert _samples(again) == _samples(r1) and again.metrics == r1.metrics and again.artifacts == r1.artifacts
    assert _samples(run(restarted.evaluate(0))) == _samples(e0)
    assert _samples(run(restarted.rollout(0))) == _samples(r0)
    assert len(log) == 18  # nothing ran again
    assert sorted(p.name for p in (tmp_path / "step_results").iterdir()) == [
        "eval_000000.msgpack", "rollout_000000.msgpack", "rollout_000001.msgpack"]


def test_results_leave_through_the_trainers_door_and_a_stored_one_of_the_previous_format_is_served(
        make_pool, tmp_path):
    log = []
    first = StepRunner(_counting(make_pool, log, checkpointable=True), checkpoint=RolloutCheckpoint(tmp_path))
    r0 = run(first.rollout(0))
    assert all(s.episode == EpisodeRecord() and s.metadata["_turns"] == 1 and "_termination_reason" in s.metadata
               and {"started", "run_s", "verify_s", "ended"} <= set(s.metadata["_timing"])
               for g in r0.groups for s in g)  # the spec's keys, written at the door
    path = tmp_path / "step_results" / "rollout_000000.msgpack"
    stored = msgspec.msgpack.decode(path.read_bytes())
    for g in stored["result"]["groups"]:
        for s in g:
            del s["episode"]  # as the version before Sample.episode wrote it
    path.write_bytes(msgspec.msgpack.encode(stored))
    again = run(StepRunner(_counting(make_pool, log, checkpointable=True),
                           checkpoint=RolloutCheckpoint(tmp_path)).rollout(0))
    assert _samples(again) == _samples(r0) and len(log) == 8  # served, not run again
    assert [s.metadata for g in again.groups for s in g] == [s.metadata for g in r0.groups for s in g]


@pytest.mark.parametrize("damage", ["garbage", "another step's", "an eval's"])
def test_a_damaged_or_foreign_result_file_is_skipped_and_the_step_runs(make_pool, tmp_path, caplog, damage):
    log = []
    first = StepRunner(_counting(make_pool, log, checkpointable=True), checkpoint=RolloutCheckpoint(tmp_path))
    run(first.rollout(0))
    run(first.rollout(1))
    run(first.evaluate(0))
    folder = tmp_path / "step_results"
    data = {"garbage": b"\x93garbage", "another step's": (folder / "rollout_000001.msgpack").read_bytes(),
            "an eval's": (folder / "eval_000000.msgpack").read_bytes()}[damage]
    (folder / "rollout_000000.msgpack").write_bytes(data)
    restarted = StepRunner(_counting(make_pool, log, checkpointable=True), checkpoint=RolloutCheckpoint(tmp_path))
    assert len(log) == 18
    assert run(restarted.rollout(0)).rollout_id == 0 and len(log) == 26  # ran again
    assert "ignoring its saved result" in caplog.text


def test_the_train_summary_counts_every_sample_before_the_filters(make_pool, tmp_path):
    runner = StepRunner(_scheduler(make_pool), filters=[RejectionFilter()], details=EvalDetailsWriter(tmp_path))
    result = run(runner.rollout(0))
    summary = json.loads(Path(result.artifacts["train_summary"]).read_text())
    assert sum(len(g) for g in result.groups) == 4  # what the trainer gets
    assert (summary["n_groups"], summary["n_samples"], sum(summary["failure_classes"].values())) == (4, 8, 8)
    f = summary["filters"]
    assert (f["input_samples"], f["kept_groups"], f["kept_samples"]) == (8, 2, 4)
    assert f["dropped_groups"]["rejection"] == {"all_correct": 2} and f["dropped"]["rejection"] == {"all_correct": 4}
    assert summary["metrics"] == result.metrics


def test_a_failed_eval_closes_its_details_and_a_retry_rewrites_them(make_pool, tmp_path):
    details = EvalDetailsWriter(tmp_path)
    runner = StepRunner(_scheduler(make_pool), details=details)
    real = runner.scheduler.execute_eval

    async def failing(rollout_id, on_task_done=None):
        async def done(task, samples):
            await on_task_done(task, samples)  # streamed, then the step fails
            raise RuntimeError("a callback failed")
        return await real(rollout_id, done)

    runner.scheduler.execute_eval = failing
    rows = tmp_path / "eval_details" / "0.jsonl"
    for _ in range(2):
        with pytest.raises((RuntimeError, ExceptionGroup)):  # the scheduler's task groups may wrap it
            run(runner.evaluate(0))
        # closed, with what finished before the failure: the second failed run's rows, not both runs'
        streamed = [(r["task_id"], r["index"]) for r in read_jsonl(rows)]
        assert details.open_streams == [] and streamed and len(set(streamed)) == len(streamed)
    runner.scheduler.execute_eval = real
    result = run(runner.evaluate(0))
    lines = read_jsonl(rows)
    assert sorted((r["task_id"], r["index"]) for r in lines) == sorted(
        (s.task_id, s.index) for ss in result.samples.values() for s in ss)  # each sample once
    assert (tmp_path / "eval_details" / "0.summary.json").exists() and details.open_streams == []

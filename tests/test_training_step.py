"""The step pipeline without Ray or fastapi: the real TaskScheduler over the core PlacementPool and a
FunctionAgent, driven through StepRunner as the Serve manager drives it."""

import asyncio
from pathlib import Path

import pytest
from conftest import run

from rayapp.core.agent import FunctionAgent
from rayapp.core.scheduler import RolloutResult, SchedulerConfig, TaskScheduler
from rayapp.envs.arithmetic import ArithmeticSource, arithmetic_spec
from rayapp.recipe import FiltersConfig
from rayapp.training.artifacts import EvalDetailsWriter, read_jsonl
from rayapp.training.filters import FinishOnlyFilter, RejectionFilter
from rayapp.training.reuse import MAIN_FILE, ReusePolicy
from rayapp.training.step import StepRunner, filter_step
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
        return AgentResult(tokens=[1, 2], response_length=1, response="x", termination_reason="stop",
                           metadata={"_turn_actor": ["teacher", "student"]})

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
        return Sample(task, 0, "p", reward={"score": score}, status=status, metadata={"_termination_reason": reason})

    groups = [[s("a", 1), s("a", 1)],                                   # all correct: rejected
              [s("b", 0), s("b", 0)],                                   # all wrong: rejected
              [s("c", 1), s("c", 0, Status.TRUNCATED, "max_turns")],    # mixed: finish-only drops one
              [s("d", 1), s("d", 0)]]                                   # mixed, both finished: kept
    cfg = FiltersConfig(rejection=RejectionFilter(), finish_only=FinishOnlyFilter())
    out = filter_step(RolloutResult(3, groups, {"rollout/success": 3.0}), cfg.chain(), cfg.abort_cap)
    assert [[x.task_id for x in g] for g in out.groups] == [["c"], ["d", "d"]]
    m = out.metrics
    assert m["filter/rejection/dropped_groups/all_correct"] == 1 and m["filter/rejection/dropped_groups/all_wrong"] == 1
    assert m["filter/rejection/dropped/all_correct"] == 2 and m["filter/finish_only/dropped/truncated"] == 1
    assert m["filter/kept_samples"] == 3 and m["rollout/success"] == 3.0
    assert (m["filter/input_groups"], m["filter/input_samples"], m["filter/kept_groups"]) == (4, 8, 2)


def test_no_filter_and_no_cap_leave_the_step_as_it_is():
    result = RolloutResult(0, [[Sample("a", 0, "p")]], {"rollout/success": 1.0})
    assert filter_step(result, [], None) is result


def test_roll_in_metrics_count_every_sample_before_the_filters_drop_any(make_pool):
    runner = StepRunner(_scheduler(make_pool), filters=[RejectionFilter()])
    result = run(runner.rollout(0))
    assert [g[0].task_id for g in result.groups] == ["arithmetic-3-1", "arithmetic-3-3"]
    m = result.metrics
    assert m["filter/input_samples"] == 8 and m["filter/kept_samples"] == 4
    assert m["filter/rejection/dropped_groups/all_correct"] == 2
    assert m["dagger/turns/teacher"] == m["dagger/turns/student"] == 8  # the dropped groups' turns too
    assert result.artifacts == {}  # no trajectory folder, no details, no checkpoint


def test_a_fresh_rollout_names_its_files_by_kind_and_a_later_one_reuses_them(make_pool, tmp_path):
    ran = []
    traj, details = tmp_path / "traj", tmp_path / "out"
    runner = StepRunner(_scheduler(make_pool, ran), filters=[RejectionFilter()], trajectory_dir=traj,
                        details=EvalDetailsWriter(details), reuse=ReusePolicy())
    first = run(runner.rollout(0))
    assert first.artifacts == {"trajectory": str(traj / MAIN_FILE),
                               "trajectory_iter": str(traj / "trajectory_sft_samples_iter_000.pt"),
                               "train_summary": str(details / "eval_details" / "train_0.summary.json")}
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
    assert len(ran) == 16 and set(fresh.artifacts) == {"trajectory", "train_summary"}


def test_an_eval_step_writes_its_details_and_names_them(make_pool, tmp_path):
    runner = StepRunner(_scheduler(make_pool), filters=[RejectionFilter()], details=EvalDetailsWriter(tmp_path))
    result = run(runner.evaluate(0))
    d = tmp_path / "eval_details"
    assert result.artifacts == {"samples": str(d / "0.jsonl"), "placement": str(d / "0.placement.jsonl"),
                                "summary": str(d / "0.summary.json")}
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

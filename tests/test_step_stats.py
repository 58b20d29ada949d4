"""Step statistics (``core.stats``): per dataset reward, length, truncation and abort rates and
phase timings, from each sample's own ``_timing``; the step's fetch and wall time and samples/s.
Run in virtual time, where every figure is exact."""

import asyncio

import pytest

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import run_virtual
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.core.stats import sample_statistics
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Sample, Status, StepKind, Task, TaskConfig

ONE_GPU = '{"n0": {"gpus": [0], "cpu": 8, "memory_gb": 64}}'


class SlowSource:
    """Three tasks of two samples, datasets a, a, b; the fetch takes 5 s."""

    async def get_tasks(self, n):
        await asyncio.sleep(5)
        return [Task(f"t{i}", "p", TaskConfig("x", n_samples=2), metadata={"_dataset_name": name})
                for i, name in enumerate(["a", "a", "b"])][:n]


async def run_fn(sample, ctx):
    if sample.task_id == "t2" and sample.index == 1:
        await asyncio.sleep(2)
        raise RuntimeError("boom")
    await asyncio.sleep(10)
    truncated = sample.task_id == "t1" and sample.index == 1
    return AgentResult(tokens=[1] * 10, response_length=3 + sample.index, truncated=truncated)


async def verify_fn(sample, result):
    await asyncio.sleep(1)
    return {"score": 1.0 if sample.index == 0 else 0.5}


def test_a_steps_statistics_are_exact_per_dataset_and_come_from_each_samples_timing(make_pool):
    # each batch (one task) takes the whole GPU (two samples at 0.5), so the three run one after the
    # other: admitted at 5, 16 and 27 s (each asked at 5 s, when the fetch returned)
    spec = EvaluatorSpec("x", FunctionAgent(run_fn, verify_fn), batch_size=1,
                         resource=Resource(gpu=1, concurrency=2), run_resource=Resource(gpu=0.5))
    sched = TaskScheduler([spec], SlowSource(), make_pool(ONE_GPU), SchedulerConfig(rollout_batch_size=3,
                                                                                     progress=False))
    m = run_virtual(sched.execute_rollout(0)).metrics
    assert m["rollout/time/fetch_s"] == pytest.approx(5)
    assert m["rollout/time/step_s"] == pytest.approx(38)
    assert m["rollout/samples_per_s"] == pytest.approx(6 / 38)
    a = {k.removeprefix("rollout/a/"): v for k, v in m.items() if k.startswith("rollout/a/")}
    assert a == pytest.approx({
        "n_samples": 4, "truncated_rate": 0.25, "abort_rate": 0.0,
        "reward_mean": 0.75, "reward_std": 0.25, "reward_min": 0.5, "reward_max": 1.0,
        "response_length_mean": 3.5, "response_length_std": 0.5, "response_length_min": 3, "response_length_max": 4,
        "wait_s_mean": 5.5, "wait_s_max": 11, "run_s_mean": 10, "run_s_max": 10, "verify_s_mean": 1,
        "verify_s_max": 1, "episode_s_mean": 11, "episode_s_max": 11})
    b = {k.removeprefix("rollout/b/"): v for k, v in m.items() if k.startswith("rollout/b/")}
    assert b == pytest.approx({  # the aborted sample counts in the rates and the times it has, not the rewards
        "n_samples": 2, "truncated_rate": 0.0, "abort_rate": 0.5,
        "reward_mean": 1.0, "reward_std": 0.0, "reward_min": 1.0, "reward_max": 1.0,
        "response_length_mean": 3, "response_length_std": 0, "response_length_min": 3, "response_length_max": 3,
        "wait_s_mean": 22, "wait_s_max": 22, "run_s_mean": 10, "run_s_max": 10, "verify_s_mean": 1,
        "verify_s_max": 1, "episode_s_mean": 6.5, "episode_s_max": 11})
    assert all(isinstance(v, float) and "/" in k for k, v in m.items())  # flat: a logger takes them as they are


def test_statistics_leave_out_what_no_sample_has():
    aborted = Sample("t", 0, "p", status=Status.ABORTED, reward={"score": 0.0})
    stats = sample_statistics("eval", [aborted])
    assert stats == {"eval/default/n_samples": 1.0, "eval/default/truncated_rate": 0.0,
                     "eval/default/abort_rate": 1.0}
    assert sample_statistics("eval", []) == {}


def test_every_counter_series_a_sample_can_increment_exists_at_zero():
    """What ``observations`` counts of samples of every status and abort reason, for the recipe's
    datasets, is among the series an exporter makes at 0 at start."""
    from conftest import ended

    from rayapp.core.stats import observations, zero_observations
    from rayapp.record import AbortReason

    def sample(name, status, reason=None):
        return Sample("t", 0, "p", metadata={"_dataset_name": name}, status=status, response_length=3,
                      episode=ended(reason))

    samples = [sample(n, st) for n in ("a", "b") for st in (Status.COMPLETED, Status.TRUNCATED)]
    samples += [sample(n, Status.ABORTED, r) for n in ("a", "b") for r in AbortReason]
    at_zero = zero_observations({StepKind.ROLLOUT: ["a", "b"]})
    zero = {(name, tuple(sorted(tags.items()))) for name, value, tags in at_zero}
    assert all(v == 0 for _, v, _ in at_zero)
    counted = {(name, tuple(sorted(tags.items()))) for name, _, tags in observations(StepKind.ROLLOUT, samples)
               if name.endswith("_total")}
    assert counted and counted <= zero, counted - zero
    assert len(zero) == 2 * (3 + len(AbortReason) + 1)

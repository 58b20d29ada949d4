"""A rollout cut short resumes from its checkpoint (ResumableRollouts around a TaskScheduler, in one process;
the manager-replica kill is tests/isolated/test_dagger_serve.py)."""

import asyncio
import logging

import pytest
from conftest import run

from rayapp.core.agent import FunctionAgent
from rayapp.core.convert import InputError
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.envs.arithmetic import ArithmeticSource, verify
from rayapp.envs.datasets.source import DatasetSpec, MultiDataSource
from rayapp.steps.checkpoint import ResumableRollouts, RolloutCheckpoint
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Sample

LAYOUT = '{"n0": {"gpus": [0, 1], "cpu": 16, "memory_gb": 64}}'
N = 6  # groups per rollout


def source() -> MultiDataSource:
    return MultiDataSource([DatasetSpec("a", ArithmeticSource(seed=1).take(5), weight=2.0),
                            DatasetSpec("b", ArithmeticSource(seed=2).take(7), n_samples_per_prompt=2)], seed=9)


class Policy:
    """Answers every prompt; tasks named in ``hold`` wait until released (the process 'dies' first)."""

    def __init__(self, hold=()):
        self.hold, self.release, self.calls = set(hold), asyncio.Event(), []

    async def __call__(self, sample, ctx):
        self.calls.append((sample.task_id, sample.index))
        if sample.task_id in self.hold:
            await self.release.wait()
        return AgentResult(tokens=[1, 2, 3], response_length=1, response=str(len(self.calls)),
                           rollout_log_probs=[-0.5], loss_mask=[1])


def scheduler(policy, ckpt=None, pool=None) -> TaskScheduler | ResumableRollouts:
    spec = EvaluatorSpec("arithmetic", FunctionAgent(policy, verify), Resource(gpu=1, concurrency=4, cpu=4),
                         Resource(gpu=0.25, cpu=1), batch_size=2)
    sched = TaskScheduler([spec], source(), pool, SchedulerConfig(rollout_batch_size=N, progress=False))
    return sched if ckpt is None else ResumableRollouts.over(sched, ckpt)


def ids(result):
    return [(g[0].task_id, len(g)) for g in result.groups]


def test_a_rollout_killed_mid_way_resumes_without_rerunning_finished_groups(tmp_path, make_pool, caplog):
    reference = scheduler(Policy())
    expected = [ids(run(reference.execute_rollout(r))) for r in range(3)]
    assert expected[0] != expected[1]  # the stream moves on

    ckpt = RolloutCheckpoint(tmp_path)
    first = scheduler(Policy(), ckpt, make_pool(LAYOUT))
    assert ids(run(first.execute_rollout(0))) == expected[0]
    # rollout 1 in a process that dies while two of its groups are still running
    held = {expected[1][-1][0], expected[1][-2][0]}
    dying = Policy(hold=held)
    sched = scheduler(dying, RolloutCheckpoint(tmp_path), make_pool(LAYOUT))

    async def killed():
        step = asyncio.create_task(sched.execute_rollout(1))
        while sum(1 for t, _ in dying.calls if t in held) < 2 or sched.rollouts.status().tasks_done < N - len(held):
            await asyncio.sleep(0.01)
        step.cancel()  # what the checkpoint sees of a killed process: no finish()
        with pytest.raises(asyncio.CancelledError):
            await step

    run(killed())
    recorded = RolloutCheckpoint(tmp_path).resume(1).groups
    assert len(recorded) == N - len(held) and all(g[0].task_id not in held for g in recorded.values())

    # a new process (its data source back at the start) resumes rollout 1
    policy = Policy()
    caplog.set_level(logging.WARNING)
    resumed = run(scheduler(policy, RolloutCheckpoint(tmp_path), make_pool(LAYOUT)).execute_rollout(1))
    assert ids(resumed) == expected[1]  # the same tasks, in fetch order: nothing lost, nothing twice
    assert {t for t, _ in policy.calls} == held  # only the unfinished groups ran again
    for i, group in recorded.items():
        assert resumed.groups[i] == group  # finished groups come back as recorded, not re-run
    assert resumed.metrics["rollout/resumed_groups"] == N - len(held)
    assert "rollout 1 resumes from its checkpoint: 4 groups finished before" in caplog.text
    assert RolloutCheckpoint(tmp_path).resume(1) is None  # finished: never resumed again

    # a process restarted between steps continues the stream where rollout 1 left it
    later = scheduler(Policy(), RolloutCheckpoint(tmp_path), make_pool(LAYOUT))
    assert ids(run(later.execute_rollout(2))) == expected[2]
    # a trainer that goes back to an earlier step gets that step's tasks again, then the stream goes on
    assert ids(run(later.execute_rollout(1))) == expected[1]
    assert ids(run(later.execute_rollout(2))) == expected[2]


def test_a_failed_checkpoint_write_costs_resumability_not_the_step(tmp_path, caplog):
    class Full(RolloutCheckpoint):
        def record_group(self, rollout_id, index, group):
            raise OSError(28, "No space left on device")

    result = run(scheduler(Policy(), Full(tmp_path)).execute_rollout(0))
    assert len(result.groups) == N and result.metrics["rollout/resumed_groups"] == 0
    assert caplog.text.count("could not checkpoint group") == N


def test_a_checkpoint_needs_a_source_that_saves_its_state(tmp_path):
    spec = EvaluatorSpec("arithmetic", FunctionAgent(Policy(), verify))
    with pytest.raises(TypeError, match=r"ArithmeticSource lacks \['state_dict', 'load_state_dict'\]"):
        ResumableRollouts.over(TaskScheduler([spec], ArithmeticSource()), RolloutCheckpoint(tmp_path))


@pytest.mark.parametrize(("change", "message"), [
    ("batch_size", r"group 2 is 'arithmetic-\d-\d+' x\d, but the fetch from the saved source state gave nothing there"),
    ("datasets", r"group 0 is 'arithmetic-\d-\d+' x\d, but the fetch from the saved source state gave 'arith"),
])
def test_a_checkpoint_of_another_data_config_is_refused_before_anything_runs(tmp_path, change, message):
    ckpt = RolloutCheckpoint(tmp_path)
    src = source()
    ckpt.begin(0, src.state_dict())
    for i, t in enumerate(src.take(N)):
        ckpt.record_group(0, i, [Sample(t.task_id, j, t.prompt, t.label) for j in range(t.config.n_samples)])
    policy = Policy()
    sched = scheduler(policy, RolloutCheckpoint(tmp_path))
    if change == "batch_size":
        sched.rollouts.config = SchedulerConfig(rollout_batch_size=2, progress=False)
    else:  # the same dataset names, other rows: the saved state fetches other tasks
        sched.rollouts.data_source = sched.source = MultiDataSource(
            [DatasetSpec("a", ArithmeticSource(seed=7).take(5), weight=2.0),
             DatasetSpec("b", ArithmeticSource(seed=8).take(7))], seed=9)
    with pytest.raises(ValueError, match=message):
        run(sched.execute_rollout(0))
    assert policy.calls == []


def test_the_finished_marker_keeps_the_next_source_state_and_a_damaged_one_is_named(tmp_path):
    ckpt = RolloutCheckpoint(tmp_path)
    src = source()
    ckpt.begin(3, src.state_dict())
    ckpt.record_group(3, 0, [])
    src.take(4)
    ckpt.finish(3, src.state_dict())
    assert ckpt.next_source_state(3) == src.state_dict() and ckpt.next_source_state(2) is None
    assert (tmp_path / "rollout_000003" / "group_000000.msgpack").exists()  # kept while the trainer may still retry
    for rid in (4, 5):
        ckpt.begin(rid, src.state_dict())
    assert sorted(p.name for p in (tmp_path / "rollout_000003").iterdir()) == ["FINISHED", "state.msgpack"]  # pruned
    assert ckpt.next_source_state(3) == src.state_dict()  # the seek still works after the prune
    marker = tmp_path / "rollout_000003" / "FINISHED"
    whole = marker.read_bytes()
    marker.write_bytes(whole[:-5])  # torn
    with pytest.raises(InputError, match=r"rollout_000003/FINISHED: malformed msgpack: input data was truncated"):
        ckpt.next_source_state(3)
    marker.write_bytes(b"\x80\x02garbage")  # not a marker at all
    with pytest.raises(InputError, match=r"rollout_000003/FINISHED: \$\.version: missing required field"):
        ckpt.next_source_state(3)

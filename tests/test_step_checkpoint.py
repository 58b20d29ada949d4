"""Mid-rollout checkpoints: msgpack files of typed records, written atomically, read back whole or
skipped (``rayapp.steps.checkpoint``; the scheduler-level resume is tests/test_step_resume.py)."""

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import msgspec
import pytest

import rayapp.steps.checkpoint as checkpoint
from rayapp.core.agent import FunctionAgent
from rayapp.core.convert import InputError
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.envs.datasets.source import DatasetSpec, MultiDataSource
from rayapp.record import EpisodeRecord, EpisodeTiming, Placement, TerminationReason, TurnRecord
from rayapp.steps.checkpoint import CheckpointGroup, ResumableRollouts, RolloutCheckpoint
from rayapp.types import AgentResult, EvaluatorSpec, Sample, Status, Task, TaskConfig


def sample(task_id="t", index=0, **kw):
    fields = dict(label={"answer": [4, "ü"]}, status=Status.COMPLETED, tokens=[1, 2, 3, 150_000],
                  response="réponse", response_length=2, rollout_log_probs=[-0.25, -1e-300], loss_mask=[1, 1],
                  reward={"score": 1.0}, metadata={"_dataset_name": "a"},
                  episode=EpisodeRecord(turns=2, placement=Placement("n0", (0,), 1.0),
                                        termination_reason=TerminationReason.STOP,
                                        turn_records=[TurnRecord(1, "e", weight_version=3), TurnRecord(2, "e")],
                                        timing=EpisodeTiming(1.0, "b0", 0.5, 0.75, 2.0, 0.5, 3.0)))
    return Sample(task_id, index, "prompt ✓ 日本", **{**fields, **kw})


def test_a_group_file_is_msgpack_of_a_typed_record_and_comes_back_exactly(tmp_path):
    ckpt = RolloutCheckpoint(tmp_path)
    ckpt.begin(0, {"cursor": 1})
    group = [sample(index=0), sample(index=1, status=Status.ABORTED, remove_sample=True)]
    ckpt.record_group(0, 3, group)
    raw = (tmp_path / "rollout_000000" / "group_000003.msgpack").read_bytes()
    record = msgspec.msgpack.decode(raw, type=CheckpointGroup)
    assert record.index == 3 and record.rollout_id == 0 and record.version == 1 and record.samples == group
    assert msgspec.msgpack.decode(raw)["format"] == "rayapp.rollout_checkpoint.group"
    assert RolloutCheckpoint(tmp_path).resume(0).groups == {3: group}


def test_a_file_of_another_kind_is_skipped_naming_why(tmp_path, caplog):
    ckpt = RolloutCheckpoint(tmp_path)
    ckpt.begin(0, {})
    folder = tmp_path / "rollout_000000"
    (folder / "group_000000.msgpack").write_bytes((folder / "state.msgpack").read_bytes())
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume(0).groups == {}
    assert "group_000000.msgpack: $.format: invalid value 'rayapp.rollout_checkpoint.state'" in caplog.text


def _source():
    rows = [Task(f"q{i}", f"prompt {i}", TaskConfig("arith", n_samples=2)) for i in range(10)]
    return MultiDataSource([DatasetSpec("a", rows), DatasetSpec("b", rows[:4], weight=2)], seed=5)


def _run(task, rollout_id):  # a stand-in for the rollout of one group: deterministic per task
    return [Sample(task.task_id, i, task.prompt, status=Status.COMPLETED, tokens=[i, len(task.task_id)],
                   reward={"score": float(i)}, metadata={**task.metadata, "_rollout_id": rollout_id})
            for i in range(task.config.n_samples)]


def test_crash_mid_rollout_resumes_without_loss_or_duplicates(tmp_path, caplog):
    reference_src = _source()
    expected = [_run(t, 4) for t in reference_src.take(6)]

    src, ckpt = _source(), RolloutCheckpoint(tmp_path)
    assert ckpt.resume(4) is None
    ckpt.begin(4, src.state_dict())
    tasks = src.take(6)
    for i in (0, 2, 3):  # groups finish out of order
        ckpt.record_group(4, i, _run(tasks[i], 4))
    # The crash: group 5's file torn mid-record, a temp file of group 1 abandoned.
    ckpt.record_group(4, 5, _run(tasks[5], 4))
    torn = tmp_path / "rollout_000004" / "group_000005.msgpack"
    torn.write_bytes(torn.read_bytes()[:-7])
    (tmp_path / "rollout_000004" / ".group_000001.msgpack.abc.tmp").write_bytes(b"\x92")

    src2, ckpt2 = _source(), RolloutCheckpoint(tmp_path)  # a new replica: fresh objects
    src2.take(3)  # its source is somewhere else
    with caplog.at_level(logging.WARNING):
        state = ckpt2.resume(4)
    assert "group_000005.msgpack" in caplog.text and "input data was truncated" in caplog.text
    assert sorted(state.groups) == [0, 2, 3]
    assert state.groups == {i: expected[i] for i in (0, 2, 3)}
    src2.load_state_dict(state.source_state)
    tasks2 = src2.take(6)
    assert [t.task_id for t in tasks2] == [t.task_id for t in tasks]
    with pytest.raises(ValueError, match="group index 2 is not new"):
        ckpt2.record_group(4, 2, expected[2])
    for i in (1, 4, 5):  # the groups still to run
        ckpt2.record_group(4, i, _run(tasks2[i], 4))
    final = ckpt2.resume(4)
    assert [final.groups[i] for i in range(6)] == expected
    assert src2.state_dict() == reference_src.state_dict()
    ckpt2.finish(4)
    assert ckpt2.resume(4) is None


def test_begin_discards_and_protocol_errors(tmp_path):
    ckpt = RolloutCheckpoint(tmp_path)
    with pytest.raises(ValueError, match="call begin"):
        ckpt.record_group(0, 0, [sample()])
    with pytest.raises(ValueError, match="without begin"):
        ckpt.finish(0)
    ckpt.begin(0, {"cursor": 1})
    ckpt.record_group(0, 0, [sample()])
    ckpt.begin(0, {"cursor": 2})
    assert ckpt.resume(0).groups == {} and ckpt.resume(0).source_state == {"cursor": 2}
    (tmp_path / "rollout_000000" / "state.msgpack").write_bytes(b"garbage")
    with pytest.raises(InputError, match=r"rollout_000000/state\.msgpack: \$: expected object, got int"):
        ckpt.resume(0)
    shutil.rmtree(tmp_path / "rollout_000000")  # what a user does to run the step afresh
    assert ckpt.resume(0) is None
    with pytest.raises(TypeError, match=r"rollout 1: source_state: .*type object is unsupported"):
        ckpt.begin(1, {"rng": object()})


def test_group_of_a_stale_begin_is_skipped(tmp_path, caplog):
    a = RolloutCheckpoint(tmp_path)
    a.begin(2, {})
    stale = tmp_path / "rollout_000002" / "group_000000.msgpack"
    a.record_group(2, 0, [sample()])
    old = stale.read_bytes()
    a.begin(2, {})
    stale.write_bytes(old)  # a late write from the writer of the earlier begin()
    with caplog.at_level(logging.WARNING):
        assert a.resume(2).groups == {}
    assert "another begin()" in caplog.text


def test_killed_process_leaves_only_whole_groups(tmp_path):
    child = textwrap.dedent(f"""
        import os
        import rayapp.steps.atomic_files as files
        from rayapp.steps.checkpoint import RolloutCheckpoint
        from rayapp.types import Sample
        ckpt = RolloutCheckpoint({str(tmp_path)!r})
        ckpt.begin(1, {{"seed": 3}})
        for i in range(3):
            ckpt.record_group(1, i, [Sample(f"t{{i}}", 0, "p", tokens=[i])])
        def dying_fsync(fd):
            os.ftruncate(fd, 5)  # half written...
            os._exit(9)  # ...and killed, SIGKILL-like: no cleanup runs
        files.os.fsync = dying_fsync
        ckpt.record_group(1, 3, [Sample("t3", 0, "p")])
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(checkpoint.__file__).parents[2])})
    assert proc.returncode == 9, proc.stderr
    state = RolloutCheckpoint(tmp_path).resume(1)
    assert state.source_state == {"seed": 3} and sorted(state.groups) == [0, 1, 2]
    assert [g[0].tokens for g in state.groups.values()] == [[0], [1], [2]]


def _deeply_nested_group() -> bytes:
    good = msgspec.msgpack.encode(CheckpointGroup(1, 0, "run", 0, [Sample("t", 0, "p", metadata={"x": 1})]))
    at = good.index(b"\xa1x\x01") + 2  # metadata value 1 -> [[[...]]] 100k deep
    return good[:at] + b"\x91" * 100_000 + b"\xc0" + good[at + 1:]


def test_the_door_turns_a_too_deeply_nested_document_into_one_input_error():
    """convert.py promises one InputError for any outside input; msgspec's RecursionError escapes."""
    from rayapp.core.convert import InputError, decode

    with pytest.raises(InputError, match=r"group_000000\.msgpack"):
        decode(_deeply_nested_group(), CheckpointGroup, "group_000000.msgpack", fmt="msgpack")


def test_resume_skips_a_damaged_group_file_instead_of_crashing(tmp_path):
    """checkpoint.py: 'A group file that cannot be read (damaged on disk) is skipped with a warning
    and re-run'. A deeply nested one makes resume() raise RecursionError: the rollout cannot resume
    at all until someone deletes the file by hand."""
    ckpt = RolloutCheckpoint(tmp_path)
    ckpt.begin(0, {"cursor": 0})
    good = [Sample("t", 0, "p", status=Status.COMPLETED)]
    ckpt.record_group(0, 1, good)
    (tmp_path / "rollout_000000" / "group_000000.msgpack").write_bytes(_deeply_nested_group())
    assert RolloutCheckpoint(tmp_path).resume(0).groups == {1: good}


def test_nothing_is_written_after_a_cancelled_checkpointed_step_returns(tmp_path, monkeypatch):
    """A step cancelled while its group's checkpoint is being written returns at once, but the write
    goes on in its thread and lands afterwards: the next attempt's resume() sees a folder that
    changes under it (a group present or not depending on thread timing)."""
    writing, finish = threading.Event(), threading.Event()
    real = RolloutCheckpoint.record_group

    def slow_record(self, rollout_id, index, group):
        writing.set()
        finish.wait(5)
        real(self, rollout_id, index, group)

    monkeypatch.setattr(RolloutCheckpoint, "record_group", slow_record)
    rows = [Task("q0", "p", TaskConfig("x", n_samples=1))]
    def ok(sample, ctx):
        return AgentResult(tokens=[1, 2], response_length=1, response="x", loss_mask=[1], rollout_log_probs=[-0.1])

    sched = TaskScheduler([EvaluatorSpec("x", FunctionAgent(ok, lambda sample, result: {"score": 1.0}))],
                          MultiDataSource([DatasetSpec("a", rows)], seed=0), None,
                          SchedulerConfig(rollout_batch_size=1, progress=False))
    steps = ResumableRollouts.over(sched, RolloutCheckpoint(tmp_path))

    async def main():
        step = asyncio.ensure_future(steps.execute_rollout(0))
        while not writing.is_set():
            await asyncio.sleep(0.01)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        before = sorted(p.name for p in (tmp_path / "rollout_000000").iterdir())
        finish.set()
        await asyncio.sleep(0.3)
        return before, sorted(p.name for p in (tmp_path / "rollout_000000").iterdir())

    before, after = asyncio.run(main())
    assert after == before

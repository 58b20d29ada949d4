import asyncio
import json
import logging

import pytest
from conftest import ended

import rayapp.steps.artifacts as art
from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.core.step_metrics import failure_summary
from rayapp.record import (
    AbortReason,
    AbortRecord,
    EpisodePhase,
    EpisodeRecord,
    Placement,
    TerminationReason,
    TurnRecord,
)
from rayapp.steps.artifacts import EvalDetailsWriter, JsonlAppender, read_jsonl
from rayapp.trainers.converters import episode_metadata, stored_sample, trainer_metadata
from rayapp.types import Sample, Status, Task, TaskConfig


def _placed(turn, node="10.0.0.2", gpus=(0,), engine="student"):
    return {"turn": turn, "engine": engine, "node": node, "gpu_ids": list(gpus)}


def _result():
    ok = stored_sample(Sample("m1", 0, "1+1?", status=Status.COMPLETED, tokens=[5, 6, 7, 8, 9], response="2 ✓",
                response_length=2, reward={"score": 1.0},
                metadata={"_eval_dataset_name": "math", "_turns": 2, "_termination_reason": "stop",
                          "_turn_placement": [_placed(1),
                                              _placed(2, gpus=(0, 1), engine="teacher") | {"engine_s": 0.5}]}))
    wrong = stored_sample(Sample("m1", 1, "1+1?", status=Status.TRUNCATED, tokens=[5, 6, 7], response="3",
                   response_length=1, reward={"score": 0.0},
                   metadata={"_turns": 4, "_termination_reason": "max_turns", "_turn_placement": []}))
    abort = {"phase": "run", "window": [1.0, 2.5], "elapsed_s": 1.5, "node": "10.0.0.3", "gpu_ids": [2],
             "turns": 1, "error": "SandboxError: container died"}
    aborted = stored_sample(Sample("s1", 0, "fix it", status=Status.ABORTED, tokens=[0, 0], response_length=1,
                     reward={"score": 0.0}, remove_sample=True,
                     metadata={"_turns": 1, "_termination_reason": "infra_sandbox", "_abort": abort,
                               "_placement": {"node": "10.0.0.3", "gpu_ids": [2], "gpu": 1.0},
                               "_turn_placement": [{"turn": 1, "engine": "student"}]}))
    metrics = {"eval/math/accuracy": 0.5, "eval/math/pass@2": 1.0, "eval/swe/accuracy": 0.0}
    return EvalResult(3, metrics, {"math": [ok, wrong], "swe": [aborted]}), abort


EXPECTED_SAMPLES = [
    {"dataset": "math", "task_id": "m1", "index": 0, "status": "completed", "reward": {"score": 1.0},
     "termination_reason": "stop", "failure_class": "success", "turns": 2, "prompt_tokens": 3,
     "response_tokens": 2, "remove_sample": False, "abort": None, "response": "2 ✓"},
    {"dataset": "math", "task_id": "m1", "index": 1, "status": "truncated", "reward": {"score": 0.0},
     "termination_reason": "max_turns", "failure_class": "max_turns", "turns": 4, "prompt_tokens": 2,
     "response_tokens": 1, "remove_sample": False, "abort": None, "response": "3"},
    {"dataset": "swe", "task_id": "s1", "index": 0, "status": "aborted", "reward": {"score": 0.0},
     "termination_reason": "infra_sandbox", "failure_class": "infra_sandbox", "turns": 1, "prompt_tokens": 1,
     "response_tokens": 1, "remove_sample": True, "abort": "ABORT", "response": ""},
]
EXPECTED_PLACEMENT = [
    {"dataset": "math", "task_id": "m1", "index": 0, "turn": 1, "node": "10.0.0.2", "gpu_ids": [0],
     "engine": "student"},
    {"dataset": "math", "task_id": "m1", "index": 0, "turn": 2, "node": "10.0.0.2", "gpu_ids": [0, 1],
     "engine": "teacher", "engine_s": 0.5},
    # the turn named no node: the sample's token says where it ran
    {"dataset": "swe", "task_id": "s1", "index": 0, "turn": 1, "node": "10.0.0.3", "gpu_ids": [2],
     "engine": "student"},
]


def test_the_episode_record_derives_the_metadata_these_files_read():
    result, _ = _result()
    [aborted] = result.samples["swe"]
    record = EpisodeRecord(turns=1, termination_reason=None, placement=Placement("10.0.0.3", (2,), 1.0),
                           turn_records=[TurnRecord(1, "student")],
                           abort=AbortRecord(AbortReason.INFRA_SANDBOX, EpisodePhase.RUN, [1.0, 2.5], 1.5, "10.0.0.3",
                                             [2], 1, "SandboxError: container died"))
    assert aborted.episode == record and not aborted.metadata  # the trainer's keys read back into the record
    assert episode_metadata(record) == trainer_metadata(aborted)
    record.termination_reason = TerminationReason.STOP  # an abort in the verify phase keeps the agent's reason
    assert episode_metadata(record)["_termination_reason_agent"] == "stop"
    assert episode_metadata(record)["_termination_reason"] == "infra_sandbox"
    done = EpisodeRecord(turns=4, termination_reason=TerminationReason.MAX_TURNS)
    assert episode_metadata(done) == {"_turns": 4, "_termination_reason": "max_turns"}
    assert art.sample_record("math", Sample("m", 0, "p", episode=done))["failure_class"] == "max_turns"


def test_write_eval_contents_are_exact(tmp_path):
    result, abort = _result()
    paths = EvalDetailsWriter(tmp_path).write_eval(3, result)
    d = tmp_path / "eval_details"
    assert paths == {"samples": d / "3.jsonl", "placement": d / "3.placement.jsonl", "summary": d / "3.summary.json"}
    expected = [dict(r, abort=abort if r["abort"] == "ABORT" else r["abort"]) for r in EXPECTED_SAMPLES]
    assert read_jsonl(paths["samples"]) == expected
    assert read_jsonl(paths["placement"]) == EXPECTED_PLACEMENT
    summary = json.loads(paths["summary"].read_text())
    zeros = dict.fromkeys(failure_summary([]), 0)
    assert summary == {
        "rollout_id": 3, "kind": "eval", "n_samples": 3,
        "failure_classes": zeros | {"success": 1, "max_turns": 1, "infra_sandbox": 1},
        "datasets": {"math": {"n_samples": 2, "failure_classes": zeros | {"success": 1, "max_turns": 1}},
                     "swe": {"n_samples": 1, "failure_classes": zeros | {"infra_sandbox": 1}}},
        "aborts": {"n_aborted": 1, "by_reason": {"infra_sandbox": 1},
                   "first": {"task_id": "s1", "index": 0, "reason": "infra_sandbox", "phase": "run",
                             "error": "SandboxError: container died"}},
        "metrics": result.metrics,
    }
    assert summary["failure_classes"] == failure_summary(s for ss in result.samples.values() for s in ss)
    for name, ss in result.samples.items():
        assert summary["datasets"][name]["failure_classes"] == failure_summary(ss)
    assert sorted(p.name for p in d.iterdir()) == ["3.jsonl", "3.placement.jsonl", "3.summary.json"]


def test_streaming_then_write_eval_replaces_with_the_whole_ordered_file(tmp_path):
    result, _ = _result()
    math, swe = result.samples["math"], result.samples["swe"]
    with EvalDetailsWriter(tmp_path) as w:
        done = w.on_task_done(3)
        asyncio.run(done(Task("s1", "fix it", TaskConfig("swe"), metadata={"_eval_dataset_name": "swe"}), swe))
        w.append_sample(3, math[1], "math")
        streamed = read_jsonl(tmp_path / "eval_details" / "3.jsonl")
        assert [(r["dataset"], r["task_id"], r["index"]) for r in streamed] == [("swe", "s1", 0), ("math", "m1", 1)]
        assert not (tmp_path / "eval_details" / "3.summary.json").exists()  # no summary: not complete
        w.write_eval(3, result)
        assert [r["task_id"] for r in read_jsonl(tmp_path / "eval_details" / "3.jsonl")] == ["m1", "m1", "s1"]
        assert read_jsonl(tmp_path / "eval_details" / "3.placement.jsonl") == EXPECTED_PLACEMENT


class _DyingFile:
    """Writes through to a real file; the write numbered ``die_at`` writes half its bytes and raises,
    as a process killed mid-write (or a full disk) would leave it."""

    def __init__(self, f, die_at):
        self.f, self.die_at, self.n = f, die_at, 0

    def write(self, data):
        self.n += 1
        if self.n == self.die_at:
            self.f.write(bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_write_failing_part_way_leaves_only_whole_lines(tmp_path, monkeypatch):
    result, _ = _result()
    real_open = art._open_append
    monkeypatch.setattr(art, "_open_append",
                        lambda p: _DyingFile(real_open(p), die_at=3) if p.name == "7.jsonl" else real_open(p))
    w = EvalDetailsWriter(tmp_path)
    samples = result.samples["math"] * 3  # records 1 and 2 go through; record 3 dies half-written
    with pytest.raises(OSError, match="No space left"):
        for s in samples:
            w.append_sample(7, s, "math")
    path = tmp_path / "eval_details" / "7.jsonl"
    raw = path.read_bytes()
    assert raw.endswith(b"\n") and len(raw.splitlines()) == 2
    assert [r["index"] for r in read_jsonl(path)] == [0, 1]
    w.append_sample(7, samples[2], "math")  # the writer carries on from the last whole line
    assert [r["index"] for r in read_jsonl(path)] == [0, 1, 0]
    w.close()


def test_a_killed_writer_leaves_a_torn_tail_that_is_ignored_then_cut(tmp_path, caplog):
    result, _ = _result()
    w = EvalDetailsWriter(tmp_path)
    for s in result.samples["math"]:
        w.append_sample(1, s, "math")
    w.close()
    path = tmp_path / "eval_details" / "1.jsonl"
    with open(path, "ab") as f:  # what a SIGKILL in the middle of the third record leaves
        f.write(b'{"dataset": "math", "task_id": "m9", "ind')
    with caplog.at_level(logging.WARNING):
        assert [r["index"] for r in read_jsonl(path)] == [0, 1]
    assert "torn last record" in caplog.text
    with EvalDetailsWriter(tmp_path) as w2:  # a restarted writer cuts the tail before appending
        w2.append_sample(1, result.samples["swe"][0], "swe")
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and [json.loads(x)["task_id"] for x in lines[:-1]] == ["m1", "m1", "s1"]


def test_appender_on_a_file_that_is_all_torn(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"half": ' * 20000)  # longer than one scan block, no newline at all
    a = JsonlAppender(path)
    a.append({"a": 1})
    a.close()
    assert path.read_bytes() == b'{"a":1}\n'


def test_a_crash_during_write_eval_keeps_the_old_files(tmp_path, monkeypatch):
    result, _ = _result()
    w = EvalDetailsWriter(tmp_path)
    w.append_sample(3, result.samples["math"][0], "math")
    w.close_stream(3)
    before = (tmp_path / "eval_details" / "3.jsonl").read_bytes()
    calls, real_line = [], art._line

    def dying_line(record):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed after one record of the whole-file write
        return real_line(record)

    monkeypatch.setattr(art, "_line", dying_line)
    with pytest.raises(KeyboardInterrupt):
        w.write_eval(3, result)
    d = tmp_path / "eval_details"
    assert (d / "3.jsonl").read_bytes() == before
    assert sorted(p.name for p in d.iterdir()) == ["3.jsonl", "3.placement.jsonl"]  # no temp, no summary


def test_rollout_summary(tmp_path):
    def s(ds, score, reason="stop", **kw):
        meta = {"_dataset_name": ds} if ds else {}
        return Sample("t", 0, "p", reward={"score": score}, metadata=meta, episode=ended(reason), **kw)

    groups = [[s("a", 1.0), s("a", 0.0)], [s("b", 0.0, "infra_conn", remove_sample=True)], [s(None, 0.0, "length")]]
    path = EvalDetailsWriter(tmp_path).write_rollout_summary(4, RolloutResult(4, groups, {"rollout/n": 4.0}))
    assert path == tmp_path / "eval_details" / "train_4.summary.json"
    zeros = dict.fromkeys(failure_summary([]), 0)
    assert json.loads(path.read_text()) == {
        "rollout_id": 4, "kind": "train", "n_groups": 3, "n_samples": 4, "n_removed": 1,
        "failure_classes": failure_summary(x for g in groups for x in g),
        "datasets": {"a": {"n_samples": 2, "failure_classes": zeros | {"success": 1, "wrong_answer": 1}},
                     "b": {"n_samples": 1, "failure_classes": zeros | {"infra_conn": 1}},
                     "unknown": {"n_samples": 1, "failure_classes": zeros | {"max_context": 1}}},
        "aborts": {"n_aborted": 1, "by_reason": {"infra_conn": 1},
                   "first": {"task_id": "t", "index": 0, "reason": "infra_conn", "phase": "run", "error": "test"}},
        "filters": None,  # a step without filters
        "metrics": {"rollout/n": 4.0},
    }


def test_damage_before_the_last_line_and_bad_ids_are_errors(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(ValueError, match=r"x.jsonl:2: not a JSON record"):
        read_jsonl(path)
    with pytest.raises(ValueError, match="rollout_id must be an int >= 0"):
        EvalDetailsWriter(tmp_path).append_sample(-1, Sample("t", 0, "p"))

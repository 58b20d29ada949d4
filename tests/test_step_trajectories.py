import enum
import io
import os
import pickle
import re
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rayapp.steps.trajectories as tr
from rayapp.recipe.environment import read_environment
from rayapp.record import EpisodeRecord, TurnRecord
from rayapp.steps.reuse import ENV_KNOBS, MAIN_FILE, Decision, ReusePolicy, SaveKind
from rayapp.steps.trajectories import (
    TrajectoryError,
    load_trajectories,
    plain_to_samples,
    samples_to_plain,
    save_trajectories,
)
from rayapp.types import Sample, Status

# ---- round trip ----------------------------------------------------------------------------------

plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (st.lists(inner, max_size=4) | st.tuples(inner, inner)
                   | st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=16,
)
samples = st.builds(
    Sample,
    task_id=st.text(), index=st.integers(0, 2**31), prompt=st.text() | st.lists(st.dictionaries(st.text(), plain)),
    label=plain, status=st.sampled_from(Status), tokens=st.lists(st.integers(-2**63, 2**63 - 1)),
    response=st.text(), response_length=st.integers(0, 10**6),
    rollout_log_probs=st.lists(st.floats(allow_nan=False)), loss_mask=st.lists(st.integers(0, 1)),
    reward=st.dictionaries(st.text(), st.floats(allow_nan=False)),
    metadata=st.dictionaries(st.text(), plain), remove_sample=st.booleans(),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=st.lists(st.lists(samples, max_size=3), max_size=3), rollout_id=st.none() | st.integers(0, 10**6))
def test_plain_round_trip_is_exact_also_through_torch_save(groups, rollout_id):
    data = samples_to_plain(groups, rollout_id)
    assert {k: data[k] for k in ("format", "version", "rollout_id")} == {
        "format": "rayapp.trajectories", "version": 1, "rollout_id": rollout_id}
    assert plain_to_samples(data) == groups
    buf = io.BytesIO()
    torch.save(data, buf)
    buf.seek(0)
    assert plain_to_samples(torch.load(buf, weights_only=True)) == groups


def sample(task_id="t", index=0, **kw):
    fields = dict(label={"answer": (4, "ü")}, status=Status.COMPLETED, tokens=[1, 2, 3, 150_000],
                  response="réponse", response_length=2, rollout_log_probs=[-0.25, -1e-300], loss_mask=[1, 1],
                  reward={"score": 1.0})
    return Sample(task_id, index, "prompt ✓ 日本", **{**fields, **kw})


def test_file_is_plain_data_with_header_and_token_tensors(tmp_path):
    record = EpisodeRecord(turns=1, turn_records=[TurnRecord(1, "e", "10.0.0.1", [0, 1])])
    groups = [[sample(metadata={"kind": "x"}, episode=record)], []]
    path = save_trajectories(tmp_path / "sub" / MAIN_FILE, groups, rollout_id=7)
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "rayapp.trajectories" and raw["version"] == 1 and raw["rollout_id"] == 7
    s = raw["groups"][0][0]
    assert s["tokens"].dtype == torch.int32 and s["loss_mask"].dtype == torch.int8
    assert s["rollout_log_probs"].dtype == torch.float64 and s["status"] == "completed"
    assert "episode" not in s and s["metadata"] == {  # the trainer's data: the record as the spec's keys
        "kind": "x", "_turns": 1, "_termination_reason": None,
        "_turn_placement": [{"turn": 1, "engine": "e", "node": "10.0.0.1", "gpu_ids": [0, 1]}]}
    assert load_trajectories(path) == (7, groups)
    assert [p.name for p in path.parent.iterdir()] == [MAIN_FILE]  # no temp file left behind


def test_tensors_tuples_and_base_types_of_subclasses():
    class Color(enum.StrEnum):
        RED = "red"

    Pt = namedtuple("Pt", "x y")
    view = torch.arange(1000)[:3]
    s = sample(metadata={"t": view, "tu": (1, (2, "x")), "e": Color.RED, "nt": Pt(1, 2), "d": {1.5: None}})
    [[back]] = plain_to_samples(samples_to_plain([[s]]))
    assert torch.equal(back.metadata["t"], view) and back.metadata["t"].untyped_storage().nbytes() == 3 * 8
    assert back.metadata["tu"] == (1, (2, "x")) and type(back.metadata["e"]) is str
    assert type(back.metadata["nt"]) is tuple and back.metadata["d"] == {1.5: None}
    s2 = sample(tokens=torch.tensor([5, 6]))  # a trainer may have put a tensor there: stored, read back as a list
    assert plain_to_samples(samples_to_plain([[s2]]))[0][0].tokens == [5, 6]


class Opaque:
    pass


@pytest.mark.parametrize(("build", "message"), [
    (lambda: sample(metadata={"x": [1, Opaque()]}), r"groups\[0\]\[0\]\.metadata\['x'\]\[1\]: a .*Opaque is not plain"),
    (lambda: sample(metadata={"s": {1, 2}}), r"metadata\['s'\]: a builtins.set is not plain"),
    (lambda: sample(metadata={(1, 2): 0}), r"dict key \(1, 2\)"),
    (lambda: sample(metadata={"b": b""}), r"metadata\[.b.\]: a builtins.bytes is not plain"),
    (lambda: sample(index="3"), r'groups\[0\]\[0\]: \$\.index: expected int, got "3"$'),
    (lambda: sample(status="bogus"),
     r'groups\[0\]\[0\]: \$\.status: expected "pending" or "completed" or "truncated" or "aborted", got "bogus"$'),
    (lambda: sample(tokens=[1, True]), r"\.tokens\[1\]: expected an int, got True"),
    (lambda: sample(tokens=[2**64]), r"\.tokens: values outside int64"),
    (lambda: sample(tokens=torch.ones(2, 2, dtype=torch.long)), r"expected a 1-D integer tensor"),
    (lambda: sample(rollout_log_probs=[0.5, "x"]), r"rollout_log_probs\[1\]: expected a float"),
    (lambda: "not a sample", r"groups\[0\]\[0\]: expected a Sample, got str"),
])
def test_refuses_at_save_time_what_could_not_load(tmp_path, build, message):
    with pytest.raises(TypeError, match=message):
        save_trajectories(tmp_path / "x.pt", [[build()]], 0)
    assert not any(tmp_path.iterdir())


def test_reference_cycle_is_refused():
    cyc: list = [1]
    cyc.append(cyc)
    with pytest.raises(TypeError, match="reference cycle"):
        samples_to_plain([[sample(metadata={"c": cyc})]])


def test_crash_during_save_leaves_the_old_file(tmp_path, monkeypatch):
    path = save_trajectories(tmp_path / MAIN_FILE, [[sample()]], 0)
    before = path.read_bytes()

    def dying_save(obj, f):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # the process is going down mid-write

    monkeypatch.setattr(tr.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        save_trajectories(path, [[sample(index=1)]], 1)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [MAIN_FILE]


# ---- bad files -----------------------------------------------------------------------------------

def _good_bytes():
    buf = io.BytesIO()
    torch.save(samples_to_plain([[sample()] * 4], 3), buf)
    return buf.getvalue()


def _torch_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _with_metadata(metadata):
    """A good file's plain data, its one sample's metadata replaced."""
    plain = samples_to_plain([[sample()]])
    return {**plain, "groups": [[{**plain["groups"][0][0], "metadata": metadata}]]}


@pytest.mark.parametrize(("content", "problem"), [
    (None, "no such file"),
    ("dir", "is a directory"),
    (b"", "not a torch.save file of plain data"),
    (lambda: _good_bytes()[: len(_good_bytes()) // 2], "truncated/corrupt"),
    (b"hello, not a zip", "truncated/corrupt"),
    (lambda: _torch_bytes(torch.zeros(3)), "holds a Tensor, not a 'rayapp.trajectories' dict"),
    (lambda: _torch_bytes(Opaque()), "Unsupported global"),
    (lambda: pickle.dumps(Opaque()), "not a torch.save file of plain data"),
    (lambda: _torch_bytes({"groups": []}), "without the 'format' header"),
    (lambda: _torch_bytes({"format": "other", "version": 1}), "format 'other'"),
    (lambda: _torch_bytes({**samples_to_plain([]), "version": 2}), "version 2; this code reads version 1"),
    (lambda: _torch_bytes({**samples_to_plain([]), "rollout_id": -1}), "rollout_id -1"),
    (lambda: _torch_bytes({**samples_to_plain([]), "groups": [1]}), "'groups' is not a list of lists"),
    (lambda: _torch_bytes({**samples_to_plain([]), "groups": [[{"index": 0}]]}),
     r"groups[0][0]: $.task_id: missing required field"),
    (lambda: _torch_bytes({**samples_to_plain([[sample()]]), "groups": [[{**samples_to_plain([[sample()]])[
        "groups"][0][0], "tokens": torch.zeros(2)}]]}), "groups[0][0].tokens: expected a 1-D integer tensor"),
    # an earlier version wrote weight versions as strings; one type now, nothing parsed back
    (lambda: _torch_bytes(_with_metadata({"_turn_placement": [{"turn": 1, "engine": "e", "weight_version": "3"}]})),
     "groups[0][0].metadata: Expected `int | null`, got `str` - at `$[0].weight_version`"),
])
def test_every_bad_file_is_one_trajectory_error_naming_it(tmp_path, content, problem):
    path = tmp_path / "bad.pt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content() if callable(content) else content)
    with pytest.raises(TrajectoryError) as info:
        load_trajectories(path)
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"{path}: ") and problem in str(info.value), str(info.value)


# ---- reuse policy --------------------------------------------------------------------------------

def _decide(env, rollout_id, save_dir):
    return read_environment(env).reuse.decide(rollout_id, save_dir)


def test_decision_table(tmp_path):
    main, it = tmp_path / MAIN_FILE, lambda n: tmp_path / f"trajectory_sft_samples_iter_{n:03d}.pt"
    both = lambda n: {SaveKind.MAIN: main, SaveKind.PER_ITER: it(n)}  # noqa: E731
    fresh = {"STACX_FORCE_FRESH_ROLLOUT": "1"}
    assert _decide(fresh, 0, tmp_path) == Decision(True, None, both(0), "force-fresh")
    assert _decide(fresh, 12, tmp_path) == Decision(True, None, both(12), "force-fresh")
    assert _decide({**fresh, "STACX_SAVE_PER_ITER_PT": "0"}, 3, tmp_path).save_paths == {SaveKind.MAIN: main}
    assert _decide({**fresh, "STACX_REUSE_ROLLOUT": "1"}, 3, tmp_path).fresh  # fresh bypasses reuse
    assert _decide({"STACX_REUSE_ROLLOUT": "true"}, 0, tmp_path) == Decision(False, main, {}, "reuse")
    assert _decide({"STACX_REUSE_ROLLOUT": "1"}, 5, tmp_path) == Decision(False, main, {}, "reuse")
    assert _decide({}, 0, tmp_path) == Decision(True, None, both(0), "first")
    assert _decide({"STACX_SAVE_PER_ITER_PT": "off"}, 0, tmp_path).save_paths == {SaveKind.MAIN: main}
    assert _decide({}, 1, tmp_path) == Decision(False, main, {}, "auto-reuse")
    assert _decide({"STACX_REUSE_ROLLOUT": "", "STACX_FORCE_FRESH_ROLLOUT": " "}, 2, tmp_path).mode == "auto-reuse"


def test_per_iter_replay_in_order_and_errors(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir()
    for name in ["trajectory_sft_samples_iter_010.pt", "trajectory_sft_samples_iter_000.pt",
                 "trajectory_sft_samples_iter_002.pt", ".trajectory_sft_samples_iter_001.pt.x.tmp", MAIN_FILE]:
        (d / name).write_bytes(b"")
    env = {"STACX_REUSE_PER_ITER_DIR": str(d)}
    assert [_decide(env, k, tmp_path).load_path.name[-6:] for k in range(3)] == ["000.pt", "002.pt", "010.pt"]
    assert _decide(env, 1, tmp_path) == Decision(False, d / "trajectory_sft_samples_iter_002.pt", {}, "replay")
    with pytest.raises(ValueError, match=r"holds 3 per-iteration files; iteration 3 has none to replay"):
        _decide(env, 3, tmp_path)
    with pytest.raises(ValueError, match=r"STACX_REUSE_PER_ITER_DIR=.*is not a folder"):
        _decide({"STACX_REUSE_PER_ITER_DIR": str(tmp_path / "nope")}, 0, tmp_path)
    (d / "trajectory_sft_samples_iter_0002.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="both iteration 2"):
        _decide(env, 0, tmp_path)
    with pytest.raises(ValueError, match="STACX_REUSE_ROLLOUT=1 and STACX_REUSE_PER_ITER_DIR are both set"):
        read_environment({**env, "STACX_REUSE_ROLLOUT": "1"})


@pytest.mark.parametrize("name", ["STACX_FORCE_FRESH_ROLLOUT", "STACX_REUSE_ROLLOUT", "STACX_SAVE_PER_ITER_PT"])
def test_bad_env_value_names_the_variable(name):
    with pytest.raises(ValueError, match=f"{name}='maybe': expected 1 or 0"):
        read_environment({name: "maybe"})


def test_bad_rollout_id_and_os_environ(monkeypatch, tmp_path):
    monkeypatch.setenv("STACX_REUSE_ROLLOUT", "yes")
    assert read_environment(os.environ).reuse.reuse_rollout
    with pytest.raises(ValueError, match="rollout_id must be an int >= 0"):
        ReusePolicy().decide(-1, tmp_path)


def test_env_knobs_lists_every_variable_the_module_reads():
    import rayapp.steps.reuse as reuse_module

    source = Path(reuse_module.__file__).read_text()
    assert set(re.findall(r"STACX_[A-Z_]+[A-Z]", source)) == set(ENV_KNOBS)
    assert all(isinstance(default, str) and meaning for default, meaning in ENV_KNOBS.values())


def test_rollout_or_reuse_saves_fresh_iterations_and_reloads_them(tmp_path):
    import asyncio

    from rayapp.steps.reuse import ReusePolicy, rollout_or_reuse
    from rayapp.types import Sample

    calls = []

    async def run():
        calls.append(1)
        return [[Sample("t0", 0, "p", tokens=[1, 2, 3], response_length=1, loss_mask=[1],
                        rollout_log_probs=[-0.5], reward={"score": 1.0})]]

    policy = ReusePolicy()  # neither knob: iteration 0 runs and saves, later ones reuse it
    groups0, d0 = asyncio.run(rollout_or_reuse(0, tmp_path, run, policy))
    assert d0.fresh and len(calls) == 1 and all(p.exists() for p in d0.save_paths.values())
    groups1, d1 = asyncio.run(rollout_or_reuse(1, tmp_path, run, policy))
    assert not d1.fresh and len(calls) == 1  # no second rollout
    assert groups1[0][0].tokens == [1, 2, 3] and groups1[0][0].reward == {"score": 1.0}
    assert groups1[0][0].rollout_log_probs == groups0[0][0].rollout_log_probs
    _, d2 = asyncio.run(rollout_or_reuse(2, tmp_path, run, ReusePolicy(force_fresh=True)))
    assert d2.fresh and len(calls) == 2

"""Converters from a RolloutResult to trainer batches: verl's DataProto layout and slime's Sample
dicts. The layout tests need torch only; the DataProto tests run against the real verl class and
skip where verl is not installed (see docs/trainers.md for how to install it beside the project)."""

from __future__ import annotations

import msgspec
import pytest
from conftest import ended
from hypothesis import given, settings
from hypothesis import strategies as st

from rayapp.core.contracts import EvalResult, RolloutResult, UnfinishedGroup
from rayapp.record import (
    Actor,
    DaggerLabel,
    EpisodeRecord,
    EpisodeTiming,
    Placement,
    ResumePoint,
    TerminationReason,
    ToolReplay,
    TurnRecord,
)
from rayapp.trainers.converters import (
    EpisodeKey,
    for_trainer,
    stored_sample,
    to_slime,
    trainer_sample,
    verl_tensors,
)
from rayapp.types import Sample, Status, Task, TaskConfig

torch = pytest.importorskip("torch")

# The fields of slime.utils.types.Sample that its from_dict sets (read from slime's source).
SLIME_FIELDS = {"group_index", "index", "prompt", "tokens", "response", "response_length", "label", "reward",
                "loss_mask", "weight_versions", "rollout_log_probs", "remove_sample", "status", "metadata"}


def make_sample(task: str, index: int, prompt: list[int], response: list[int], *, mask=None, log_probs=True,
                score=1.0, removed=False, versions=()) -> Sample:
    n = len(response)
    return Sample(
        task, index, f"prompt of {task}", label="7", status=Status.COMPLETED, tokens=prompt + response,
        response=f"r{index}", response_length=n,
        rollout_log_probs=[-0.1 * (k + 1) for k in range(n)] if log_probs else [],
        loss_mask=list(mask) if mask is not None else [1] * n, reward={"score": score}, remove_sample=removed,
        metadata={EpisodeKey.TURN_PLACEMENT.value: [{"turn": t, "engine": "e", "weight_version": v}
                                                    for t, v in enumerate(versions, 1)]},
    )


def two_groups() -> RolloutResult:
    return RolloutResult(7, [
        [make_sample("t0", 0, [11, 12, 13], [21, 22], score=1.0, versions=[3]),
         make_sample("t0", 1, [11, 12, 13], [31, 32, 33, 34], mask=[1, 0, 0, 1], score=0.0, versions=[0, 4])],
        [make_sample("t1", 0, [14], [41], score=0.5),
         make_sample("t1", 1, [14], [51, 52, 53], score=1.0, removed=True)],
    ])


samples_st = st.lists(st.tuples(
    st.lists(st.integers(1, 50_000), min_size=1, max_size=6),  # prompt
    st.lists(st.integers(1, 50_000), min_size=0, max_size=6),  # response
    st.floats(-1, 1, allow_nan=False, width=32),  # score
    st.booleans(),  # removed
    st.data(),
), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(groups=st.lists(samples_st, min_size=1, max_size=3), pad=st.sampled_from([0, 99_999]))
def test_every_row_gives_back_its_sample(groups, pad):
    result = RolloutResult(1, [
        [make_sample(f"t{g}", i, p, r, score=score, removed=removed,
                     mask=data.draw(st.lists(st.integers(0, 1), min_size=len(r), max_size=len(r))))
         for i, (p, r, score, removed, data) in enumerate(group)] for g, group in enumerate(groups)])
    t = verl_tensors(result, pad_token_id=pad)["tensors"]
    samples = [s for group in result.groups for s in group]
    p_w, r_w = t["prompts"].shape[1], t["responses"].shape[1]
    assert t["input_ids"].shape == t["attention_mask"].shape == t["position_ids"].shape == (len(samples), p_w + r_w)
    for i, s in enumerate(samples):
        n, p = s.response_length, len(s.tokens) - s.response_length
        real = t["attention_mask"][i].bool()
        assert t["input_ids"][i][real].tolist() == s.tokens  # real tokens, in order, nothing else
        assert t["prompts"][i, p_w - p:].tolist() == s.tokens[:p] and set(t["prompts"][i, :p_w - p].tolist()) <= {pad}
        assert t["responses"][i, :n].tolist() == s.tokens[p:] and set(t["responses"][i, n:].tolist()) <= {pad}
        assert t["position_ids"][i][real].tolist() == list(range(len(s.tokens)))
        assert t["response_mask"][i].tolist() == ([0] * n if s.remove_sample else s.loss_mask) + [0] * (r_w - n)
        if "rollout_log_probs" in t:
            assert t["rollout_log_probs"][i, :n].tolist() == pytest.approx(s.rollout_log_probs)
        else:  # every sample has log-probs on its response tokens: only no response at all has none
            assert n == 0
        scores = t["token_level_scores"][i]
        assert scores.sum().item() == pytest.approx(s.reward["score"] if n else 0.0)
        assert all(v == 0 for k, v in enumerate(scores.tolist()) if k != n - 1)


def test_the_layout_of_a_known_result():
    out = verl_tensors(two_groups(), pad_token_id=0)
    t, nt = out["tensors"], out["non_tensors"]
    assert t["input_ids"].tolist() == [[11, 12, 13, 21, 22, 0, 0], [11, 12, 13, 31, 32, 33, 34],
                                       [0, 0, 14, 41, 0, 0, 0], [0, 0, 14, 51, 52, 53, 0]]
    assert t["position_ids"].tolist()[2] == [0, 0, 0, 1, 1, 1, 1]  # as verl: the last position repeats
    assert t["response_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert t["token_level_scores"].tolist() == [[0, 1, 0, 0], [0, 0, 0, 0], [0.5, 0, 0, 0], [0, 0, 1, 0]]
    assert {k: v.dtype for k, v in t.items()} == {
        "prompts": torch.int64, "responses": torch.int64, "input_ids": torch.int64, "attention_mask": torch.int64,
        "position_ids": torch.int64, "response_mask": torch.int64, "token_level_scores": torch.float32,
        "rollout_log_probs": torch.float32}
    uid = nt["uid"].tolist()
    assert uid[0] == uid[1] != uid[2] == uid[3]
    assert nt["task_id"].tolist() == ["t0", "t0", "t1", "t1"] and nt["index"].tolist() == [0, 1, 0, 1]
    assert out["meta_info"] == {"rollout_id": 7}


def test_fixed_widths_pad_to_them_and_a_wider_row_is_refused():
    t = verl_tensors(two_groups(), prompt_length=5, response_length=6)["tensors"]
    assert t["prompts"].shape == (4, 5) and t["responses"].shape == (4, 6)
    with pytest.raises(ValueError, match=r"row 1 .*response of 4 tokens is wider than response_length=3"):
        verl_tensors(two_groups(), response_length=3)


def test_no_log_probs_leaves_the_key_out():
    result = RolloutResult(0, [[make_sample("t", 0, [1], [2, 3], log_probs=False)]])
    assert "rollout_log_probs" not in verl_tensors(result)["tensors"]


@pytest.mark.parametrize("breakage,match", [
    (lambda s: setattr(s, "loss_mask", [1]), r"group 1 \(task 't1'\) sample 1: loss_mask has 1 entries for 3"),
    (lambda s: setattr(s, "rollout_log_probs", [-1.0]), r"sample 1: rollout_log_probs has 1 entries for 3"),
    (lambda s: setattr(s, "rollout_log_probs", []), r"rollout_log_probs on 3 of 4 samples"),
    (lambda s: setattr(s, "response_length", 9), r"response_length 9 is outside its 4 tokens"),
    (lambda s: setattr(s, "reward", {"acc": 1.0}), r"reward \{'acc': 1.0\} has no 'score'"),
])
def test_a_sample_that_does_not_line_up_is_one_clear_error(breakage, match):
    result = two_groups()
    breakage(result.groups[1][1])
    with pytest.raises(ValueError, match=match):
        verl_tensors(result)


def test_an_empty_result_is_refused():
    with pytest.raises(ValueError, match="no samples"):
        verl_tensors(RolloutResult(3, []))
    with pytest.raises(ValueError, match="no samples"):
        to_slime(RolloutResult(3, [[]]))


def test_slime_dicts_carry_what_slime_reads():
    result = two_groups()
    out = to_slime(result)
    assert all(set(d) == SLIME_FIELDS for d in out)
    assert [d["group_index"] for d in out] == [0, 0, 1, 1] and [d["index"] for d in out] == [0, 1, 0, 1]
    assert [d["reward"] for d in out] == [1.0, 0.0, 0.5, 1.0]
    assert [d["weight_versions"] for d in out] == [["3"], ["0", "4"], [], []]  # slime types them str
    assert out[3]["remove_sample"] is True and out[0]["status"] == "completed"
    s = result.groups[0][1]
    assert out[1]["tokens"] == s.tokens and out[1]["loss_mask"] == s.loss_mask
    assert out[1]["rollout_log_probs"] == s.rollout_log_probs
    assert to_slime(result, reward_key=None)[2]["reward"] == {"score": 0.5}
    broken = two_groups()
    broken.groups[0][0].loss_mask = []
    with pytest.raises(ValueError, match=r"group 0 \(task 't0'\) sample 0: loss_mask"):
        to_slime(broken)


def test_the_real_verl_dataproto_takes_the_batch_and_grpo_groups_it():
    verl = pytest.importorskip("verl")
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils.model import compute_position_id_with_mask

    from rayapp.trainers.converters import to_verl

    data = to_verl(two_groups())
    assert isinstance(data, verl.DataProto) and len(data) == 4
    assert set(data.batch.keys()) >= {"prompts", "responses", "input_ids", "attention_mask", "position_ids",
                                      "response_mask", "rollout_log_probs", "token_level_scores"}
    assert torch.equal(data.batch["position_ids"], compute_position_id_with_mask(data.batch["attention_mask"]))
    adv, _ = compute_grpo_outcome_advantage(data.batch["token_level_scores"], data.batch["response_mask"],
                                            data.non_tensor_batch["uid"])
    # group t0 scored (1, 0): the solved sample is pushed up, the other down, only on its loss-mask tokens
    assert (adv[0, :2] > 0).all() and (adv[1][data.batch["response_mask"][1].bool()] < 0).all()
    assert (adv[data.batch["response_mask"] == 0] == 0).all()
    halves = data.chunk(2)
    assert verl.DataProto.concat(halves).batch["input_ids"].tolist() == data.batch["input_ids"].tolist()


def _full_record() -> EpisodeRecord:
    turns = [TurnRecord(1, "teacher", "n0", [0], Actor.TEACHER, 0.5, 3),
             TurnRecord(2, "student", actor=Actor.STUDENT)]
    point = ResumePoint(2, [1, 2, 3], 1, [1, 0], [-0.5, 0.0], turns, [ToolReplay("bash", {"command": "ls"})],
                        [DaggerLabel(2, 3, [7], "x")], partial=1)
    return EpisodeRecord(turns=2, termination_reason=TerminationReason.MAX_TURNS, placement=Placement("n0", (0,), 0.5),
                         turn_records=turns, dagger_labels=[DaggerLabel(2, 3, [7], "x")], resume=point,
                         timing=EpisodeTiming(1.0, "rollout0/b0", 0.25, 0.5, 2.0, 0.5, 3.5))


def test_the_door_writes_the_spec_keys_and_reads_them_back():
    s = make_sample("t0", 0, [1], [2], versions=())
    s.metadata = {"_dataset_name": "a"}
    s.episode = _full_record()
    out = trainer_sample(s)
    assert out is not s and s.episode == _full_record() and s.metadata == {"_dataset_name": "a"}  # s as it was
    assert out.episode == EpisodeRecord()
    m = out.metadata
    assert m["_dataset_name"] == "a" and m["_turns"] == 2 and m["_termination_reason"] == "max_turns"
    assert m["_placement"] == {"node": "n0", "gpu_ids": [0], "gpu": 0.5} and m["_turn_actor"] == ["teacher", "student"]
    assert m["_turn_placement"][0] == {"turn": 1, "engine": "teacher", "node": "n0", "gpu_ids": [0],
                                       "actor": "teacher", "engine_s": 0.5, "weight_version": 3}
    assert m["_timing"] == {"started": 1.0, "batch": "rollout0/b0", "queued": 0.25, "admitted": 0.5, "run_s": 2.0,
                            "verify_s": 0.5, "ended": 3.5}
    assert m["_resume"]["turns"] == 2 and m["_dagger_labels"] == [{"turn": 2, "state_len": 3, "label_ids": [7],
                                                                   "text": "x"}]
    assert stored_sample(msgspec.structs.replace(out, metadata=dict(out.metadata))) == s
    aborted = msgspec.structs.replace(s, episode=ended("infra_sandbox", turns=1, termination_reason=None))
    aborted.episode.termination_reason = TerminationReason.STOP
    back = trainer_sample(aborted)
    assert back.metadata["_termination_reason"] == "infra_sandbox"
    assert back.metadata["_termination_reason_agent"] == "stop"
    assert "reason" not in back.metadata["_abort"] and stored_sample(back) == aborted


def test_results_leave_through_the_door_and_slime_reads_either_form():
    s = make_sample("t0", 0, [1], [2])
    s.metadata, s.episode = {}, _full_record()
    result = RolloutResult(3, [[s]], unfinished=[UnfinishedGroup(1, Task("u", "p", TaskConfig("x")), [s])])
    out = for_trainer(result)
    assert result.groups[0][0] is s and s.episode == _full_record()  # the result itself is left as it is
    assert out.groups[0][0].metadata == out.unfinished[0].samples[0].metadata == trainer_sample(s).metadata
    assert to_slime(out) == to_slime(result)
    assert to_slime(result)[0]["weight_versions"] == ["3"]
    ev = for_trainer(EvalResult(3, {}, {"a": [s]}))
    assert ev.samples["a"][0].metadata["_turns"] == 2

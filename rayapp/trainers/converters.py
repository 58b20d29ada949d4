"""Where a step's result leaves the project for a trainer: a step's result as trainers get it.

Inside the project a sample's episode is one typed record (``Sample.episode``); here, and only here,
it becomes the spec's metadata keys (``EpisodeKey``), with the names and meaning they always had.
Every result leaves the step pipeline through ``for_trainer``; saved trajectories are written with
``trainer_sample`` and read back with ``stored_sample``; ``to_verl``/``verl_tensors`` and
``to_slime`` give the batches those trainers take (docs/trainers.md). Invariants: rows are the
samples in order, group after group, a ``remove_sample`` one too, so a group keeps its size;
``stored_sample(trainer_sample(s)) == s``; token data that does not line up is one ``ValueError``
naming the group, task, sample and field, and nothing is returned.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

import msgspec

from rayapp.core.contracts import EvalResult, RolloutResult, UnfinishedGroup
from rayapp.record import (
    AbortRecord,
    DaggerLabel,
    EpisodePhase,
    EpisodeRecord,
    EpisodeTiming,
    Placement,
    ResumePoint,
    TerminationReason,
    TurnRecord,
)
from rayapp.types import Sample


class EpisodeKey(enum.StrEnum):
    """The ``Sample.metadata`` keys a trainer reads of an episode (the spec's; docs/trainers.md)."""

    TURNS = "_turns"
    TERMINATION_REASON = "_termination_reason"  # the abort reason when aborted, else the agent's
    TERMINATION_REASON_AGENT = "_termination_reason_agent"  # the agent's, when an abort overrode it
    PLACEMENT = "_placement"
    TURN_PLACEMENT = "_turn_placement"
    TURN_ACTOR = "_turn_actor"
    DAGGER_LABELS = "_dagger_labels"
    ABORT = "_abort"
    RESUME = "_resume"  # a cut-short sample's ResumePoint (partial rollouts)
    TIMING = "_timing"  # EpisodeTiming: its batch's admission wait, its phases' durations


_EMPTY = EpisodeRecord()
# An abort's phase as the spec names it for the trainer: the verify phase is its "eval" phase.
_SPEC_PHASE = {EpisodePhase.RUN: "run", EpisodePhase.VERIFY: "eval"}
_PHASE = {v: k for k, v in _SPEC_PHASE.items()}
Result = TypeVar("Result", RolloutResult, EvalResult)


def episode_metadata(record: EpisodeRecord) -> dict[str, Any]:
    """The spec's metadata keys of ``record`` (``EpisodeKey``), plain data, set ones only."""
    out: dict[str, Any] = {}
    if record.placement is not None:
        place = record.placement  # its GPU ids as a list, as the spec's key has always held them
        out[EpisodeKey.PLACEMENT.value] = {"node": place.node, "gpu_ids": list(place.gpu_ids), "gpu": place.gpu}
    if record.turns is not None:
        out[EpisodeKey.TURNS.value] = record.turns
    if record.abort is not None:
        out[EpisodeKey.TERMINATION_REASON.value] = str(record.abort.reason)
        if record.termination_reason is not None:
            out[EpisodeKey.TERMINATION_REASON_AGENT.value] = str(record.termination_reason)
        abort = msgspec.to_builtins(record.abort)
        del abort["reason"]  # carried by _termination_reason
        abort["phase"] = _SPEC_PHASE[record.abort.phase]
        out[EpisodeKey.ABORT.value] = abort
    elif record.turns is not None or record.termination_reason is not None:  # the run phase is over
        reason = record.termination_reason
        out[EpisodeKey.TERMINATION_REASON.value] = None if reason is None else str(reason)
    if record.turn_records:
        out[EpisodeKey.TURN_PLACEMENT.value] = msgspec.to_builtins(record.turn_records)
        actors = [str(t.actor) for t in record.turn_records if t.actor is not None]
        if actors:
            out[EpisodeKey.TURN_ACTOR.value] = actors
    if record.dagger_labels:
        out[EpisodeKey.DAGGER_LABELS.value] = msgspec.to_builtins(record.dagger_labels)
    if record.resume is not None:
        out[EpisodeKey.RESUME.value] = msgspec.to_builtins(record.resume)
    if record.timing is not None:
        out[EpisodeKey.TIMING.value] = msgspec.to_builtins(record.timing)
    return out


def trainer_metadata(s: Sample) -> dict[str, Any]:
    """``s``'s metadata as the trainer reads it: its own keys and its episode's (``episode_metadata``)."""
    return {**s.metadata, **episode_metadata(s.episode)} if s.episode != _EMPTY else dict(s.metadata)


def trainer_sample(s: Sample) -> Sample:
    """``s`` as the trainer gets it: a copy whose episode is in its metadata (its record left empty)."""
    if s.episode == _EMPTY:
        return s
    return msgspec.structs.replace(s, metadata=trainer_metadata(s), episode=EpisodeRecord())


def for_trainer(result: Result) -> Result:
    """``result`` with every sample as the trainer gets it (``trainer_sample``); ``result`` is left as it is."""
    if isinstance(result, EvalResult):
        samples = {name: [trainer_sample(s) for s in ss] for name, ss in result.samples.items()}
        return msgspec.structs.replace(result, samples=samples)
    groups = [[trainer_sample(s) for s in g] for g in result.groups]
    unfinished = [UnfinishedGroup(u.index, u.task, [trainer_sample(s) for s in u.samples]) for u in result.unfinished]
    return msgspec.structs.replace(result, groups=groups, unfinished=unfinished)


T = TypeVar("T")


def _take(metadata: dict[str, Any], key: EpisodeKey, kind: type[T]) -> T | None:
    value = metadata.pop(key.value, None)
    return None if value is None else msgspec.convert(value, kind)


def stored_sample(s: Sample) -> Sample:
    """``s`` with its episode back in its record, in place, when it was saved in the trainer's form
    (its metadata keys, which leave its metadata); ``s`` as it is otherwise."""
    m = s.metadata
    if s.episode != _EMPTY or not any(k.value in m for k in EpisodeKey):
        return s
    reason = m.pop(EpisodeKey.TERMINATION_REASON.value, None)
    agent = m.pop(EpisodeKey.TERMINATION_REASON_AGENT.value, None)
    abort = m.pop(EpisodeKey.ABORT.value, None)
    m.pop(EpisodeKey.TURN_ACTOR.value, None)  # the turn records' actors
    s.episode = EpisodeRecord(
        turns=m.pop(EpisodeKey.TURNS.value, None),
        termination_reason=msgspec.convert(agent if abort is not None else reason, TerminationReason | None),
        placement=_take(m, EpisodeKey.PLACEMENT, Placement),
        turn_records=_take(m, EpisodeKey.TURN_PLACEMENT, list[TurnRecord]) or (),
        dagger_labels=_take(m, EpisodeKey.DAGGER_LABELS, list[DaggerLabel]) or (),
        abort=None if abort is None else msgspec.convert(
            {**abort, "reason": reason, "phase": _PHASE.get(abort.get("phase"), abort.get("phase"))}, AbortRecord),
        resume=_take(m, EpisodeKey.RESUME, ResumePoint),
        timing=_take(m, EpisodeKey.TIMING, EpisodeTiming))
    return s


class _Row:
    __slots__ = ("log_probs", "mask", "prompt", "response", "score", "uid")

    def __init__(self, uid: str, prompt: list[int], response: list[int], mask: list[int],
                 log_probs: list[float], score: float):
        self.uid, self.prompt, self.response, self.mask = uid, prompt, response, mask
        self.log_probs, self.score = log_probs, score


def _where(g: int, s: Sample) -> str:
    return f"group {g} (task {s.task_id!r}) sample {s.index}"


def _score(reward: dict[str, float], key: str, where: str) -> float:
    if not reward:
        return 0.0  # an aborted or removed sample was never verified
    if key not in reward:
        raise ValueError(f"{where}: reward {reward!r} has no {key!r}")
    return float(reward[key])


def _check_tokens(g: int, s: Sample) -> None:
    where, n = _where(g, s), s.response_length
    if not 0 <= n <= len(s.tokens):
        raise ValueError(f"{where}: response_length {n} is outside its {len(s.tokens)} tokens")
    if len(s.loss_mask) != n:
        raise ValueError(f"{where}: loss_mask has {len(s.loss_mask)} entries for {n} response tokens")
    if s.rollout_log_probs and len(s.rollout_log_probs) != n:
        raise ValueError(f"{where}: rollout_log_probs has {len(s.rollout_log_probs)} entries for {n} response tokens")


def _row(g: int, s: Sample, uid: str, reward_key: str) -> _Row:
    _check_tokens(g, s)
    cut = len(s.tokens) - s.response_length
    mask = [0] * s.response_length if s.remove_sample else list(s.loss_mask)
    return _Row(uid, s.tokens[:cut], s.tokens[cut:], mask, list(s.rollout_log_probs),
                _score(s.reward, reward_key, _where(g, s)))


def _rows(result: RolloutResult, reward_key: str) -> list[_Row]:
    rows = [_row(g, s, f"{result.rollout_id}:{g}:{s.task_id}", reward_key)
            for g, group in enumerate(result.groups) for s in group]
    if not rows:
        raise ValueError(f"rollout {result.rollout_id}: no samples to convert")
    with_lp = sum(1 for r in rows if r.log_probs or not r.response)
    if any(r.log_probs for r in rows) and with_lp < len(rows):
        raise ValueError(f"rollout {result.rollout_id}: rollout_log_probs on {with_lp} of {len(rows)} samples; "
                         "a trainer needs them on all or none")
    return rows


def _width(rows: list[_Row], part: str, fixed: int | None) -> int:
    longest = max(len(getattr(r, part)) for r in rows)
    if fixed is None:
        return longest
    if longest > fixed:
        i = next(i for i, r in enumerate(rows) if len(getattr(r, part)) > fixed)
        raise ValueError(f"row {i} ({rows[i].uid}): {part} of {longest} tokens is wider than {part}_length={fixed}")
    return fixed


def verl_tensors(result: RolloutResult, *, pad_token_id: int = 0, prompt_length: int | None = None,
                 response_length: int | None = None, reward_key: str = "score") -> dict[str, Any]:
    """The ``tensors``, ``non_tensors`` and ``meta_info`` that ``DataProto.from_dict`` takes. Widths
    are the longest prompt and response unless fixed (verl's ``rollout.prompt_length`` and
    ``response_length``). Needs torch and numpy."""
    import numpy as np
    import torch

    rows = _rows(result, reward_key)
    p_w, r_w = _width(rows, "prompt", prompt_length), _width(rows, "response", response_length)
    b = len(rows)
    prompts = torch.full((b, p_w), pad_token_id, dtype=torch.int64)
    responses = torch.full((b, r_w), pad_token_id, dtype=torch.int64)
    attention = torch.zeros((b, p_w + r_w), dtype=torch.int64)
    response_mask = torch.zeros((b, r_w), dtype=torch.int64)
    log_probs = torch.zeros((b, r_w), dtype=torch.float32)
    scores = torch.zeros((b, r_w), dtype=torch.float32)
    for i, r in enumerate(rows):
        p, n = len(r.prompt), len(r.response)
        if p:
            prompts[i, p_w - p:] = torch.tensor(r.prompt, dtype=torch.int64)
        attention[i, p_w - p: p_w + n] = 1
        if n:
            responses[i, :n] = torch.tensor(r.response, dtype=torch.int64)
            response_mask[i, :n] = torch.tensor(r.mask, dtype=torch.int64)
            scores[i, n - 1] = r.score  # verl's reward managers put the outcome on the last response token
        if r.log_probs:
            log_probs[i, :n] = torch.tensor(r.log_probs, dtype=torch.float32)
    tensors = {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention, "position_ids": torch.clip(torch.cumsum(attention, dim=-1) - 1, min=0),
        "response_mask": response_mask, "token_level_scores": scores,
    }
    if any(r.log_probs for r in rows):
        tensors["rollout_log_probs"] = log_probs
    samples = [s for group in result.groups for s in group]
    non_tensors = {
        "uid": np.array([r.uid for r in rows], dtype=object),
        "task_id": np.array([s.task_id for s in samples], dtype=object),
        "index": np.array([s.index for s in samples], dtype=np.int64),
        "status": np.array([str(s.status.value) for s in samples], dtype=object),
    }
    return {"tensors": tensors, "non_tensors": non_tensors, "meta_info": {"rollout_id": result.rollout_id}}


SEGMENTS = "gateway_segments"  # a gateway sample's earlier segments, with its evaluator's segments: each


def expand_segments(result: RolloutResult) -> RolloutResult:
    """``result`` with every sample a gateway agent kept under ``segments: each`` as one sample per
    segment, the earlier first: each holds that segment's tokens, loss mask and log-probs and shares
    the sample's group, index, reward and status; ``metadata["gateway_segment"]`` numbers it
    (``index`` of ``of``; ``reason``: why it began, for all but the last). Other samples are left as
    they are; so is ``result``. The groups grow past their size: for a trainer whose loss takes
    groups of any size (verl's GRPO advantage groups by ``uid``; rayapp's GRPO trainer); the trainer
    adapters, whose loops fix a group's size, take the last segment (docs/agents.md)."""
    def rows(s: Sample) -> list[Sample]:
        earlier = s.metadata.get(SEGMENTS)
        if not earlier:
            return [s]
        meta, n = {k: v for k, v in s.metadata.items() if k != SEGMENTS}, len(earlier) + 1
        out = [msgspec.structs.replace(
            s, tokens=list(seg["tokens"]), response_length=len(seg["tokens"]) - seg["prompt_len"], response="",
            loss_mask=list(seg["loss_mask"]), rollout_log_probs=list(seg["rollout_log_probs"]),
            metadata={**meta, "gateway_segment": {"index": i, "of": n, "reason": seg["reason"]}})
            for i, seg in enumerate(earlier)]
        return [*out, msgspec.structs.replace(s, metadata={**meta, "gateway_segment": {"index": n - 1, "of": n}})]

    return msgspec.structs.replace(result, groups=[[r for s in g for r in rows(s)] for g in result.groups])


def to_verl(result: RolloutResult, **kwargs: Any) -> Any:
    """``result`` as a ``verl.DataProto`` (``verl_tensors``' keyword arguments apply). Needs verl."""
    from verl import DataProto

    return DataProto.from_dict(**verl_tensors(result, **kwargs))


def _weight_versions(metadata: dict[str, Any]) -> list[str]:
    """Each model turn's weight version as slime types it (``Sample.weight_versions``: a list of str)."""
    turns = metadata.get(EpisodeKey.TURN_PLACEMENT.value) or []
    return [str(t["weight_version"]) for t in turns if isinstance(t, dict) and t.get("weight_version") is not None]


def to_slime(result: RolloutResult, *, reward_key: str | None = "score") -> list[dict[str, Any]]:
    """One slime ``Sample`` dict per sample (``Sample.from_dict(d)`` rebuilds it), group by group;
    ``group_index`` numbers the groups from 0 within this result."""
    out = []
    for g, group in enumerate(result.groups):
        for s in group:
            _check_tokens(g, s)
            meta = trainer_metadata(s)
            out.append({
                "group_index": g, "index": s.index, "prompt": s.prompt, "tokens": list(s.tokens),
                "response": s.response, "response_length": s.response_length, "label": s.label,
                "reward": _score(s.reward, reward_key, _where(g, s)) if reward_key else dict(s.reward),
                "loss_mask": list(s.loss_mask), "rollout_log_probs": list(s.rollout_log_probs) or None,
                "weight_versions": _weight_versions(meta), "remove_sample": s.remove_sample,
                "status": str(s.status.value), "metadata": meta,
            })
    if not out:
        raise ValueError(f"rollout {result.rollout_id}: no samples to convert")
    return out

"""OpenAIAgent (rayapp/gateway/agents.py): an agent written against the OpenAI API, run by the core's
Evaluator as an episode through an in-process Gateway served on 127.0.0.1, with the real openai SDK.
The example's agent (examples/openai_agent, which imports only openai) solves through tool calls; the
sample holds exactly the engine's ids at mask 1 with its log-probs, its verifier scores what the agent
returned; a budget that ends the episode is a truncated sample with its reason; a cancelled or
timed-out episode aborts its call at the engine, comes back classified, and leaves no episode open."""

import asyncio
import contextlib
from pathlib import Path

import pytest
from agent_helpers import CALL, InProcessEngine, ScriptedEngine, recording
from conftest import run
from gateway_helpers import HangingEngine, served

from rayapp.core.contracts import RolloutResult, StepContext
from rayapp.core.evaluator import Evaluator, TaskRun
from rayapp.gateway.agents import OpenAIAgent
from rayapp.trainers.converters import expand_segments, to_slime, trainer_sample, verl_tensors
from rayapp.types import EvaluatorSpec, Resource, Sample, SamplingParams, Status, StoppingCriteria, Task, TaskConfig

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"


@pytest.fixture
def example(monkeypatch):
    """The example's (agent, verifier), imported as PYTHONPATH=examples/openai_agent would."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from openai_agent import agent, verify

    return agent.solve, verify.verify


def episode(example, gateway, engine, agent=None, *, n=1, max_turns=4, timeout_s=120.0, segments="last",
            max_new_tokens=48):
    """The Evaluator's run (to await) of ``n`` samples of "What is 2 + 2?" with an OpenAIAgent, and the samples."""
    solve, verify = example
    handler = OpenAIAgent(gateway, engine, agent or solve, verify, segments=segments, call_timeout_s=60)
    spec = EvaluatorSpec("calc", handler, resource=Resource(concurrency=n))
    task = Task("calc-0", "What is 2 + 2?", TaskConfig("calc", n_samples=n), label="4")
    samples = [Sample(task.task_id, i, task.prompt, task.label) for i in range(n)]
    group = TaskRun(task, samples, StoppingCriteria(max_turns=max_turns, timeout_s=timeout_s),
                    SamplingParams(max_new_tokens=max_new_tokens))
    return Evaluator(spec, StepContext(0)).run([group]), samples


def spans(mask):
    """The [start, end) runs of 1s in a loss mask."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_the_example_agent_calls_its_tool_and_the_sample_holds_the_engine_s_tokens(example, tok, model_dir):
    engine = recording(ScriptedEngine(tok, model_dir, [CALL, "The answer is 4."]))

    async def go():
        async with served() as gateway:
            work, samples = episode(example, gateway, engine)
            await work
            assert len(gateway) == 0  # closed
            return samples

    [s] = run(go())
    assert s.status is Status.COMPLETED, s.episode.abort
    assert s.reward == {"score": 1.0} and s.response == "The answer is 4."  # the agent's return, verified
    assert s.episode.turns == 2 and len(s.episode.turn_records) == 2
    meta = s.metadata["gateway"]
    assert meta.pop("episode").startswith("r0-calc-0-0-")  # r<rollout>-<task>-<index>-<random>
    assert meta == {"calls": 2, "segments": 1, "reasons": {}}
    # the calculator's answer went back as a tool message, rendered into the second call's prompt
    assert '"result": "4"' in tok.decode(engine.sent[1].input_ids)
    response = s.tokens[-s.response_length:]
    trained = [response[a:b] for a, b in spans(s.loss_mask)]
    assert trained == [list(o) for o in engine.outputs]  # mask 1 exactly on the engine's ids, in order
    assert [lp for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m] == \
        [lp for out in engine.logprobs for lp in out]
    assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if not m)
    assert s.tokens[:len(engine.sent[0].input_ids)] == list(engine.sent[0].input_ids)  # the first prompt
    assert s.tokens[:len(engine.sent[1].input_ids)] == list(engine.sent[1].input_ids)  # extended, not re-rendered


def test_the_example_agent_on_the_real_hf_engine(example, tok, model_dir):
    from rayapp.inference.hf import HFBackend

    backend = HFBackend(str(model_dir), seed=0)
    engine = recording(InProcessEngine(backend))

    async def go():
        async with served() as gateway:
            work, samples = episode(example, gateway, engine, n=2)
            await work
            return samples

    try:
        samples = run(go())
    finally:
        backend.shutdown()
    assert len(engine.outputs) >= 2
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.episode.abort
        assert s.reward["score"] in (0.0, 1.0)
        response = s.tokens[-s.response_length:]
        for a, b in spans(s.loss_mask):
            assert response[a:b] in [list(o) for o in engine.outputs]


def test_a_budget_that_ends_the_episode_gives_a_truncated_sample_with_its_reason(example, tok, model_dir):
    engine = recording(ScriptedEngine(tok, model_dir, [CALL] * 5))  # it never stops calling the tool

    async def go():
        async with served() as gateway:
            work, samples = episode(example, gateway, engine, max_turns=2)
            await work
            return samples

    [s] = run(go())
    assert s.status is Status.TRUNCATED, s.episode.abort
    assert s.episode.termination_reason == "max_turns" and s.episode.turns == 2
    assert len(engine.sent) == 2  # the third call was refused before the engine
    assert len(spans(s.loss_mask)) == 2


def test_each_segment_rides_along_when_the_agent_edits_its_history(example, tok, model_dir):
    engine = recording(ScriptedEngine(tok, model_dir, ["The answer is 3.", "The answer is 4."]))

    async def summarising(client, task, sandbox):
        first = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": task.prompt}])
        # the agent rewrites its history (a summary, not the message it was sent): a new segment
        again = [{"role": "user", "content": f"{task.prompt} (you said: {first.choices[0].message.content})"}]
        return (await client.chat.completions.create(model="m", messages=again)).choices[0].message.content

    async def go(segments):
        async with served() as gateway:
            work, samples = episode(example, gateway, engine, summarising, segments=segments)
            await work
            return samples

    [last] = run(go("last"))
    assert {k: v for k, v in last.metadata["gateway"].items() if k != "episode"} == \
        {"calls": 2, "segments": 2, "reasons": {"history_edited": 1}}
    assert "gateway_segments" not in last.metadata
    assert last.tokens[-last.response_length:] == list(engine.outputs[1]) and last.reward == {"score": 1.0}
    [each] = run(go("each"))
    [earlier] = each.metadata["gateway_segments"]
    assert earlier["tokens"][earlier["prompt_len"]:] == list(engine.outputs[2])  # the first call of this run
    assert earlier["loss_mask"] == [1] * len(engine.outputs[2]) and earlier["reason"] is None

    # the trainer's rows: one per segment, sharing the group, index and reward (expand_segments)
    result = RolloutResult(0, [[trainer_sample(each)], [trainer_sample(last)]])
    rows = expand_segments(result)
    assert [len(g) for g in rows.groups] == [2, 1] and [len(g) for g in result.groups] == [1, 1]
    first, second = rows.groups[0]
    assert first.tokens == earlier["tokens"] and first.response_length == len(engine.outputs[2])
    assert first.loss_mask == earlier["loss_mask"] and first.rollout_log_probs == earlier["rollout_log_probs"]
    assert second.tokens == each.tokens and second.loss_mask == each.loss_mask
    assert first.reward == second.reward == each.reward and first.index == second.index == each.index
    assert [s.metadata["gateway_segment"] for s in (first, second)] == [
        {"index": 0, "of": 2, "reason": None}, {"index": 1, "of": 2}]
    assert "gateway_segments" not in first.metadata and rows.groups[1][0] is result.groups[1][0]
    assert [d["group_index"] for d in to_slime(rows)] == [0, 0, 1]
    tensors = verl_tensors(rows)
    assert tensors["non_tensors"]["uid"][0] == tensors["non_tensors"]["uid"][1]  # one GRPO group
    assert tensors["tensors"]["response_mask"][0].sum().item() == sum(earlier["loss_mask"])


class Hanging(HangingEngine):
    def __init__(self, model_dir):
        super().__init__()
        self.model_dir = str(model_dir)

    async def info(self):
        return {"tokenizer_path": self.model_dir}


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_timed_out_or_cancelled_episode_is_aborted_at_the_engine_and_classified(example, model_dir, how):
    engine = Hanging(model_dir)

    async def go():
        async with served() as gateway:
            work, samples = episode(example, gateway, engine, timeout_s=1.0 if how == "timeout" else 600.0)
            task = asyncio.ensure_future(work)
            await asyncio.wait_for(engine.started.wait(), 30)
            if how == "cancel":
                task.cancel()
            with pytest.raises(asyncio.CancelledError) if how == "cancel" else contextlib.nullcontext():
                await asyncio.wait_for(task, 60)
            assert len(gateway) == 0  # the episode was closed, its key ended
            return samples

    [s] = run(go())
    assert engine.aborted and not engine.running  # the call in flight was aborted at the engine
    if how == "timeout":
        assert s.status is Status.ABORTED and s.episode.abort.reason == "agent_timeout"


def test_an_agent_that_never_calls_the_model_aborts_saying_so(example, tok, model_dir):
    engine = recording(ScriptedEngine(tok, model_dir, []))

    async def lazy(client, task, sandbox):
        return "4"

    async def go():
        async with served() as gateway:
            work, samples = episode(example, gateway, engine, lazy)
            await work
            return samples

    [s] = run(go())
    assert s.status is Status.ABORTED and "made no model call" in s.episode.abort.error

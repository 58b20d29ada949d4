"""The gateway gives the model what the native agent gives it: an episode of the example agent
(examples/openai_agent, the OpenAI API only: its ``tools`` param and its messages as it writes them)
and one of the math env's native calculator agent (rayapp/envs/agents/multiturn.py ToolAgent), on the
same problem with the same scripted replies, send the engine the same prompt ids on every turn and
leave the same token data (ids, loss mask, log-probs). This is what lets the tiny model, pretrained on
the native format, call the calculator through the gateway as it does natively (docs/agents.md)."""

from pathlib import Path

import pytest
from agent_helpers import ScriptedEngine, ctx, recording
from conftest import run
from gateway_helpers import served

from rayapp.envs.agents.multiturn import ToolAgent
from rayapp.envs.math import generate_problems
from rayapp.gateway.agents import OpenAIAgent
from rayapp.types import Sample

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "openai_agent"


@pytest.fixture
def solve(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from openai_agent import agent

    return agent.solve


def script(task):
    expr = task.metadata["question"].removeprefix("What is ").removesuffix("?")
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'
    return [call, f"The answer is {task.label}."]


@pytest.mark.parametrize("index", [0, 2])  # two arithmetic problems of the demo's data
def test_a_gateway_episode_of_the_example_agent_is_token_for_token_the_native_one(solve, tok, model_dir, index):
    task = generate_problems(index + 1, seed=0)[index]
    assert task.metadata["kind"] == "arithmetic"
    sample = Sample(task.task_id, 0, task.prompt, task.label)

    native_engine = recording(ScriptedEngine(tok, model_dir, script(task)))
    native = run(ToolAgent(native_engine, None, tools=["calculator"]).run(sample, ctx(max_turns=2)))

    async def through_gateway():
        async with served() as gateway:
            engine = recording(ScriptedEngine(tok, model_dir, script(task)))
            agent = OpenAIAgent(gateway, engine, solve, None, call_timeout_s=60)
            return engine, await agent.run(sample, ctx(max_turns=2))

    engine, result = run(through_gateway())
    assert len(engine.sent) == len(native_engine.sent) == 2  # the call, then the answer after the result
    # the prompt (system turn with the tools, the problem) and, after the call, the observation (the
    # turn's end, the tool's result as a tool turn, the next assistant prompt): the same ids
    assert [r.input_ids for r in engine.sent] == [r.input_ids for r in native_engine.sent], \
        [tok.decode(r.input_ids, skip_special_tokens=False) for r in (engine.sent[0], native_engine.sent[0])]
    assert [r.sampling.stop for r in engine.sent] == [r.sampling.stop for r in native_engine.sent]
    assert result.tokens == native.tokens and result.response_length == native.response_length
    assert result.loss_mask == native.loss_mask and result.rollout_log_probs == native.rollout_log_probs
    assert result.response == native.response == f"The answer is {task.label}." and result.turns == native.turns == 2

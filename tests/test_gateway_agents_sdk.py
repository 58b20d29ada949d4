"""The OpenAI Agents SDK runs an agent with a function tool through the gateway, unmodified: only its
model client is pointed at the episode (``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` with the
episode's base URL and key). The engine is scripted (the tiny model writes no tool calls) and speaks
through the real tokenizer, so the tool is called: the tool runs, the agent's answer is the engine's
last reply, and the episode's one segment holds every call's engine ids at mask 1, exactly there."""

import asyncio

import pytest
from agent_helpers import ScriptedEngine, recording
from conftest import run
from gateway_helpers import episode_ctx, open_episode, served

agents = pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents, the test extra)")

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>'


def test_an_agents_sdk_agent_with_a_function_tool_runs_unmodified_and_its_calls_are_the_engines_tokens(tok, model_dir):
    ran = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        ran.append(expression)
        return "4"

    async def main():
        async with served() as gw:
            engine = recording(ScriptedEngine(tok, model_dir, [CALL, "The answer is 4."]))
            client, ctx = open_episode(gw, "agents-sdk", engine, tok, episode_ctx(max_new_tokens=64))
            agent = agents.Agent(name="calc", instructions="Use the calculator.", tools=[calculator],
                                 model=agents.OpenAIChatCompletionsModel(model="rayapp", openai_client=client))
            # tracing off: the SDK would otherwise upload its traces to OpenAI with the episode's key
            result = await agents.Runner.run(agent, "What is 2 + 2?",
                                             run_config=agents.RunConfig(tracing_disabled=True))
            return engine, result, ctx, await gw.close("agents-sdk")

    engine, result, ctx, log = run(asyncio.wait_for(main(), 120))
    assert ran == ["2 + 2"] and result.final_output == "The answer is 4."
    assert log.calls == 2 and ctx.record.turns == 2 and log.reasons == {} and len(log.segments) == 1
    seg = log.segments[0]
    # the tool's offer reached the engine, and the second call continued from the first's exact ids
    assert "calculator" in tok.decode(engine.sent[0].input_ids)
    assert engine.sent[1].input_ids[:len(engine.sent[0].input_ids) + len(engine.outputs[0])] == \
        [*engine.sent[0].input_ids, *engine.outputs[0]]
    assert "4" in tok.decode(engine.sent[1].input_ids[len(engine.sent[0].input_ids) + len(engine.outputs[0]):])
    # mask 1 exactly on the engine's ids of each call, in its span; everything else is the template's
    assert seg.ids[:seg.prompt_len] == engine.sent[0].input_ids
    response, mask = seg.ids[seg.prompt_len:], seg.mask
    assert len(response) == len(mask) == len(seg.logprobs)
    for (turn, start, end), sent, out, lps in zip(seg.turns, engine.sent, engine.outputs, engine.logprobs,
                                                  strict=True):
        assert seg.ids[start:end] == out and seg.ids[:start] == sent.input_ids, turn
        span = slice(start - seg.prompt_len, end - seg.prompt_len)
        assert mask[span] == [1] * len(out) and seg.logprobs[span] == pytest.approx(lps)
    assert sum(mask) == sum(len(out) for out in engine.outputs)

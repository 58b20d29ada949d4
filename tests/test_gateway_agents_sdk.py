"""The OpenAI Agents SDK runs an agent with a function tool through the gateway, unmodified: only its
model client is pointed at the episode (an ``AsyncOpenAI`` with the episode's base URL and key, under
``OpenAIChatCompletionsModel`` or the SDK's default, Responses, model: the gateway serves both, with
the same accounting; the docs' example runs here as written), and its tracing is off where gateway
agents run. The engine is scripted (the tiny model writes no tool calls) and speaks through the real
tokenizer, so the tool is called: the tool runs, the agent's answer is the engine's last reply, and the
episode's one segment holds every call's engine ids at mask 1, exactly there."""

import asyncio
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import openai
import pytest
from agent_helpers import ScriptedEngine, recording, sample
from agent_helpers import ctx as helper_ctx
from conftest import run
from gateway_helpers import episode_ctx, open_episode, served

from rayapp.gateway.agents import OpenAIAgent

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


def _docs_agent():
    """The Agents SDK example of docs/agents.md, run as the module it says it is."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "agents.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "async def solve(client" in b]
    assert len(blocks) == 1, "docs/agents.md has one Agents SDK example"
    module = types.ModuleType("calc_agent")
    exec(compile(blocks[0], "docs/agents.md", "exec"), module.__dict__)
    return module


def test_the_docs_agents_sdk_example_speaks_the_responses_api_with_the_chat_routes_accounting(tok, model_dir):
    """The docs' agent (the SDK's default, Responses, model) through ``OpenAIAgent``, and the same agent
    over ``OpenAIChatCompletionsModel``: the same prompts reach the engine and the samples hold the same
    tokens, mask and log-probs."""
    agents.set_tracing_disabled(True)  # this process may have read the SDK's switch before (the test below)

    async def episode(module):
        async with served() as gw:
            engine = recording(ScriptedEngine(tok, model_dir, [CALL, "The answer is 4."]))
            agent = OpenAIAgent(gw, engine, module.solve, lambda sample, result: {"score": 1.0})
            result = await agent.run(sample(), helper_ctx(max_turns=4))
            return result, engine, module.ran

    def calculator(module):
        module.ran = []
        real = module.calculator.on_invoke_tool

        async def counted(context, arguments):
            module.ran.append(json.loads(arguments)["expression"])
            return await real(context, arguments)

        module.calculator.on_invoke_tool = counted

    responses = _docs_agent()
    calculator(responses)
    chat = _docs_agent()
    calculator(chat)
    chat.OpenAIResponsesModel = agents.OpenAIChatCompletionsModel  # the one line that differs

    async def both():
        return await episode(responses), await episode(chat)

    (r_result, r_engine, r_ran), (c_result, c_engine, c_ran) = run(asyncio.wait_for(both(), 180))
    assert r_ran == c_ran == ["2 + 2"] and r_result.response == c_result.response == "The answer is 4."
    assert [s.input_ids for s in r_engine.sent] == [s.input_ids for s in c_engine.sent]
    assert "calculator" in tok.decode(r_engine.sent[0].input_ids)
    assert r_result.tokens == c_result.tokens and r_result.loss_mask == c_result.loss_mask
    assert r_result.rollout_log_probs == c_result.rollout_log_probs and r_result.turns == 2
    assert r_result.metadata["gateway"]["reasons"] == {} and r_result.metadata["gateway"]["segments"] == 1
    assert sum(r_result.loss_mask) == sum(len(out) for out in r_engine.outputs)


def test_the_responses_route_answers_usage_and_log_probs_and_refuses_what_it_cannot_do_by_name(tok, model_dir):
    async def main():
        async with served() as gw:
            engine = recording(ScriptedEngine(tok, model_dir, ["Four."]))
            c, _ = open_episode(gw, "responses", engine, tok, episode_ctx(max_new_tokens=64))
            first = await c.responses.create(model="m", instructions="Be brief.", input="What is 2 + 2?",
                                             include=["message.output_text.logprobs"])
            refused = {}
            for name, kw in {"stream": {"stream": True}, "previous_response_id": {"previous_response_id": "r"},
                             "input[0].content[0]": {"input": [{"role": "user", "content": [
                                 {"type": "input_image", "image_url": "http://x/y.png"}]}]},
                             "tools[0].type": {"tools": [{"type": "web_search"}]}}.items():
                with pytest.raises(openai.BadRequestError) as e:
                    await c.responses.create(**{"model": "m", "input": "x", **kw})
                refused[name] = e.value
            return first, engine, refused, await gw.close("responses")

    first, engine, refused, log = run(asyncio.wait_for(main(), 120))
    assert first.output_text == "Four." and first.status == "completed"
    assert first.usage.input_tokens == len(engine.sent[0].input_ids)
    assert first.usage.output_tokens == len(engine.outputs[0]) and "Be brief." in tok.decode(engine.sent[0].input_ids)
    lps = first.output[0].content[0].logprobs
    assert [lp.logprob for lp in lps] == pytest.approx(engine.logprobs[0])
    for name, e in refused.items():
        assert e.param == name, (name, e.param, e.message)
    assert log.calls == 1  # nothing refused reached the engine


def test_the_agents_sdks_tracing_is_off_where_gateway_agents_run_unless_the_user_set_it():
    code = ("import agents\nfrom rayapp.gateway.agents import OpenAIAgent\n"
            "OpenAIAgent(None, None, None, None)\nprint(type(agents.trace('episode')).__name__)")
    got = {}
    for name, value in (("default", None), ("user", "0")):
        env = {k: v for k, v in os.environ.items() if k != "OPENAI_AGENTS_DISABLE_TRACING"}
        if value is not None:
            env["OPENAI_AGENTS_DISABLE_TRACING"] = value
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        got[name] = done.stdout.split()[-1]
    assert got == {"default": "NoOpTrace", "user": "TraceImpl"}

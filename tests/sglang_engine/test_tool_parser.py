"""SGLang's own tool-call parser behind the gateway (``gateway.tool_parser: sglang:<name>``,
``rayapp.gateway.sglang_tools``), with the real sglang package of this lane: it reads the model's
Hermes-format calls as transformers' parser does, a full tool round trip through the real ``openai``
SDK comes back in OpenAI's shape, and an unknown parser name is one error naming the field."""

import asyncio
import json

import pytest
from agent_helpers import ScriptedEngine, recording
from gateway_helpers import CALC, client, episode_ctx, served

from rayapp.gateway.service import EpisodeBinding
from rayapp.gateway.sglang_tools import sglang_parser
from rayapp.gateway.tool_calls import parse_reply, tools_tokenizer
from rayapp.recipe import RecipeError, parse_recipe
from rayapp.recipe.wiring import build_evaluator_specs

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>'
CALL_NL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7 * 6"}}\n</tool_call>'


def calls(reply):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]


@pytest.mark.parametrize("text", [CALL, f"let me see {CALL}", CALL_NL, f"{CALL}{CALL_NL}", "The answer is 4.",
                                  "<tool_call>{not json</tool_call>"])
def test_sglangs_hermes_parser_reads_what_transformers_reads(tok, text):
    ours = parse_reply(tools_tokenizer(tok), text, "", [CALC])
    theirs = parse_reply(tok, text, "", [CALC], sglang_parser("hermes"))
    assert calls(theirs) == calls(ours)
    assert theirs.content == ours.content or (not theirs.content and not ours.content)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in theirs.tool_calls)


def test_qwen25s_parser_needs_the_newlines_its_format_has(tok):
    qwen = sglang_parser("qwen25")
    assert calls(parse_reply(tok, CALL_NL, "", [CALC], qwen)) == [("calculator", {"expression": "7 * 6"})]
    assert parse_reply(tok, "The answer is 4.", "", [CALC], qwen).tool_calls == []


def test_a_tool_round_trip_through_the_sdk_with_sglangs_parser(tok, model_dir):
    async def main():
        async with served() as gw:
            engine = recording(ScriptedEngine(tok, model_dir, [CALL, "The answer is 4."]))
            binding = EpisodeBinding("sg-tools", engine, tok, episode_ctx(max_new_tokens=64),
                                     tool_parser=sglang_parser("hermes"))
            c = client(*gw.open(binding))
            msgs = [{"role": "user", "content": "What is 2 + 2?"}]
            one = await c.chat.completions.create(model="m", messages=msgs, tools=[CALC])
            call = one.choices[0].message.tool_calls[0]
            msgs += [one.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "4"}]
            two = await c.chat.completions.create(model="m", messages=msgs, tools=[CALC])
            return one, two, await gw.close("sg-tools")

    one, two, log = asyncio.run(asyncio.wait_for(main(), 120))
    assert one.choices[0].finish_reason == "tool_calls" and one.choices[0].message.content is None
    fn = one.choices[0].message.tool_calls[0].function
    assert fn.name == "calculator" and json.loads(fn.arguments) == {"expression": "2 + 2"}
    assert two.choices[0].finish_reason == "stop" and two.choices[0].message.content == "The answer is 4."
    assert log.calls == 2 and len(log.segments) == 1 and log.reasons == {}  # one sequence: history extended


def recipe(tool_parser: str) -> dict:
    return {"engines": {"student": {}},
            "evaluators": [{"evaluator_id": "calc", "env": "math", "engine": "student",
                            "gateway": {"agent": "sg_tool_agent:solve", "tool_parser": tool_parser}}],
            "data": {"calc": {"env": "math", "n_prompts": 2}}}


async def nowhere(*args, **kwargs):
    raise AssertionError("building an agent ran no work")


def specs(tool_parser: str, tmp_path, monkeypatch):
    """The manager's build of a gateway evaluator whose recipe names ``tool_parser``."""
    (tmp_path / "sg_tool_agent.py").write_text("async def solve(client, task, sandbox):\n    return '42'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return build_evaluator_specs(parse_recipe(recipe(tool_parser)), {"student": object()}, executor=nowhere,
                                 open_sandbox=nowhere, gateway=object())


def test_the_manager_builds_a_gateway_agent_with_sglangs_parser(tmp_path, monkeypatch):
    (spec,) = specs("sglang:qwen25", tmp_path, monkeypatch)
    assert spec.handler.tool_parser is not None


def test_a_parser_sglang_lacks_is_one_error_naming_the_field(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match=r"no tool-call parser 'nope'.*'hermes'"):
        sglang_parser("nope")
    with pytest.raises(RecipeError) as e:
        specs("sglang:nope", tmp_path, monkeypatch)
    assert e.value.path == "$.evaluators[0].gateway.tool_parser" and "nope" in e.value.reason

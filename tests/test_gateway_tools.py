"""Tool calls through the gateway, driven by the real ``openai`` SDK: the model's Hermes-style text
becomes OpenAI ``tool_calls`` (transformers' response parser), tool results come back as ``tool``
messages, the tiny model renders tools through the gateway's template, and a template that drops
earlier reasoning (as Qwen3's does) gives counted segments, never a corrupted one. The engine is
scripted (the tiny model writes no tool calls) but speaks through the real tokenizer."""

import asyncio
import json

import openai
import pytest
from agent_helpers import ScriptedEngine, recording
from conftest import run
from gateway_helpers import CALC, episode_ctx, open_episode, served

from rayapp.gateway.accounting import SegmentReason
from rayapp.gateway.tool_calls import parse_reply, renders_tools, tools_tokenizer

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>'
# renders tools and tool calls, and (Qwen3's rule) drops the reasoning of assistant turns before the last user turn
QWENISH = (
    "{% set ns = namespace(query=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.query = loop.index0 %}{% endif %}{% endfor %}{{ bos_token }}"
    "{% if tools %}<|system|>{% for t in tools %}{{ t | tojson }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{% set c = m.content or '' %}"
    "{% if m.role == 'assistant' and loop.index0 < ns.query and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1] %}{% endif %}{{ c }}"
    "{% for t in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ t.function.name }}\", \"arguments\": "
    "{{ t.function.arguments }}}</tool_call>{% endfor %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def plain(messages):
    """Messages as the agent sent them (the SDK's message objects as it serialises them)."""
    return [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]


def test_the_tiny_template_gets_the_gateways_tools_template_and_parsing_uses_transformers(tok):
    assert not renders_tools(tok)
    rendering = tools_tokenizer(tok)
    assert rendering is not tok and rendering is tools_tokenizer(tok) and renders_tools(rendering)
    assert tok.chat_template != rendering.chat_template  # the shipped tokenizer is left as it is
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "hello"}]
    assert rendering.apply_chat_template(convo, tokenize=False) == tok.apply_chat_template(convo, tokenize=False)
    reply = parse_reply(rendering, f"let me see {CALL}", "", [CALC])
    assert reply.content == "let me see" and len(reply.tool_calls) == 1
    call = reply.tool_calls[0]
    assert call["id"].startswith("call_") and call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "2 + 2"}
    assert parse_reply(rendering, "<tool_call>{not json</tool_call>", "", [CALC]).message() == {
        "role": "assistant", "content": "<tool_call>{not json</tool_call>"}  # stays text: the agent sees it
    assert parse_reply(rendering, CALL, "", None).tool_calls == []  # no tools offered: nothing parsed


def test_a_tool_round_trip_through_the_sdk_streamed_and_not(tok, model_dir):
    async def main():
        async with served() as gw:
            engine = recording(ScriptedEngine(tok, model_dir, [CALL, "The answer is 4.", CALL]))
            c, _ = open_episode(gw, "tools", engine, tok, episode_ctx(max_new_tokens=64))
            msgs = [{"role": "user", "content": "What is 2 + 2?"}]
            one = await c.chat.completions.create(model="m", messages=msgs, tools=[CALC])
            call = one.choices[0].message.tool_calls[0]
            msgs += [one.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "4"}]
            two = await c.chat.completions.create(model="m", messages=msgs, tools=[CALC])
            msgs += [two.choices[0].message, {"role": "user", "content": "And again?"}]
            deltas, finish = [], None
            async for chunk in await c.chat.completions.create(model="m", messages=msgs, tools=[CALC], stream=True):
                for choice in chunk.choices:
                    deltas += choice.delta.tool_calls or []
                    finish = choice.finish_reason or finish
            return engine, one, two, deltas, finish, msgs, await gw.close("tools")

    engine, one, two, deltas, finish, msgs, log = run(asyncio.wait_for(main(), 120))
    choice = one.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2 + 2"}
    assert two.choices[0].finish_reason == "stop" and two.choices[0].message.content == "The answer is 4."
    assert finish == "tool_calls" and len(deltas) == 1 and deltas[0].id.startswith("call_") and deltas[0].id != call.id
    assert deltas[0].function.name == "calculator"
    assert json.loads(deltas[0].function.arguments) == {"expression": "2 + 2"}
    # one segment, and it is the template's rendering of the conversation: tools in the system turn, the
    # call as the model wrote it (its end-of-turn token added at mask 0), the tool's result as a tool turn
    assert log.reasons == {} and len(log.segments) == 1 and log.calls == 3
    seg = log.segments[0]
    rendering = tools_tokenizer(tok)
    convo = [*plain(msgs), {"role": "assistant", "content": "", "tool_calls": [d.model_dump() for d in deltas]}]
    for d in convo[-1]["tool_calls"]:
        d.pop("index")
    assert tok.decode(seg.ids, skip_special_tokens=False) == \
        rendering.apply_chat_template(convo, tools=[CALC], tokenize=False).removesuffix(tok.eos_token)
    assert "calculator" in tok.decode(engine.sent[0].input_ids) and "</tool_call>" in engine.sent[0].sampling.stop
    assert [i for i, m in zip(seg.ids[seg.prompt_len:], seg.mask, strict=True) if m] == \
        [i for out in engine.outputs for i in out]


def test_tool_choice_none_renders_and_parses_no_tools_and_forcing_a_call_is_refused_by_name(tok, model_dir):
    async def main():
        async with served() as gw:
            engine = recording(ScriptedEngine(tok, model_dir, [CALL]))
            c, _ = open_episode(gw, "choice", engine, tok, episode_ctx(max_new_tokens=64))
            msgs = [{"role": "user", "content": "2 + 2?"}]
            none = await c.chat.completions.create(model="m", messages=msgs, tools=[CALC], tool_choice="none")
            refused = []
            for choice in ("required", {"type": "function", "function": {"name": "calculator"}}):
                with pytest.raises(openai.BadRequestError) as e:
                    await c.chat.completions.create(model="m", messages=msgs, tools=[CALC], tool_choice=choice)
                refused.append(e.value)
            await gw.close("choice")
            return engine, none, refused

    engine, none, refused = run(asyncio.wait_for(main(), 120))
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == CALL
    assert none.choices[0].finish_reason == "stop"
    assert "calculator" not in tok.decode(engine.sent[0].input_ids) and "</tool_call>" not in (
        engine.sent[0].sampling.stop or [])
    assert len(engine.sent) == 1  # the refused calls never reached the engine
    for e in refused:
        assert e.status_code == 400 and e.param == "tool_choice" and e.code == "unsupported_parameter"


def test_a_template_that_drops_earlier_reasoning_gives_counted_segments_and_no_corrupted_sample(tok, model_dir):
    qwenish = tok.__class__.from_pretrained(str(model_dir))
    qwenish.chat_template = QWENISH
    assert renders_tools(qwenish) and tools_tokenizer(qwenish) is qwenish  # its own template is used
    script = [f"<think>use the tool</think>{CALL}", "<think>the tool said 4</think>4",
              "<think>double it</think>8", "<think>halve it</think>4"]

    async def main():
        async with served() as gw:
            engine = recording(ScriptedEngine(tok, model_dir, script))
            c, _ = open_episode(gw, "reasoning", engine, qwenish, episode_ctx(max_new_tokens=64))
            msgs, sent = [{"role": "user", "content": "What is 2 + 2?"}], []

            async def ask():
                sent.append(plain(msgs))
                r = await c.chat.completions.create(model="m", messages=msgs, tools=[CALC])
                msgs.append(r.choices[0].message)
                return r

            one = await ask()
            msgs.append({"role": "tool", "tool_call_id": one.choices[0].message.tool_calls[0].id, "content": "4"})
            await ask()  # the first reasoning is still rendered: the recording extends
            msgs.append({"role": "user", "content": "Doubled?"})
            await ask()  # now earlier reasoning is dropped: the template rewrote the history
            msgs.append({"role": "user", "content": "Halved?"})
            await ask()
            return engine, sent, await gw.close("reasoning")

    engine, sent, log = run(asyncio.wait_for(main(), 120))
    assert log.reasons == {SegmentReason.TEMPLATE_REWRITE: 2} and log.calls == 4
    assert [s.reason for s in log.segments] == [None, SegmentReason.TEMPLATE_REWRITE, SegmentReason.TEMPLATE_REWRITE]
    assert [[c for c, _, _ in s.turns] for s in log.segments] == [[0, 1], [2], [3]]
    for seg in log.segments:
        # no corrupted sample: each call's context is the template's rendering of its own request, and
        # mask 1 is exactly the engine's ids
        for c, start, end in seg.turns:
            assert seg.ids[:start] == engine.sent[c].input_ids and seg.ids[start:end] == engine.outputs[c]
            assert tok.decode(seg.ids[:start], skip_special_tokens=False) == qwenish.apply_chat_template(
                sent[c], tools=[CALC], add_generation_prompt=True, tokenize=False)
        trained = [i for i, m in zip(seg.ids[seg.prompt_len:], seg.mask, strict=True) if m]
        assert trained == [i for c, _, _ in seg.turns for i in engine.outputs[c]]


def test_a_stop_string_of_the_request_ends_the_reply_before_it_and_its_tokens_stay_recorded(tok, model_dir):
    async def main():
        async with served() as gw:
            engine = recording(ScriptedEngine(tok, model_dir, ["The answer is 4. Done."]))
            c, _ = open_episode(gw, "stop", engine, tok, episode_ctx(max_new_tokens=64, stop=["Done"]))
            r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}], stop="4")
            return engine, r, await gw.close("stop")

    engine, r, log = run(asyncio.wait_for(main(), 120))
    assert engine.sent[0].sampling.stop == ["Done", "4"]  # the episode's stop strings stay, the request's join
    assert r.choices[0].message.content == "The answer is " and r.choices[0].finish_reason == "stop"
    seg = log.segments[0]
    assert seg.ids[seg.prompt_len:] == engine.outputs[0]  # the stop string's tokens are the engine's: recorded
    assert tok.decode(engine.outputs[0]).endswith("4")


# a template that writes the reasoning it is given, and a response template of its own that reads it back
REASONING = (
    "{{ bos_token }}{% if tools %}<|system|>{% for t in tools %}{{ t | tojson }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}{{ m.content or '' }}{% for t in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ t.function.name }}\", "
    "\"arguments\": {{ t.function.arguments }}}</tool_call>{% endfor %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
OWN = {"start_anchor": "<|assistant|>", "fields": {
    "reasoning_content": {"open": "<think>", "close": "</think>"},
    "content": {"content": "text", "content_args": {"strip": False}, "repeats": True, "join": ""},
    "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                   "transform": {"type": "function", "function": {"name": "{content.name}",
                                                                  "arguments": "{content.arguments}"}}}}}


def test_a_tokenizer_with_its_own_response_template_is_parsed_with_it(tok, model_dir):
    own = tok.__class__.from_pretrained(str(model_dir))
    own.chat_template, own.response_template = REASONING, OWN

    async def main():
        async with served() as gw:
            engine = recording(ScriptedEngine(tok, model_dir, [f"<think>use the tool</think>{CALL}", "4"]))
            c, _ = open_episode(gw, "own", engine, own, episode_ctx(max_new_tokens=64))
            msgs = [{"role": "user", "content": "2 + 2?"}]
            one = await c.chat.completions.create(model="m", messages=msgs, tools=[CALC])
            reply = one.choices[0].message
            # an agent need not send the reasoning back: the recorded reply stands for it
            msgs += [{"role": "assistant", "content": reply.content, "tool_calls": [
                t.model_dump() for t in reply.tool_calls]}, {"role": "tool", "tool_call_id": "x", "content": "4"}]
            await c.chat.completions.create(model="m", messages=msgs, tools=[CALC])
            return one, await gw.close("own")

    one, log = run(asyncio.wait_for(main(), 120))
    message = one.choices[0].message
    assert message.model_extra["reasoning_content"] == "use the tool" and message.content is None
    assert message.tool_calls[0].function.name == "calculator" and one.choices[0].finish_reason == "tool_calls"
    assert log.reasons == {} and len(log.segments) == 1  # the history extended, reasoning and all

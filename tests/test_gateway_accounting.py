"""The gateway's token accounting: every token of a segment is an engine id (mask 1, its log-prob) or
the chat template's rendering (mask 0), and every place the history cannot be extended is a counted
new segment. The engine is faked (a reply's ids and chosen log-probs): the accounting is under test."""

import copy
import json
from pathlib import Path

import pytest

from rayapp.gateway.accounting import Conversation, SegmentReason
from rayapp.gateway.openai_api import ApiError, parse_chat
from rayapp.inference.tiny_model import load_tokenizer

TINY = Path(__file__).resolve().parents[1] / "rayapp" / "inference" / "tiny-llama-v1"
CALC = [{"type": "function", "function": {
    "name": "calc", "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]

# ChatML-like: a newline after the end-of-turn token, which the engine never generates (it stops there)
NEWLINE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# the reasoning of every assistant message but the last is dropped from the history
DROPS_REASONING = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.role == 'assistant' and loop.index0 != ns.last and '</think>' in m.content %}"
    "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Qwen3's rule: the reasoning of assistant messages before the last user message is dropped
DROPS_REASONING_BEFORE_QUERY = (
    "{% set ns = namespace(query=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.query = loop.index0 %}{% endif %}{% endfor %}{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.role == 'assistant' and loop.index0 < ns.query and '</think>' in m.content %}"
    "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tiny():
    return load_tokenizer(TINY)


def with_template(tok, template):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


class FakeEngine:
    """A reply's ids (its text tokenized, then eos unless it stopped at a stop string) with
    log-probs no tokenizer could produce, and every call's prompt as the engine received it."""

    def __init__(self, tok):
        self.tok, self.outputs, self.prompts, self.n = tok, [], [], 0

    def __call__(self, prompt_ids, reply, eos=True, by_char=False):
        # by_char: ids that are not the tokenizer's own tokenisation of the text (as sampled ids may be)
        pieces = list(reply) if by_char else [reply]
        ids = [t for p in pieces for t in self.tok.encode(p, add_special_tokens=False)]
        ids += [self.tok.eos_token_id] if eos else []
        lps = [-(self.n * 100 + i + 1) / 1000 for i in range(len(ids))]
        self.n += 1
        self.prompts.append(list(prompt_ids))
        self.outputs.append((ids, lps))
        return ids, lps


def turn(convo, engine, messages, reply, tools=None, eos=True, tool_calls=None):
    """One chat call: plan, generate, record; the assistant message the agent gets back (appended)."""
    call = convo.prepare(messages, tools)
    ids, lps = engine(call.ids, reply, eos)
    msg = {"role": "assistant", "content": reply, **({"tool_calls": tool_calls} if tool_calls else {})}
    convo.record(call, ids, lps, msg)
    messages.append(msg)
    return call


def tool_episode(convo, engine, tools=CALC):
    """user -> assistant (tool call) -> tool -> assistant -> user -> assistant."""
    msgs = [{"role": "user", "content": "what is 12+30?"}]
    turn(convo, engine, msgs, "let me compute", tools, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "12+30"}'}}])
    msgs.append({"role": "tool", "tool_call_id": "call_1", "content": "42"})
    turn(convo, engine, msgs, "it is 42", tools)
    msgs.append({"role": "user", "content": "and doubled?"})
    turn(convo, engine, msgs, "84", tools)
    return msgs


def engine_tokens(seg):
    return [t for t, m in zip(seg.ids[seg.prompt_len:], seg.mask, strict=True) if m == 1], \
           [lp for lp, m in zip(seg.logprobs, seg.mask, strict=True) if m == 1]


def assert_engine_exact(seg, outputs):
    """Mask 1 is exactly the engine's ids, in order, with its log-probs; template tokens carry 0.0."""
    ids, lps = engine_tokens(seg)
    assert ids == [t for out, _ in outputs for t in out]
    assert lps == [lp for _, out in outputs for lp in out]
    assert len(seg.mask) == len(seg.logprobs) == len(seg.ids) - seg.prompt_len
    assert all(lp == 0.0 for lp, m in zip(seg.logprobs, seg.mask, strict=True) if m == 0)
    for (_, start, end), (out, _) in zip(seg.turns, outputs, strict=True):
        assert seg.ids[start:end] == out and set(seg.mask[start - seg.prompt_len:end - seg.prompt_len]) == {1}


@pytest.mark.parametrize(("template", "after_eos"), [(None, ""), (NEWLINE, "\n")], ids=["tiny", "newline-after-eos"])
def test_a_tool_episode_is_one_segment_of_engine_ids_and_template_tokens(tiny, template, after_eos):
    tok = with_template(tiny, template) if template else tiny
    convo, engine = Conversation(tok), FakeEngine(tok)
    msgs = tool_episode(convo, engine)

    assert len(convo.segments) == 1 and not convo.reasons
    seg = convo.segments[0]
    assert_engine_exact(seg, engine.outputs)
    # the whole segment is the template's rendering of the conversation, separators included, up to
    # the engine's last end-of-turn token (what the template puts after it belongs to no turn yet)
    text = tok.apply_chat_template(msgs, tools=CALC, tokenize=False)
    assert tok.decode(seg.ids, skip_special_tokens=False) + after_eos == text
    assert seg.ids == tok.encode(text.removesuffix(after_eos), add_special_tokens=False)
    # and each call's prompt was the recording so far: the engine went on from its exact ids
    for (_, start, _), prompt in zip(seg.turns, engine.prompts, strict=True):
        assert seg.ids[:start] == prompt


def test_the_newline_after_a_generated_end_of_turn_is_a_template_token(tiny):
    tok = with_template(tiny, NEWLINE)
    convo, engine = Conversation(tok), FakeEngine(tok)
    msgs = [{"role": "user", "content": "hi"}]
    turn(convo, engine, msgs, "hello")
    msgs.append({"role": "user", "content": "again"})
    call = convo.prepare(msgs)
    newline = tok.encode("\n", add_special_tokens=False)
    assert engine.outputs[0][0][-1] == tok.eos_token_id  # the engine stopped at its end-of-turn token
    assert call.added[:len(newline)] == newline and not call.fresh
    assert tok.decode(call.ids, skip_special_tokens=False) == tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False)


@pytest.mark.parametrize(("template", "after_eos"), [(None, ""), (NEWLINE, "\n")], ids=["tiny", "newline-after-eos"])
def test_a_stop_string_stop_gets_the_end_of_turn_token_at_mask_0(tiny, template, after_eos):
    tok = with_template(tiny, template) if template else tiny
    convo, engine = Conversation(tok), FakeEngine(tok)
    msgs = [{"role": "user", "content": "hi"}]
    turn(convo, engine, msgs, "hello", eos=False)  # stopped at a stop string: no eos generated
    msgs.append({"role": "user", "content": "again"})
    call = convo.prepare(msgs)
    assert call.added[0] == tok.eos_token_id
    turn(convo, engine, msgs, "ok")
    seg = convo.segments[0]
    eos_at = len(engine.prompts[0]) + len(engine.outputs[0][0])
    assert seg.ids[eos_at] == tok.eos_token_id and seg.mask[eos_at - seg.prompt_len] == 0
    assert_engine_exact(seg, engine.outputs)
    assert tok.decode(seg.ids, skip_special_tokens=False) + after_eos == tok.apply_chat_template(msgs, tokenize=False)


@pytest.mark.parametrize("template", [DROPS_REASONING, DROPS_REASONING_BEFORE_QUERY],
                         ids=["all-but-last-assistant", "before-last-user"])
def test_a_template_that_drops_earlier_reasoning_starts_counted_self_consistent_segments(tiny, template):
    tok = with_template(tiny, template)
    convo, engine = Conversation(tok), FakeEngine(tok)
    msgs = [{"role": "user", "content": "what is 12+30?"}]
    requests = []

    def call(reply):
        requests.append([dict(m) for m in msgs])
        turn(convo, engine, msgs, reply)

    call("<think>add them</think>calc 12+30")
    msgs.append({"role": "tool", "tool_call_id": "c1", "content": "42"})
    call("<think>the tool said 42</think>42")  # the first reasoning is still kept: extends
    msgs.append({"role": "user", "content": "doubled?"})
    call("<think>42*2</think>84")  # now earlier reasoning is dropped: a rewrite
    msgs.append({"role": "user", "content": "halved?"})
    call("<think>84/2</think>42")

    assert convo.reasons == {SegmentReason.TEMPLATE_REWRITE: 2}
    assert [s.reason for s in convo.segments] == [None, SegmentReason.TEMPLATE_REWRITE,
                                                  SegmentReason.TEMPLATE_REWRITE]
    assert [[c for c, _, _ in s.turns] for s in convo.segments] == [[0, 1], [2], [3]]
    outputs = iter(engine.outputs)
    for seg in convo.segments:
        assert_engine_exact(seg, [next(outputs) for _ in seg.turns])
        # no corrupted sample: every reply's context is the template's rendering of its own request
        for c, start, _ in seg.turns:
            want = tok.apply_chat_template(requests[c], add_generation_prompt=True, tokenize=False)
            assert tok.decode(seg.ids[:start], skip_special_tokens=False) == want
            assert seg.ids[:start] == engine.prompts[c]


def test_the_engine_ids_are_kept_as_generated_never_retokenised(tiny):
    convo, engine = Conversation(tiny), FakeEngine(tiny)
    msgs = [{"role": "user", "content": "12+30?"}]
    for reply in ("computing the sum", "the answer is 42"):
        call = convo.prepare(msgs)
        ids, lps = engine(call.ids, reply, by_char=True)
        assert ids != tiny.encode(tiny.decode(ids, skip_special_tokens=False), add_special_tokens=False)
        convo.record(call, ids, lps, {"role": "assistant", "content": reply})
        msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    seg, = convo.segments
    assert_engine_exact(seg, engine.outputs)
    assert tiny.decode(seg.ids, skip_special_tokens=False) == tiny.apply_chat_template(msgs[:-1], tokenize=False)


def test_an_edited_history_starts_a_counted_segment_from_the_request(tiny):
    convo, engine = Conversation(tiny), FakeEngine(tiny)
    msgs = tool_episode(convo, engine)
    summarised = [{"role": "user", "content": "12+30 is 42; doubled?"}, msgs[-1], {"role": "user", "content": "so?"}]
    call = convo.prepare(summarised, CALC)
    assert call.fresh and call.reason == SegmentReason.HISTORY_EDITED
    assert call.ids == tiny.encode(tiny.apply_chat_template(summarised, add_generation_prompt=True, tokenize=False),
                                   add_special_tokens=False)
    edited = [dict(m) for m in msgs] + [{"role": "user", "content": "so?"}]
    edited[1]["content"] = "I will compute"  # the agent rewrote what the model said
    assert convo.prepare(edited, CALC).reason == SegmentReason.HISTORY_EDITED
    assert not convo.reasons  # planned, never recorded: nothing counted

    turn(convo, engine, summarised, "84", CALC)
    assert convo.reasons == {SegmentReason.HISTORY_EDITED: 1} and len(convo.segments) == 2
    first, second = convo.segments
    assert_engine_exact(first, engine.outputs[:3])  # closed as it was
    assert_engine_exact(second, engine.outputs[3:])
    assert second.prompt_len == len(call.ids) and second.ids[:second.prompt_len] == call.ids


def test_resent_tool_calls_and_tools_in_another_json_spelling_still_extend(tiny):
    convo, engine = Conversation(tiny), FakeEngine(tiny)
    msgs = [{"role": "user", "content": "12+30?"}]
    turn(convo, engine, msgs, "computing", CALC, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "12+30"}'}}])
    msgs[-1] = {"role": "assistant", "content": "computing", "tool_calls": [  # the arguments re-serialised
        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr":"12+30"}'}}]}
    msgs.append({"role": "tool", "tool_call_id": "call_1", "content": "42"})
    reordered = [{"function": {"parameters": {"properties": {"expr": {"type": "string"}}, "type": "object"},
                               "name": "calc"}, "type": "function"}]
    assert not convo.prepare(msgs, reordered).fresh
    # the typed request body the gateway parses is taken as well as plain dicts
    req = parse_chat(json.dumps({"messages": msgs, "tools": reordered}).encode())
    assert not convo.prepare(req.messages, req.tools).fresh


def test_reasoning_the_agent_does_not_send_back_is_not_an_edit(tiny):
    # OpenAI's API takes no reasoning back: the recorded reply (what the engine generated) stands for it
    tok = with_template(tiny, "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{% if m.reasoning_content %}"
                              "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}{{ eos_token }}"
                              "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    convo, engine = Conversation(tok), FakeEngine(tok)
    msgs = [{"role": "user", "content": "12+30?"}]
    call = convo.prepare(msgs)
    convo.record(call, *engine(call.ids, "<think>add</think>42"),
                 {"role": "assistant", "content": "42", "reasoning_content": "add"})
    msgs += [{"role": "assistant", "content": "42"}, {"role": "user", "content": "doubled?"}]
    call = convo.prepare(msgs)
    assert not call.fresh
    assert tok.decode(call.ids, skip_special_tokens=False) == tok.apply_chat_template(
        [msgs[0], {"role": "assistant", "content": "42", "reasoning_content": "add"}, msgs[2]],
        add_generation_prompt=True, tokenize=False)


def test_changed_tools_start_a_counted_segment(tiny):
    convo, engine = Conversation(tiny), FakeEngine(tiny)
    msgs = [{"role": "user", "content": "12+30?"}]
    turn(convo, engine, msgs, "42", CALC)
    msgs.append({"role": "user", "content": "and now?"})
    for tools in (None, [*CALC, {"type": "function", "function": {"name": "search"}}]):
        assert convo.prepare(msgs, tools).reason == SegmentReason.TOOLS_CHANGED
    turn(convo, engine, msgs, "84", None)
    assert convo.reasons == {SegmentReason.TOOLS_CHANGED: 1}
    assert [s.reason for s in convo.segments] == [None, SegmentReason.TOOLS_CHANGED]


def test_two_calls_planned_on_one_state_never_splice_into_one_sequence(tiny):
    convo, engine = Conversation(tiny), FakeEngine(tiny)
    msgs = [{"role": "user", "content": "hi"}]
    turn(convo, engine, msgs, "hello")
    a = convo.prepare([*msgs, {"role": "user", "content": "a?"}])
    b = convo.prepare([*msgs, {"role": "user", "content": "b?"}])
    convo.record(a, *engine(a.ids, "A"), {"role": "assistant", "content": "A"})
    convo.record(b, *engine(b.ids, "B"), {"role": "assistant", "content": "B"})
    assert convo.reasons == {SegmentReason.CONCURRENT: 1}
    first, second = convo.segments
    assert_engine_exact(first, engine.outputs[:2])
    assert second.ids[:second.prompt_len] == b.ids and engine_tokens(second)[0] == engine.outputs[2][0]


def test_bad_input_is_one_clear_error(tiny):
    convo = Conversation(tiny)
    call = convo.prepare([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="3 output ids but 2 log-probs"):
        convo.record(call, [5, 6, 7], [-0.1, -0.2], {"role": "assistant", "content": "x"})
    with pytest.raises(ApiError, match=r"messages\[1\]"):
        convo.prepare([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
    with pytest.raises(ApiError, match="chat template refused") as e:  # the tiny template knows no developer
        convo.prepare([{"role": "developer", "content": "be brief"}])
    assert e.value.status == 400
    assert not convo.segments


@pytest.mark.parametrize(("template", "after_eos"), [(None, ""), (NEWLINE, "\n")], ids=["tiny", "newline-after-eos"])
@pytest.mark.parametrize("eos", [True, False], ids=["eos", "stop-string"])
def test_the_native_agents_observation_tokens_close_the_turn_as_the_template_does(tiny, template, after_eos, eos):
    """ToolAgent and GymAgent append an environment turn the same way: the whole sequence decodes to the
    template's rendering of the conversation (a ChatML newline after the end-of-turn included)."""
    from rayapp.envs.agents.observation import observation_tokens

    tok = with_template(tiny, template) if template else tiny
    user = [{"role": "user", "content": "2+2?"}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    turn = tok.encode("calc(2+2)", add_special_tokens=False) + ([tok.eos_token_id] if eos else [])
    tool = [{"role": "tool", "content": "4"}]
    env, cut = observation_tokens(tok, tool, turn, None)
    want = tok.apply_chat_template([*user, {"role": "assistant", "content": "calc(2+2)"}, *tool],
                                   add_generation_prompt=True, tokenize=False)
    assert not cut and tok.decode(list(prompt) + turn + env, skip_special_tokens=False) == want
    closing = ("" if eos else tok.eos_token) + after_eos
    assert tok.decode(env, skip_special_tokens=False).startswith(closing + "<|tool|>")

"""The agent gateway's door: OpenAI request bodies typed or refused by name, OpenAI's error shape,
and one key per episode (401 wrong key, 404 unknown, 410 ended)."""

import json

import pytest

from rayapp.gateway.episodes import EpisodeKeys
from rayapp.gateway.openai_api import ApiError, parse_chat, parse_completion


def body(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def refused(parse, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(raw)
    return e.value


def test_a_chat_request_as_the_openai_sdk_sends_it_is_typed():
    req = parse_chat(body(model="policy", temperature=0.7, top_p=0.9, max_completion_tokens=64, stop="\n",
                          seed=3, logprobs=True, stream=True, stream_options={"include_usage": True},
                          tools=[{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}],
                          tool_choice="auto", messages=[
                              {"role": "system", "content": "be brief"},
                              {"role": "user", "content": [{"type": "text", "text": "2+"},
                                                           {"type": "text", "text": "2"}]},
                              {"role": "assistant", "content": None, "tool_calls": [
                                  {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]},
                              {"role": "tool", "tool_call_id": "c1", "content": "4"}]))
    assert req.messages[1].text() == "2+2" and req.messages[2].tool_calls[0].function.name == "calc"
    assert req.budget() == 64 and req.stream and req.stream_options.include_usage
    params = req.sampling(req.budget())
    got = (params.temperature, params.top_p, params.max_new_tokens, params.stop, params.seed)
    assert got == (0.7, 0.9, 64, ["\n"], 3)


@pytest.mark.parametrize(("fields", "name"), [
    ({"n": 2}, "n"), ({"logit_bias": {"50256": -100}}, "logit_bias"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"top_logprobs": 5}, "top_logprobs"),
])
def test_an_option_the_gateway_cannot_honour_is_refused_by_name(fields, name):
    e = refused(parse_chat, body(**fields))
    assert e.status == 400 and e.param == name and name in e.message and e.code == "unsupported_parameter"
    assert e.body() == {"error": {"message": e.message, "type": "invalid_request_error", "param": name,
                                  "code": "unsupported_parameter"}}


def test_no_op_values_of_those_options_pass():
    parse_chat(body(n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"}))


@pytest.mark.parametrize(("raw", "where"), [
    (b"", None), (b"{", None), (b"[]", None),
    (body(messages=[]), "messages"), (body(temperature=3), "temperature"), (body(max_tokens=0), "max_tokens"),
    (body(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    (body(unknown_field=1), None), (body(max_tokens=8, max_completion_tokens=9), "max_tokens"),
    (body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.content[0]"),
    (body(messages=[{"role": "tool", "content": "4"}]), "messages[0].tool_call_id"),
])
def test_a_malformed_body_is_one_400_naming_where(raw, where):
    e = refused(parse_chat, raw)
    assert e.status == 400 and e.body()["error"]["type"] == "invalid_request_error"
    if where is not None:
        assert e.param == where, e.message


def test_completions_take_text_or_token_ids_and_refuse_what_they_cannot_do():
    assert parse_completion(json.dumps({"prompt": "2+2=", "max_tokens": 4}).encode()).prompt == "2+2="
    assert parse_completion(json.dumps({"prompt": [1, 2, 3]}).encode()).prompt == [1, 2, 3]
    for fields, name in (({"echo": True}, "echo"), ({"best_of": 3}, "best_of"), ({"logprobs": 2}, "logprobs")):
        assert refused(parse_completion, json.dumps({"prompt": "x", **fields}).encode()).param == name


def test_each_episode_has_its_own_key_and_ended_episodes_answer_410():
    keys = EpisodeKeys(ended_kept=2)
    a, b = keys.open("r0-t1-0"), keys.open("r0-t1-1")
    assert a != b and len(a) >= 40
    keys.check("r0-t1-0", f"Bearer {a}")
    for header in (None, "", f"Bearer {b}", a[:-1], "Bearer " + a + "x"):
        with pytest.raises(ApiError) as e:
            keys.check("r0-t1-0", header)  # another episode's key reads nothing of this one
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(ApiError) as e:
        keys.check("r9-none-0", f"Bearer {a}")
    assert e.value.status == 404
    keys.close("r0-t1-0")
    with pytest.raises(ApiError) as e:
        keys.check("r0-t1-0", f"Bearer {a}")
    assert e.value.status == 410 and len(keys) == 1
    with pytest.raises(ValueError, match="already in use or has ended"):
        keys.open("r0-t1-0")  # an id is never reused: a late call of the old episode cannot land in a new one
    for bad in ("", "a/b", "x" * 300, None):
        with pytest.raises(ValueError):
            keys.open(bad)
    keys.close("r0-t1-1")
    keys.open("e3")
    keys.close("e3")  # past ended_kept: the oldest ended id is forgotten (404, not 410)
    with pytest.raises(ApiError) as e:
        keys.check("r0-t1-0", f"Bearer {a}")
    assert e.value.status == 404

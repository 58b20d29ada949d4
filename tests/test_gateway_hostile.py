"""The gateway under hostile or careless input: the key is checked before a body is read, a body is
read only up to what the episode's context could hold, a large body's decoding, templating and
tokenizing leave the event loop free for other calls, a budget's refusal ends the episode (410
after it), and an engine's refusal reaches the agent as one plain line, not a Ray traceback."""

import asyncio
import json
import os
import traceback

import openai
import pytest
import ray.exceptions
from conftest import run
from gateway_helpers import EchoEngine, episode_ctx, open_episode, served
from starlette.requests import Request

from rayapp.gateway.routes import gateway_response
from rayapp.gateway.service import EpisodeBinding, Gateway
from rayapp.inference.client import validate_request
from rayapp.record import TerminationReason

MB = 1 << 20


def _request(episode, key, chunks, size=MB, declared=True):
    """A Starlette request whose body is ``chunks`` parts of ``size`` bytes, counting the parts read."""
    read = []
    headers = [(b"authorization", f"Bearer {key}".encode())]
    if declared:
        headers.append((b"content-length", str(chunks * size).encode()))

    async def receive():
        read.append(size)
        return {"type": "http.request", "body": b"x" * size, "more_body": len(read) < chunks}

    scope = {"type": "http", "method": "POST", "path": f"/gateway/{episode}/v1/chat/completions",
             "headers": headers, "query_string": b""}
    return Request(scope, receive), read


def test_the_key_is_checked_and_the_body_bounded_by_the_context_before_the_body_is_read(tok):
    async def main():
        gw = Gateway("http://127.0.0.1:1/rayapp/gateway")
        _, key = gw.open(EpisodeBinding("small", EchoEngine(tok), tok, episode_ctx(max_context_len=1024)))
        got = {}
        for name, k, declared in (("no key", "wrong", True), ("declared", key, True), ("chunked", key, False)):
            request, read = _request("small", k, 30, declared=declared)
            response = await gateway_response(gw, "small", "chat/completions", request)
            got[name] = response.status_code, json.loads(response.body)["error"], len(read)
        return got

    got = run(asyncio.wait_for(main(), 60))
    status, error, read = got["no key"]
    assert status == 401 and error["code"] == "invalid_api_key" and read == 0  # nothing read, 30 MB sent
    status, error, read = got["declared"]  # its Content-Length says 30 MB: refused unread
    assert status == 413 and error["code"] == "request_too_large" and "max_context_len" in error["message"]
    assert read == 0
    status, error, read = got["chunked"]  # no length given: read up to the bound (1 MiB for 1,024 tokens)
    assert status == 413 and read == 2


def test_a_large_body_is_tokenized_off_the_event_loop_while_other_calls_are_answered(tok):
    async def main():
        async with served() as gw:
            big_engine, small_engine = EchoEngine(tok), EchoEngine(tok)
            big, _ = open_episode(gw, "big", big_engine, tok, episode_ctx(max_context_len=10**6))
            small, _ = open_episode(gw, "small", small_engine, tok)
            text = "the answer is 42 and the question is long. " * 40_000  # 1.7 MB: seconds to tokenize
            flood = asyncio.ensure_future(big.chat.completions.create(
                model="m", messages=[{"role": "user", "content": text}], max_tokens=4))
            while not gw._episodes["big"].tasks:  # its body is read and its call has begun
                await asyncio.sleep(0.001)
            quick = await small.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            seen = list(big_engine.requests)  # what the big call had reached when the small one was answered
            answered = await flood
            return quick, seen, answered, big_engine

    quick, seen, answered, big_engine = run(asyncio.wait_for(main(), 300))
    assert quick.choices[0].message.content.startswith("echo")
    # the small call was answered while the big one was still being tokenized (before its engine call);
    # inline, the loop could run nothing else until the big call had reached its engine
    assert seen == [] and len(big_engine.requests) == 1
    assert answered.usage.prompt_tokens > 300_000


@pytest.mark.parametrize("budget", ["max_turns", "max_context_len"])
def test_a_budgets_refusal_ends_the_episode_and_later_calls_answer_410(tok, budget):
    async def main():
        async with served() as gw:
            ctx = episode_ctx(max_turns=1) if budget == "max_turns" else \
                episode_ctx(max_context_len=40, max_new_tokens=64)
            c, _ = open_episode(gw, "ended", EchoEngine(tok), tok, ctx)
            msgs = [{"role": "user", "content": "hi"}]
            if budget == "max_turns":
                await c.chat.completions.create(model="m", messages=msgs)
            with pytest.raises(openai.BadRequestError) as refused:
                await c.chat.completions.create(model="m", messages=msgs, max_tokens=39)
            later = []
            for kw in ({"max_tokens": 2}, {}):  # a call that would fit is refused too: the episode is over
                with pytest.raises(openai.APIStatusError) as e:
                    await c.chat.completions.create(model="m", messages=msgs, **kw)
                later.append(e.value)
            with pytest.raises(openai.APIStatusError) as text:
                await c.completions.create(model="m", prompt="hi", max_tokens=2)
            return refused.value, [*later, text.value], await gw.close("ended")

    refused, later, log = run(asyncio.wait_for(main(), 120))
    assert refused.code == {"max_turns": "max_turns_exceeded", "max_context_len": "context_length_exceeded"}[budget]
    for e in later:
        assert e.status_code == 410 and e.code == "episode_ended" and budget in e.message
    assert log.termination is TerminationReason(budget) and log.calls == (1 if budget == "max_turns" else 0)


def _as_ray_raises_it(e):
    """``e`` as a Serve handle raises a replica's error: the real ``RayTaskError`` with the remote
    traceback, pid and actor id."""
    try:
        raise e
    except Exception:
        return ray.exceptions.RayTaskError(
            "ServeReplica:rayapp:hf.handle_request", traceback.format_exc(), e, proctitle="ray::ServeReplica",
            pid=os.getpid(), ip="127.0.0.1", actor_repr="Replica(hf#0)",
            actor_id="5f6e0a1c2b3d4e5f60718293a4").as_instanceof_cause()


class RayRefusingEngine(EchoEngine):
    """Checks a request as the hf engine does (its vocabulary of 512), refusing through Ray; with
    ``fail``, fails every call through Ray."""

    def __init__(self, tok, fail=False):
        super().__init__(tok)
        self.fail = fail

    async def generate(self, req, timeout_s=None):
        if self.fail:
            raise _as_ray_raises_it(RuntimeError("CUDA out of memory\nwhile allocating the KV cache"))
        try:
            validate_request(req, 512)
        except ValueError as e:
            raise _as_ray_raises_it(e) from None
        return await super().generate(req, timeout_s)


def test_out_of_vocabulary_prompt_ids_are_refused_in_one_plain_line(tok):
    async def main():
        async with served() as gw:
            c, _ = open_episode(gw, "oov", RayRefusingEngine(tok), tok)
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="m", prompt=[1, 2, 99999], max_tokens=2)
            fine = await c.completions.create(model="m", prompt=[1, 2, 3], max_tokens=2)
            broken, _ = open_episode(gw, "broken", RayRefusingEngine(tok, fail=True), tok)
            with pytest.raises(openai.InternalServerError) as failed:
                await broken.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            return e.value, fine, failed.value

    refused, fine, failed = run(asyncio.wait_for(main(), 120))
    for error in (refused, failed):
        message = error.body["message"]
        assert "\n" not in message and "\x1b" not in message, message
        for leak in ("Traceback", "File ", "pid=", "actor_id", "5f6e0a1c", "ray::"):
            assert leak not in message, message
    message = refused.body["message"]
    assert "input_ids[2]" in message and "99999" in message and "512" in message
    assert refused.code == "invalid_value" and fine.choices[0].text.startswith("echo")
    assert failed.status_code == 503 and failed.code == "engine_error"
    assert failed.body["message"] == "the engine failed: RuntimeError: CUDA out of memory while allocating the KV cache"

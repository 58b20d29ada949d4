"""The gateway end to end on the real hf engine, driven by the real ``openai`` SDK over HTTP (uvicorn on
127.0.0.1): for every call, the segment's ids in its span are the engine's output ids, the loss mask
is 1 exactly there, and log-probs recomputed by a forward pass match; streaming and not give the
same tokens; text completions are segments of their own."""

import asyncio

import openai
import pytest
import torch
from agent_helpers import InProcessEngine, recording
from conftest import run
from gateway_helpers import CALC, episode_ctx, open_episode, served

from rayapp.gateway.accounting import SegmentReason

SYSTEM = {"role": "system", "content": "You add numbers."}


@pytest.fixture(scope="module")
def backend(model_dir):
    from rayapp.inference.hf import HFBackend

    b = HFBackend(str(model_dir), seed=0)
    yield b
    b.shutdown()


def recomputed(backend, ids):
    """The log-prob of each token of ``ids`` given the ones before it, by one forward pass."""
    with torch.no_grad():
        logits = backend.model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [0.0] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def assert_exact(backend, seg, engine, calls):
    """Each call's span holds the engine's ids with its log-probs, mask 1 exactly on the spans, the
    prompt of each call is the segment before it, and a forward pass gives the same log-probs."""
    assert [c for c, _, _ in seg.turns] == calls
    on = set()
    for (c, start, end) in seg.turns:
        assert seg.ids[start:end] == engine.outputs[c]
        assert seg.ids[:start] == engine.sent[c].input_ids
        assert seg.logprobs[start - seg.prompt_len:end - seg.prompt_len] == engine.logprobs[c]
        on |= set(range(start, end))
    assert seg.mask == [int(i in on) for i in range(seg.prompt_len, len(seg.ids))]
    assert all(lp == 0.0 for lp, m in zip(seg.logprobs, seg.mask, strict=True) if not m)
    again = recomputed(backend, seg.ids)
    for i in sorted(on):
        assert abs(again[i] - seg.logprobs[i - seg.prompt_len]) < 1e-4, (i, again[i], seg.logprobs[i - seg.prompt_len])


async def collect(stream):
    """A streamed reply as the non-stream one's parts: content, log-prob tokens, finish, usage."""
    content, tokens, finish, usage, role = "", [], None, None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            role = choice.delta.role or role
            content += choice.delta.content or ""
            tokens += [(t.token, t.logprob) for t in (choice.logprobs.content if choice.logprobs else None) or []]
            finish = choice.finish_reason or finish
    return role, content, tokens, finish, usage


def test_a_multi_turn_tool_episode_through_the_sdk_is_the_engines_exact_tokens(tok, backend):
    async def main():
        async with served() as gw:
            engine = recording(InProcessEngine(backend))
            c, ctx = open_episode(gw, "hf-1", engine, tok, episode_ctx(max_new_tokens=16))
            msgs = [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}]
            one = await c.chat.completions.create(model="any", messages=msgs, tools=[CALC], temperature=1.0,
                                                  seed=1, logprobs=True)
            msgs += [one.choices[0].message, {"role": "tool", "tool_call_id": "call_0", "content": "4"}]
            two = await c.chat.completions.create(model="any", messages=msgs, tools=[CALC], seed=2, logprobs=True)
            msgs += [two.choices[0].message, {"role": "user", "content": "Thanks."}]
            three = await collect(await c.chat.completions.create(
                model="any", messages=msgs, tools=[CALC], seed=3, logprobs=True, stream=True,
                stream_options={"include_usage": True}))
            models = await c.models.list()
            return engine, ctx, [one, two], three, await gw.close("hf-1"), models

    engine, ctx, replies, streamed, log, models = run(asyncio.wait_for(main(), 300))
    assert [m.id for m in models.data] == ["rayapp"]
    assert log.calls == 3 and log.reasons == {} and log.termination is None and len(log.segments) == 1
    assert_exact(backend, log.segments[0], engine, [0, 1, 2])
    for i, r in enumerate(replies):
        assert [t.logprob for t in r.choices[0].logprobs.content] == engine.logprobs[i]
        assert r.usage.completion_tokens == len(engine.outputs[i])
        assert r.usage.prompt_tokens == len(engine.sent[i].input_ids)
        assert r.choices[0].message.content == engine.texts[i]
        assert r.choices[0].finish_reason in ("stop", "length")
    role, content, tokens, finish, usage = streamed
    assert role == "assistant" and content == engine.texts[2] and finish in ("stop", "length")
    assert [lp for _, lp in tokens] == engine.logprobs[2] and usage.completion_tokens == len(engine.outputs[2])
    assert "".join(t for t, _ in tokens) == tok.decode(engine.outputs[2], skip_special_tokens=False)
    # the episode record has each call as a turn of the engine that answered it
    assert ctx.record.turns == 3
    assert [(t.engine, t.weight_version) for t in ctx.record.turn_records] == [("hf", 0)] * 3
    # every request ran under the cascade's bound and paused after a tool call
    assert all(r.sampling.max_new_tokens == 16 and "</tool_call>" in r.sampling.stop for r in engine.sent)
    assert [r.sampling.seed for r in engine.sent] == [1, 2, 3]


def test_stream_and_non_stream_give_the_same_tokens(tok, backend):
    async def episode(gw, name, stream):
        engine = recording(InProcessEngine(backend))
        c, _ = open_episode(gw, name, engine, tok, episode_ctx(max_new_tokens=12))
        msgs, got = [{"role": "user", "content": "Count to three."}], []
        for follow in ("Again.", "Once more."):
            kw = {"model": "m", "messages": msgs, "temperature": 0, "logprobs": True}
            if stream:
                _, content, tokens, finish, _ = await collect(await c.chat.completions.create(stream=True, **kw))
            else:
                r = (await c.chat.completions.create(**kw)).choices[0]
                content, tokens, finish = r.message.content, [(t.token, t.logprob) for t in r.logprobs.content], \
                    r.finish_reason
            got.append((content, tokens, finish))
            msgs = [*msgs, {"role": "assistant", "content": content}, {"role": "user", "content": follow}]
        return got, await gw.close(name), engine

    async def main():
        async with served() as gw:
            return await episode(gw, "plain", False), await episode(gw, "streamed", True)

    (plain, plain_log, plain_engine), (streamed, streamed_log, streamed_engine) = run(asyncio.wait_for(main(), 300))
    assert [(c, [t for t, _ in toks], f) for c, toks, f in plain] == \
        [(c, [t for t, _ in toks], f) for c, toks, f in streamed]
    for (_, a, _), (_, b, _) in zip(plain, streamed, strict=True):
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b, strict=True))
    assert plain_engine.outputs == streamed_engine.outputs
    assert [s.ids for s in plain_log.segments] == [s.ids for s in streamed_log.segments]
    assert [s.mask for s in plain_log.segments] == [s.mask for s in streamed_log.segments]
    assert_exact(backend, streamed_log.segments[0], streamed_engine, [0, 1])


def test_text_completions_are_segments_of_their_own(tok, backend):
    async def main():
        async with served() as gw:
            engine = recording(InProcessEngine(backend))
            c, _ = open_episode(gw, "cmpl", engine, tok)
            chat = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            text = await c.completions.create(model="m", prompt="2 + 2 =", max_tokens=6, seed=4)
            ids = await c.completions.create(model="m", prompt=[1, 40, 41, 42], max_tokens=6, seed=5)
            return engine, chat, text, ids, await gw.close("cmpl")

    engine, chat, text, by_ids, log = run(asyncio.wait_for(main(), 300))
    assert log.calls == 3 and log.reasons == {SegmentReason.COMPLETION: 2}
    assert [s.reason for s in log.segments] == [None, SegmentReason.COMPLETION, SegmentReason.COMPLETION]
    _, first, second = log.segments
    assert engine.sent[1].input_ids == tok.encode("2 + 2 =") and engine.sent[2].input_ids == [1, 40, 41, 42]
    for seg, c in ((first, 1), (second, 2)):
        assert seg.ids == engine.sent[c].input_ids + engine.outputs[c]
        assert seg.prompt_len == len(engine.sent[c].input_ids)
        assert seg.mask == [1] * len(engine.outputs[c]) and seg.logprobs == engine.logprobs[c]
        assert seg.turns == [(c, seg.prompt_len, len(seg.ids))]
        assert_exact(backend, seg, engine, [c])
    assert text.choices[0].text == engine.texts[1] and text.usage.completion_tokens == len(engine.outputs[1])
    assert by_ids.choices[0].text == engine.texts[2]
    assert chat.choices[0].message.content == engine.texts[0]


class Aborting(InProcessEngine):
    """The hf engine with the client's ``abort``, which records what it was asked to abort."""

    aborted: list

    async def abort(self, request_id=None):
        self.aborted.append(request_id)
        return await self.backend.abort(request_id)


def test_closing_an_episode_aborts_its_generation_on_the_hf_engine(tok, backend):
    async def main():
        async with served() as gw:
            engine = Aborting(backend)
            engine.aborted = []
            c, ctx = open_episode(gw, "cut", engine, tok, episode_ctx(max_new_tokens=480))
            call = asyncio.ensure_future(c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Tell a long story."}], seed=0))
            async with asyncio.timeout(60):
                while not (await backend.health())["in_flight"]:
                    await asyncio.sleep(0.005)
            log = await gw.close("cut")
            health = await backend.health()
            try:
                await asyncio.wait_for(call, 30)
            except openai.APIStatusError as e:
                return engine, ctx, log, health, e
            return engine, ctx, log, health, None

    engine, ctx, log, health, cut = run(asyncio.wait_for(main(), 120))
    assert cut is not None and cut.status_code == 410 and cut.code == "episode_ended"
    assert len(engine.aborted) == 1 and engine.aborted[0]  # aborted at the engine, by the request's id
    assert health["in_flight"] == 0  # and nothing of it is left running there
    assert log.calls == 0 and log.segments == [] and ctx.record.turns is None

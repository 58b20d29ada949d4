"""Many episodes through one gateway, driven by the real ``openai`` SDK: no cross-talk, one episode's
key reads and writes nothing of another's, an ended episode answers 410, errors come in OpenAI's
shape with the right status, the episode's budgets answer 400 and set its termination, and closing
an episode aborts its call in flight at the engine."""

import asyncio
import re
import tracemalloc

import openai
import pytest
from agent_helpers import ScriptedEngine, recording
from conftest import run
from gateway_helpers import EchoEngine, HangingEngine, client, episode_ctx, open_episode, served

from rayapp.gateway.service import EpisodeBinding, Gateway
from rayapp.record import TerminationReason

N = 64


def test_64_concurrent_episodes_hold_only_their_own_calls_and_keys(tok):
    async def episode(gw, engine, i):
        c, ctx = open_episode(gw, f"ep-{i}", engine, tok)
        msgs = [{"role": "user", "content": f"remember secret-{i}"}]
        replies = []
        for follow in ("again", "once more"):
            r = await c.chat.completions.create(model="m", messages=msgs, stream=i % 2 == 1)
            if i % 2:
                text = "".join([ch.choices[0].delta.content or "" async for ch in r if ch.choices])
            else:
                text = r.choices[0].message.content
            replies.append(text)
            msgs = [*msgs, {"role": "assistant", "content": text}, {"role": "user", "content": follow}]
        return c, ctx, replies

    async def main():
        async with served() as gw:
            engine = EchoEngine(tok)
            done = await asyncio.gather(*(episode(gw, engine, i) for i in range(N)))
            # a key opens its own episode only: another's answers 401, whether read or written
            clients = [c for c, _, _ in done]
            crossed = client(str(clients[1].base_url), clients[0].api_key)
            denied = []
            for attempt in (crossed.models.list(),
                            crossed.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])):
                with pytest.raises(openai.AuthenticationError) as e:
                    await attempt
                denied.append(e.value)
            unknown = client(str(clients[0].base_url).replace("ep-0", "ep-none"), clients[0].api_key)
            with pytest.raises(openai.NotFoundError) as missing:
                await unknown.models.list()
            logs = [await gw.close(f"ep-{i}") for i in range(N)]
            with pytest.raises(openai.APIStatusError) as ended:  # its own key, after the end
                await clients[0].chat.completions.create(model="m", messages=[{"role": "user", "content": "late"}])
            return engine, done, denied, missing.value, ended.value, logs, len(gw)

    engine, done, denied, missing, ended, logs, still_open = run(asyncio.wait_for(main(), 300))
    assert len(engine.requests) == 2 * N and still_open == 0
    # each episode is one routing session: its calls stay on one engine replica (rayapp.actors.app.STICKY_ROUTER)
    assert sorted(r.session_id for r in engine.requests) == sorted(f"ep-{i}" for i in range(N) for _ in range(2))
    for i, ((_, ctx, replies), log) in enumerate(zip(done, logs, strict=True)):
        assert replies == [f"echo secret-{i}"] * 2  # its own secret only: no reply crossed episodes
        assert log.calls == 2 and log.reasons == {} and len(log.segments) == 1 and ctx.record.turns == 2
        seg = log.segments[0]
        assert [c for c, _, _ in seg.turns] == [0, 1]
        text = tok.decode(seg.ids, skip_special_tokens=True)
        assert set(re.findall(r"secret-\d+", text)) == {f"secret-{i}"}
    assert all(e.status_code == 401 and e.code == "invalid_api_key" for e in denied)
    assert missing.status_code == 404 and missing.code == "episode_not_found"
    assert ended.status_code == 410 and ended.code == "episode_ended"


def test_an_open_episode_costs_little_memory(tok):
    gw = Gateway("http://127.0.0.1:1/rayapp/gateway")
    engine = EchoEngine(tok)
    gw.open(EpisodeBinding("warm", engine, tok, episode_ctx()))  # the shared tools template, made once
    contexts = [episode_ctx() for _ in range(200)]  # the evaluator's, not the gateway's
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, ctx in enumerate(contexts):
            gw.open(EpisodeBinding(f"m-{i}", engine, tok, ctx))
        per_episode = (tracemalloc.get_traced_memory()[0] - before) / 200
    finally:
        tracemalloc.stop()
    assert per_episode < 4 * 1024, per_episode  # about 1.1 KiB measured: a key, a few fields, no tokenizer


def test_errors_come_in_openais_shape_with_their_status(tok, model_dir, monkeypatch):
    monkeypatch.setattr("rayapp.gateway.routes.MAX_BODY_BYTES", 4096)

    async def main():
        async with served() as gw:
            c, _ = open_episode(gw, "errors", EchoEngine(tok), tok)
            got = {}
            for name, kw in {"n": {"n": 2}, "logit_bias": {"logit_bias": {"5": 1.0}},
                             "temperature": {"temperature": 5}, "messages": {"messages": []}}.items():
                with pytest.raises(openai.BadRequestError) as e:
                    await c.chat.completions.create(**{"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                       **kw})
                got[name] = e.value
            with pytest.raises(openai.BadRequestError) as echo:
                await c.completions.create(model="m", prompt="x", echo=True)
            with pytest.raises(openai.APIStatusError) as large:
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * 5000}])
            got["large"] = large.value
            bad_json = await gw.handle("errors", "chat/completions", f"Bearer {c.api_key}", b"{nope")
            wrong_route = await gw.handle("errors", "embeddings", f"Bearer {c.api_key}", b"{}")
            log = await gw.close("errors")
            return got, echo.value, bad_json, wrong_route, log

    got, echo, bad_json, wrong_route, log = run(asyncio.wait_for(main(), 120))
    for name in ("n", "logit_bias"):
        assert got[name].param == name and got[name].code == "unsupported_parameter" and name in got[name].message
    assert got["temperature"].param == "temperature" and got["messages"].param == "messages"
    assert echo.param == "echo"
    assert got["large"].status_code == 413 and got["large"].code == "request_too_large"
    assert bad_json.status == 400 and set(bad_json.body["error"]) == {"message", "type", "param", "code"}
    assert wrong_route.status == 404 and "chat/completions" in wrong_route.body["error"]["message"]
    assert log.calls == 0 and log.segments == []  # nothing refused reached the engine or the record


def test_budgets_answer_400_and_set_the_episodes_termination(tok, model_dir):
    async def main():
        async with served() as gw:
            msgs = [{"role": "user", "content": "hi"}]
            turns, _ = open_episode(gw, "turns", EchoEngine(tok), tok, episode_ctx(max_turns=2))
            for _ in range(2):
                await turns.chat.completions.create(model="m", messages=msgs)
            with pytest.raises(openai.BadRequestError) as over_turns:
                await turns.chat.completions.create(model="m", messages=msgs)
            # max_tokens past the context budget: refused before the engine
            room = episode_ctx(max_context_len=40, max_new_tokens=64)
            asked, _ = open_episode(gw, "asked", EchoEngine(tok), tok, room)
            with pytest.raises(openai.BadRequestError) as over_context:
                await asked.chat.completions.create(model="m", messages=msgs, max_tokens=39)
            # no max_tokens: the turn is capped to the room left, and filling it ends the episode
            engine = recording(ScriptedEngine(tok, model_dir, ["a long answer " * 20]))
            capped, _ = open_episode(gw, "capped", engine, tok, episode_ctx(max_context_len=12))
            full = await capped.chat.completions.create(model="m", messages=msgs)
            return (over_turns.value, await gw.close("turns"), over_context.value, await gw.close("asked"),
                    full, engine, await gw.close("capped"))

    over_turns, turns, over_context, asked, full, engine, capped = run(asyncio.wait_for(main(), 120))
    assert over_turns.code == "max_turns_exceeded" and "max_turns (2" in over_turns.message
    assert turns.termination is TerminationReason.MAX_TURNS and turns.calls == 2
    assert over_context.code == "context_length_exceeded" and "max_context_len is 40" in over_context.message
    assert asked.termination is TerminationReason.MAX_CONTEXT_LEN and asked.calls == 0
    prompt = len(engine.sent[0].input_ids)
    assert engine.sent[0].sampling.max_new_tokens == 12 - prompt
    assert full.choices[0].finish_reason == "length" and full.usage.total_tokens == 12
    assert capped.termination is TerminationReason.MAX_CONTEXT_LEN and len(capped.segments[0].ids) == 12


def test_closing_an_episode_aborts_its_call_in_flight_at_the_engine(tok):
    async def main():
        async with served() as gw:
            engine = HangingEngine()
            c, ctx = open_episode(gw, "hang", engine, tok)
            msgs = [{"role": "user", "content": "x"}]
            call = asyncio.ensure_future(c.chat.completions.create(model="m", messages=msgs))
            await asyncio.wait_for(engine.started.wait(), 30)
            log = await gw.close("hang")
            with pytest.raises(openai.APIStatusError) as cut:
                await asyncio.wait_for(call, 30)
            return engine, ctx, log, cut.value

    engine, ctx, log, cut = run(asyncio.wait_for(main(), 120))
    assert len(engine.aborted) == 1 and engine.aborted[0]  # the engine was told which request to abort
    assert not engine.running  # and nothing is left running there
    assert cut.status_code == 410 and cut.code == "episode_ended"
    assert log.calls == 0 and log.segments == [] and ctx.record.turns is None


class PairedEngine(EchoEngine):
    """Answers neither of the first two calls before both have reached it: the two calls are then at once
    however the machine's load orders their HTTP requests."""

    def __init__(self, tok):
        super().__init__(tok)
        self.arrived, self.both = 0, asyncio.Event()

    async def generate(self, req, timeout_s=None):
        self.arrived += 1
        if self.arrived == 2:
            self.both.set()
        await self.both.wait()
        return await super().generate(req, timeout_s)


def test_two_calls_of_one_episode_at_once_give_a_counted_concurrent_segment(tok):
    async def main():
        async with served() as gw:
            c, ctx = open_episode(gw, "both", PairedEngine(tok), tok)
            asks = [[{"role": "user", "content": "secret-1"}, {"role": "user", "content": q}] for q in "ab"]
            await asyncio.gather(*(c.chat.completions.create(model="m", messages=m) for m in asks))
            return ctx, await gw.close("both")

    ctx, log = run(asyncio.wait_for(main(), 120))
    assert log.calls == 2 and ctx.record.turns in (1, 2) and log.reasons == {"concurrent": 1}
    assert sorted(c for s in log.segments for c, _, _ in s.turns) == [0, 1]
    for seg in log.segments:  # each one self-consistent: a prompt and the engine's reply to it
        assert len(seg.turns) == 1 and seg.mask == [1] * (len(seg.ids) - seg.prompt_len)

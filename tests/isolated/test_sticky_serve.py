"""Sticky routing on a real Serve deployment: the hf engine with two replicas, as a recipe deploys it
(``rayapp.actors.app.engine_app``: calls routed by session), called through its handle by native
agents' turns. Every turn of a multi-turn episode runs on one replica (the turn records name it), episodes
spread over both replicas, and the replicas reuse the episodes' KV caches; the same calls without a
session are spread turn by turn. On the isolated files' shared Ray head (conftest.py)."""

import asyncio

import pytest
from shared_head import start_serve

from rayapp.actors.app import engine_app
from rayapp.actors.engine import EngineClient
from rayapp.envs.agents.chat import ChatAgent
from rayapp.episode import EPISODE, EpisodeContext
from rayapp.inference.client import GenerateRequest
from rayapp.recipe.config import EngineConfig
from rayapp.types import Sample, SamplingParams, StoppingCriteria

EPISODES, TURNS = 16, 3
GREEDY = SamplingParams(temperature=0, max_new_tokens=4)


def fan_out_app():
    """A deployment that calls the engine from inside its replica, as the manager does: one request of
    its own fans out many concurrent engine calls (defined here: replicas get it by value)."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class FanOut:
        def __init__(self, engine_handle):
            self.engine = EngineClient(engine_handle, "student", timeout_s=60)

        async def run(self, n: int, ids: list[int]) -> list[str]:
            async def one(i: int) -> str:
                session = f"rollout0/fan-{i}#0" if i % 4 else ""  # some calls name no session
                return (await self.engine.generate(GenerateRequest(ids, GREEDY, session_id=session))).engine
            return await asyncio.gather(*(one(i) for i in range(n)))

    return FanOut


@pytest.fixture(scope="module")
def engine(head, model_dir):
    import ray
    from ray import serve

    ray.init(address=head.address, namespace="rayapp-sticky", logging_level="warning", log_to_driver=False)
    try:
        start_serve(head)
        cfg = EngineConfig(num_replicas=2, num_cpus=0.5,
                           options={"model_path": str(model_dir), "max_concurrency": 4, "seed": 0})
        serve.run(fan_out_app().bind(engine_app("student", cfg)), name="sticky", route_prefix=None)
        handle = serve.get_deployment_handle("engine-student", app_name="sticky")
        yield EngineClient(handle, "student", timeout_s=120)
    finally:
        serve.delete("sticky")
        ray.shutdown()


def observation(tok, turn: int) -> list[int]:
    return tok.encode(f"\nuser: and {turn} more?\nassistant:", add_special_tokens=False)


def sample(i: int) -> Sample:
    return Sample(f"count-{i}", 0, f"Count from {i}, one number a turn.")


async def native_episode(agent: ChatAgent, i: int) -> tuple[str, list[str]]:
    """One episode as the evaluator runs a native agent's: named (``EPISODE``), each turn the whole
    conversation so far; its name and the engine of each of its turns (from its turn records)."""
    name = f"rollout0/count-{i}#0"
    ctx = EpisodeContext(0, None, StoppingCriteria(max_turns=TURNS), GREEDY)
    named = EPISODE.set(name)
    try:
        tok = await agent.tokenizer()
        ids = list(tok.apply_chat_template(agent.messages(sample(i)), add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
        for turn in range(1, TURNS + 1):
            out, _ = await agent.turn(tok, ids, ([], []), GREEDY, turn, sample(i), ctx)
            ids += [*out.output_ids, *observation(tok, turn)]
    finally:
        EPISODE.reset(named)
    return name, [t.engine for t in ctx.record.turn_records]


async def plain_episode(agent: ChatAgent, i: int) -> list[str]:
    """The same conversation's calls with no session: each turn goes where Serve's default sends it."""
    tok = await agent.tokenizer()
    ids = list(tok.apply_chat_template(agent.messages(sample(i)), add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    engines = []
    for turn in range(1, TURNS + 1):
        out = await agent.engine.generate(GenerateRequest(ids, GREEDY, stop_token_ids=[tok.eos_token_id]))
        engines.append(out.engine)
        ids += [*out.output_ids, *observation(tok, turn)]
    return engines


async def reused_tokens(engine: EngineClient) -> int:
    """Prompt tokens the replicas took from their prefix caches so far, all replicas together."""
    return sum(h["prefix_cache"]["reused_tokens"] for h in await engine.broadcast("health", timeout_s=60))


def test_every_turn_of_an_episode_runs_on_one_replica_and_episodes_spread(engine):
    agent = ChatAgent(engine, verify=lambda s, r: {})

    async def main():
        return await asyncio.gather(*(native_episode(agent, i) for i in range(EPISODES)))

    episodes = asyncio.run(main())
    replicas = sorted({e.split("#")[-1] for _, engines in episodes for e in engines})
    assert len(replicas) == 2, episodes  # both replicas served episodes
    for name, engines in episodes:
        assert len(engines) == TURNS and all(e.startswith("hf@engine-student#") for e in engines), engines
        assert len(set(engines)) == 1, (name, engines)  # one replica for every turn


def test_without_a_session_turns_spread_and_the_replicas_reuse_less(engine):
    agent = ChatAgent(engine, verify=lambda s, r: {})

    async def main():  # other prompts than the test above: no cache of its episodes is hit
        start = await reused_tokens(engine)
        plain = await asyncio.gather(*(plain_episode(agent, 100 + i) for i in range(EPISODES)))
        middle = await reused_tokens(engine)
        await asyncio.gather(*(native_episode(agent, 200 + i) for i in range(EPISODES)))
        return plain, middle - start, await reused_tokens(engine) - middle

    plain, reused_plain, reused_sticky = asyncio.run(main())
    assert any(len(set(engines)) > 1 for engines in plain), plain
    print(f"prompt tokens reused over {EPISODES} episodes of {TURNS} turns: {reused_sticky} with sessions, "
          f"{reused_plain} without")
    assert reused_sticky > reused_plain


def test_engine_calls_fanned_out_from_inside_a_replica_all_come_back(engine):
    """The manager's case: one request to its replica makes many engine calls at once. Serve gives
    them all that request's internal id unless the client gives each its own (``own_request_id``),
    and the consistent-hash router then answered one and left the rest waiting."""
    from ray import serve

    async def main():
        tok = await ChatAgent(engine, verify=lambda s, r: {}).tokenizer()
        ids = tok.encode("Count to three.", add_special_tokens=False)
        return await serve.get_app_handle("sticky").run.remote(32, ids)

    engines = asyncio.run(asyncio.wait_for(main(), 240))
    assert len(engines) == 32 and all(e.startswith("hf@engine-student#") for e in engines)
    assert len(set(engines)) == 2  # both replicas answered

"""Sticky routing on a real Serve deployment: the hf engine with two replicas, as a recipe deploys it
(``rayapp.actors.app.engine_app``), called through its handle by native agents' turns. Every turn
of a multi-turn episode runs on the episode's home replica (the turn records name it), episodes
spread over both replicas, and the replicas reuse the episodes' KV caches; the same calls without a
session are spread turn by turn. Runs in its own pytest process (it starts its own Ray cluster)."""

import asyncio
import os

import pytest

from rayapp.actors.app import engine_app
from rayapp.actors.engine import EngineClient
from rayapp.actors.routing import home
from rayapp.envs.agents.chat import ChatAgent
from rayapp.episode import EPISODE, EpisodeContext
from rayapp.inference.client import GenerateRequest
from rayapp.recipe.config import EngineConfig
from rayapp.types import Sample, SamplingParams, StoppingCriteria

EPISODES, TURNS = 16, 4
GREEDY = SamplingParams(temperature=0, max_new_tokens=6)


@pytest.fixture(scope="module")
def engine(cache_dir, model_dir):
    os.environ["RAYAPP_CACHE"] = str(cache_dir)  # the driver's copy of the engine's tokenizer files
    import ray
    from ray import serve

    from rayapp.cli.local import auth_token

    with auth_token():
        ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="rayapp-sticky",
                 logging_level="warning", log_to_driver=False)
        try:
            serve.start(proxy_location="Disabled")  # handles only: no HTTP port
            cfg = EngineConfig(num_replicas=2, num_cpus=0.5,
                               options={"model_path": str(model_dir), "max_concurrency": 4, "seed": 0})
            handle = serve.run(engine_app("student", cfg), name="sticky", route_prefix=None)
            yield EngineClient(handle, "student", timeout_s=120)
        finally:
            serve.shutdown()
            ray.shutdown()


def observation(tok, turn: int) -> list[int]:
    return tok.encode(f"\nuser: and {turn} more?\nassistant:", add_special_tokens=False)


async def native_episode(agent: ChatAgent, i: int) -> tuple[str, list[str]]:
    """One episode as the evaluator runs a native agent's: named (``EPISODE``), each turn the whole
    conversation so far; its name and the engine of each of its turns (from its turn records)."""
    name = f"rollout0/count-{i}#0"
    ctx = EpisodeContext(0, None, StoppingCriteria(max_turns=TURNS), GREEDY)
    sample = Sample(f"count-{i}", 0, f"Count from {i}, one number a turn.")
    named = EPISODE.set(name)
    try:
        tok = await agent.tokenizer()
        ids = list(tok.apply_chat_template(agent.messages(sample), add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
        for turn in range(1, TURNS + 1):
            out, _ = await agent.turn(tok, ids, ([], []), GREEDY, turn, sample, ctx)
            ids += [*out.output_ids, *observation(tok, turn)]
    finally:
        EPISODE.reset(named)
    return name, [t.engine for t in ctx.record.turn_records]


async def plain_episode(engine: EngineClient, tok, i: int) -> list[str]:
    """The same conversation's calls with no session: each turn goes where the load is lowest."""
    ids = list(tok.apply_chat_template([{"role": "user", "content": f"Count from {i}."}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False))
    engines = []
    for turn in range(1, TURNS + 1):
        out = await engine.generate(GenerateRequest(ids, GREEDY, stop_token_ids=[tok.eos_token_id]))
        engines.append(out.engine)
        ids += [*out.output_ids, *observation(tok, turn)]
    return engines


def test_every_turn_of_an_episode_runs_on_its_home_replica_and_episodes_spread(engine):
    agent = ChatAgent(engine, verify=lambda sample, result: {})

    async def main():
        before = await engine.broadcast("health", timeout_s=60)
        episodes = await asyncio.gather(*(native_episode(agent, i) for i in range(EPISODES)))
        after = await engine.broadcast("health", timeout_s=60)
        return before, episodes, after

    before, episodes, after = asyncio.run(main())
    replicas = sorted({e.split("#")[-1] for _, engines in episodes for e in engines})
    assert len(replicas) == 2, episodes  # both replicas served episodes
    for name, engines in episodes:
        assert len(engines) == TURNS and all(e.startswith("hf@engine-student#") for e in engines), engines
        assert len(set(engines)) == 1, (name, engines)  # one replica for every turn
        assert engines[0].split("#")[-1] == home(name, replicas)  # the session's rendezvous choice
    for b, a in zip(before, after, strict=True):  # later turns prefilled only what was new, on both replicas
        assert a["prefix_cache"]["hits"] > b["prefix_cache"]["hits"], (b, a)


def test_calls_without_a_session_are_spread_turn_by_turn(engine):
    async def main():
        tok = await ChatAgent(engine, verify=lambda s, r: {}).tokenizer()
        return await asyncio.gather(*(plain_episode(engine, tok, i) for i in range(EPISODES)))

    episodes = asyncio.run(main())
    assert any(len(set(engines)) > 1 for engines in episodes), episodes

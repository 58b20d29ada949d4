"""The agent gateway's cost, next to Ray Serve's own HTTP floor, in one run on a local Ray.

Three Serve applications on one HTTP proxy (127.0.0.1, Ray's token auth on), each one replica taking
as many requests at once as the manager's (1,000; the engine as a recipe's, 64) with a FastAPI
ingress whose route methods are the manager's (``rayapp.gateway.routes.gateway_response``):

- ``floor``: a do-nothing deployment that reads the body and answers a fixed chat-completion JSON;
- ``gateway, instant``: a ``Gateway`` over an engine in its replica that answers fixed tokens at once
  (what the gateway itself costs: parsing, accounting, tokenising, the reply);
- ``gateway, hf``: a ``Gateway`` over the tiny ``hf`` engine in its own deployment, called through its
  handle (``EngineClient``), as the manager calls engines.

Per row: the latency of one call (sequential, a fresh episode's first call), paired with a direct
engine call for the same prompt ids (the instant engine in this process; the hf engine through the
same deployment handle from the driver): p50 and p99 of the call and of what the gateway adds
(call minus its paired direct call). Then calls/s with 64 concurrent episodes of ``--turns`` calls
each (every call sends the whole conversation so far, as agents do), the floor and the instant gateway
taking turns in rounds (10) so a shared machine's load hits both alike; the instant gateway's calls/s as a
ratio of the floor's (target >= 0.80). The client is httpx with keep-alive (one ``AsyncClient``, 64
connections), lighter than the openai SDK on the same cores. Memory per open episode: tracemalloc in
the gateway's replica around opening episodes and answering one call each. Figures only.

Run from the repo root: ``.venv/bin/python bench/gateway.py [--smoke] [--calls N] [--turns T]``.
"""


import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import ray
from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import JSONResponse, Response

from rayapp.actors.engine import EngineClient, InferenceEngine
from rayapp.cli.local_cluster import CLUSTER_ENV, free_port, process_auth_token, stop_cluster
from rayapp.episode import EpisodeContext
from rayapp.gateway.routes import gateway_response
from rayapp.gateway.service import EpisodeBinding, Gateway
from rayapp.inference.client import FinishReason, GenerateOutput, GenerateRequest
from rayapp.inference.tiny_model import ensure_tiny_model, load_tokenizer
from rayapp.recipe.config import EngineConfig
from rayapp.types import SamplingParams, StoppingCriteria

EPISODES = 64
MAX_TOKENS = 8
ANSWER = "The answer is 4."
SYSTEM = {"role": "system", "content": "You add numbers. Answer with the total only."}
ROUNDS = 10  # a round of both takes seconds; one round's ratio swings 0.7-1.0 on a shared 2-core machine
NO_CPU = {"num_cpus": 0}
# as the manager's deployment, which serves the gateway (rayapp.actors.app): Serve's default (5) would queue
# 59 of the 64 episodes' calls in the proxy, whose back-off then sets the pace of both rows
MANAGER_ONGOING = 1_000


def context() -> EpisodeContext:
    return EpisodeContext(0, None, StoppingCriteria(max_turns=64), SamplingParams(max_new_tokens=16, temperature=0))


def chat_body(messages: list[dict]) -> bytes:
    return json.dumps({"model": "rayapp", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()


class InstantEngine:
    """Answers ``ANSWER`` and the end-of-turn token at once, whatever it is asked."""

    def __init__(self, tok: Any):
        self.ids = [*tok.encode(ANSWER, add_special_tokens=False), tok.eos_token_id]

    async def info(self) -> dict:
        return {}

    async def generate(self, req: GenerateRequest, timeout_s: float | None = None) -> GenerateOutput:
        ids = self.ids[:req.sampling.max_new_tokens] if req.sampling.max_new_tokens else self.ids
        return GenerateOutput(req.request_id, ids, [-0.1] * len(ids), FinishReason.STOP, ANSWER,
                              len(req.input_ids), "instant", "0")

    async def abort(self, request_id: str | None = None) -> int:
        return 0


floor_api = FastAPI()
FIXED = {"id": "chatcmpl-floor", "object": "chat.completion", "created": 0, "model": "rayapp",
         "usage": {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26},
         "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER}, "logprobs": None,
                      "finish_reason": "stop"}]}


@serve.deployment(ray_actor_options=NO_CPU, max_ongoing_requests=MANAGER_ONGOING)
@serve.ingress(floor_api)
class Floor:
    """Serve's HTTP floor: the gateway's route, reading the body and answering a fixed reply."""

    @floor_api.post("/gateway/{episode}/v1/chat/completions")
    async def chat(self, episode: str, request: Request) -> Response:
        await request.body()
        return JSONResponse(FIXED)

    def open(self, n: int, base_url: str) -> list[tuple[str, str]]:
        return [(f"{base_url}/floor-{i}/v1", "none") for i in range(n)]

    async def close_all(self) -> None:
        pass


gateway_api = FastAPI()


@serve.deployment(ray_actor_options=NO_CPU, max_ongoing_requests=MANAGER_ONGOING)
@serve.ingress(gateway_api)
class GatewayApp:
    """The manager's three gateway routes over a Gateway, with the instant engine in this replica or
    the engine deployment behind ``engine`` (a handle)."""

    def __init__(self, model_dir: str, engine: Any = None):
        self.tok = load_tokenizer(model_dir)
        self.engine = EngineClient(engine, "hf", timeout_s=120) if engine is not None else InstantEngine(self.tok)
        self.gateway = Gateway("http://unset")
        self.opened, self.open_ids = 0, []

    @gateway_api.post("/gateway/{episode}/v1/chat/completions")
    async def chat(self, episode: str, request: Request) -> Response:
        return await gateway_response(self.gateway, episode, "chat/completions", request)

    def open(self, n: int, base_url: str) -> list[tuple[str, str]]:
        self.gateway.base_url = base_url
        out = []
        for _ in range(n):
            self.opened += 1
            self.open_ids.append(f"e{self.opened}")
            out.append(self.gateway.open(EpisodeBinding(self.open_ids[-1], self.engine, self.tok, context())))
        return out

    async def close_all(self) -> None:
        while self.open_ids:
            await self.gateway.close(self.open_ids.pop())

    async def memory(self, n: int) -> float:
        """Bytes per open episode that has answered one call (its recorded tokens, messages, key)."""
        contexts = [context() for _ in range(n)]  # the evaluator's, not the gateway's
        body = chat_body([SYSTEM, {"role": "user", "content": "What is 2 + 2?"}])
        await self.close_all()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i, ctx in enumerate(contexts):
                self.open_ids.append(f"mem-{i}")
                _, key = self.gateway.open(EpisodeBinding(self.open_ids[-1], self.engine, self.tok, ctx))
                await self.gateway.handle(f"mem-{i}", "chat/completions", f"Bearer {key}", body)
            per = (tracemalloc.get_traced_memory()[0] - before) / n
        finally:
            tracemalloc.stop()
        await self.close_all()
        return per


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def post(http: httpx.AsyncClient, url: str, key: str, messages: list[dict]) -> str:
    r = await http.post(f"{url}/chat/completions", content=chat_body(messages),
                        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    if r.status_code != 200:
        raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()["choices"][0]["message"]["content"]


async def latency(handle: Any, base: str, direct: Any, tok: Any, calls: int) -> tuple[list[float], list[float]]:
    """Per call: seconds of the gateway's HTTP call and of its paired direct engine call."""
    over, alone = [], []
    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(calls):
            url, key = (await handle.open.remote(1, base))[0]
            messages = [SYSTEM, {"role": "user", "content": f"What is {i} + 2?"}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            req = GenerateRequest(list(ids), SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0),
                                  stop_token_ids=[tok.eos_token_id])
            start = time.perf_counter()
            await direct.generate(req)
            alone.append(time.perf_counter() - start)
            start = time.perf_counter()
            await post(http, url, key, messages)
            over.append(time.perf_counter() - start)
        await handle.close_all.remote()
    return over, alone


async def episodes(handle: Any, base: str, turns: int) -> tuple[int, float]:
    """64 concurrent episodes of ``turns`` calls each: (calls, wall seconds)."""
    opened = await handle.open.remote(EPISODES, base)
    limits = httpx.Limits(max_connections=EPISODES, max_keepalive_connections=EPISODES)

    async def one(i: int, url: str, key: str) -> None:
        messages = [SYSTEM, {"role": "user", "content": f"What is {i} + 2?"}]
        for t in range(turns):
            answer = await post(http, url, key, messages)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And {t} more?"}]

    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(one(i, url, key) for i, (url, key) in enumerate(opened)))
        wall = time.perf_counter() - start
    await handle.close_all.remote()
    return EPISODES * turns, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run (tests)")
    ap.add_argument("--calls", type=int, default=200, help="sequential calls for the latency (default 200)")
    ap.add_argument("--turns", type=int, default=4, help="calls per episode in the concurrent run (default 4)")
    args = ap.parse_args()
    calls, turns, rounds = (10, 2, 1) if args.smoke else (args.calls, args.turns, ROUNDS)
    model_dir = str(ensure_tiny_model())
    tok = load_tokenizer(model_dir)
    temp_dir = Path(tempfile.mkdtemp(prefix="rayapp-bench-gw-"))
    try:
        address = start_head(temp_dir)
        ray.init(address=address, logging_level="error", log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        hf_engine = serve.deployment(InferenceEngine, ray_actor_options=NO_CPU,
                                     max_ongoing_requests=EngineConfig().max_ongoing_requests).bind()
        apps = {"floor": serve.run(Floor.bind(), name="floor", route_prefix="/floor"),
                "instant": serve.run(GatewayApp.bind(model_dir), name="instant", route_prefix="/instant"),
                "hf": serve.run(GatewayApp.bind(model_dir, hf_engine), name="hf", route_prefix="/hf")}
        engine = serve.get_deployment_handle("InferenceEngine", app_name="hf")
        base = {name: f"http://127.0.0.1:{port}/{name}/gateway" for name in apps}
        asyncio.run(measure(apps, base, EngineClient(engine, "hf", timeout_s=120), tok, calls, turns, rounds))
        serve.shutdown()
    finally:
        ray.shutdown()
        stop_cluster(temp_dir)
        if sys.exc_info()[0] is None:  # a failed start's logs stay for a look
            shutil.rmtree(temp_dir, ignore_errors=True)


async def measure(apps: dict, base: dict, hf: EngineClient, tok: Any, calls: int, turns: int, rounds: int) -> None:
    directs = {"floor": InstantEngine(tok), "instant": InstantEngine(tok), "hf": hf}
    hf_calls = max(5, calls // 5)  # the tiny model generates for real: fewer
    for name in apps:  # warm: the first calls of a replica and of the proxy's route are slow
        await latency(apps[name], base[name], directs[name], tok, 3)
    lat = {name: await latency(apps[name], base[name], directs[name], tok, calls if name != "hf" else hf_calls)
           for name in apps}
    done = {name: [0, 0.0] for name in apps}
    paired = []  # per round: the instant gateway's calls/s over the floor's, measured back to back
    for _ in range(rounds):
        rate = {}
        for name in ("floor", "instant"):
            n, wall = await episodes(apps[name], base[name], turns)
            done[name][0] += n
            done[name][1] += wall
            rate[name] = n / wall
        paired.append(rate["instant"] / rate["floor"])
    n, wall = await episodes(apps["hf"], base["hf"], min(turns, 2))
    done["hf"] = [n, wall]
    per_episode = await apps["instant"].memory.remote(50 if calls < 50 else 500)

    print(f"one replica each; latency: {calls} sequential first calls of fresh episodes (hf: {hf_calls}), "
          f"max_tokens {MAX_TOKENS}; calls/s: {EPISODES} concurrent episodes x {turns} calls (hf: {min(turns, 2)}), "
          f"httpx with keep-alive")
    print(f"{'row':<18} {'p50 ms':>8} {'p99 ms':>8} {'direct p50':>10} {'added p50':>9} {'added p99':>9} "
          f"{'calls/s':>8}")
    labels = {"floor": "serve floor", "instant": "gateway, instant", "hf": "gateway, hf"}
    for name, (over, alone) in lat.items():
        added = [(o - a) * 1e3 for o, a in zip(over, alone, strict=True)]
        ms = [x * 1e3 for x in over]
        print(f"{labels[name]:<18} {statistics.median(ms):>8.2f} {pct(ms, 0.99):>8.2f} "
              f"{statistics.median(alone) * 1e3:>10.3f} {statistics.median(added):>9.2f} {pct(added, 0.99):>9.2f} "
              f"{done[name][0] / done[name][1]:>8.1f}")
    ratio = (done["instant"][0] / done["instant"][1]) / (done["floor"][0] / done["floor"][1])
    print(f"gateway (instant engine) calls/s / serve floor, {rounds} rounds together: {ratio:.2f} (target >= 0.80: "
          f"{'met' if ratio >= 0.8 else 'MISSED'}); per round: min {min(paired):.2f}, median "
          f"{statistics.median(paired):.2f}, max {max(paired):.2f}")
    print(f"memory per open episode after one call: {per_episode / 1024:.1f} KiB")


def start_head(temp_dir: Path, tries: int = 3) -> str:
    """A Ray head of this run's own (``ray stop`` would stop every Ray on the machine). Its raylet gives
    up when its agents take over ~15 s to start, as they do on a loaded machine: a failed start is
    stopped and tried again."""
    for attempt in range(1, tries + 1):
        port = free_port()
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}",
               "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
               f"--temp-dir={temp_dir}", "--disable-usage-stats"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, CLUSTER_ENV: str(temp_dir)})
        if done.returncode == 0:
            return f"127.0.0.1:{port}"
        stop_cluster(temp_dir)
        print(f"ray start failed (try {attempt} of {tries}): {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    raise SystemExit(f"ray start failed {tries} times; Ray's logs: {temp_dir}")


if __name__ == "__main__":
    process_auth_token()  # Ray's token auth on, with a throwaway token (never ~/.ray's)
    main()

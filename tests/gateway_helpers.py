"""Helpers shared by the gateway tests: the gateway's routes served by uvicorn on 127.0.0.1 (in the
test's own event loop, so the engine, the gateway and the clients share it), the real ``openai``
client pointed at an episode, episode contexts, and engines that say which episode they answered."""

from __future__ import annotations

import asyncio
import contextlib
import re

import openai
import uvicorn
from fastapi import FastAPI

from rayapp.episode import EpisodeContext
from rayapp.gateway.routes import gateway_router
from rayapp.gateway.service import EpisodeBinding, Gateway
from rayapp.inference.client import FinishReason, GenerateOutput
from rayapp.types import SamplingParams, StoppingCriteria

PREFIX = "/rayapp"
CALC = {"type": "function", "function": {
    "name": "calculator", "description": "arithmetic",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def episode_ctx(max_turns=8, max_context_len=None, max_new_tokens=24, **sampling):
    return EpisodeContext(0, None, StoppingCriteria(max_turns=max_turns, max_context_len=max_context_len),
                          SamplingParams(max_new_tokens=max_new_tokens, **sampling))


@contextlib.asynccontextmanager
async def served():
    """A Gateway whose routes uvicorn serves on a free 127.0.0.1 port, for as long as the block runs."""
    app = FastAPI()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2))
    task = asyncio.ensure_future(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        gateway = Gateway(f"http://127.0.0.1:{port}{PREFIX}/gateway")
        app.include_router(gateway_router(gateway), prefix=PREFIX)
        yield gateway
    finally:
        while _clients:
            await _clients.pop().close()
        server.should_exit = True
        await asyncio.wait_for(task, 30)


_clients: list[openai.AsyncOpenAI] = []  # closed when the server stops, in the loop that made them


def client(base_url: str, key: str) -> openai.AsyncOpenAI:
    made = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=120)
    _clients.append(made)
    return made


def open_episode(gateway, episode_id, engine, tok, ctx=None):
    """(client, ctx) of a newly opened episode."""
    ctx = ctx or episode_ctx()
    return client(*gateway.open(EpisodeBinding(episode_id, engine, tok, ctx))), ctx


class EchoEngine:
    """Answers with every ``secret-<n>`` its prompt holds, so a reply that reached another episode, or
    a prompt that mixed two, would show; keeps what it was asked."""

    def __init__(self, tok):
        self.tok, self.requests = tok, []

    async def info(self):
        return {}

    async def generate(self, req, timeout_s=None):
        self.requests.append(req)
        await asyncio.sleep(0.001 * (len(self.requests) % 7))  # interleave the episodes' calls
        secrets = re.findall(r"secret-\d+", self.tok.decode(req.input_ids, skip_special_tokens=True))
        ids = [*self.tok.encode("echo " + " ".join(sorted(set(secrets))), add_special_tokens=False),
               self.tok.eos_token_id]
        return GenerateOutput(req.request_id, ids, [-0.25] * len(ids), FinishReason.STOP,
                              self.tok.decode(ids, skip_special_tokens=True), len(req.input_ids), "echo", "7")


class HangingEngine:
    """Generates until aborted, as the client contract says: ``abort`` ends the request, whose output
    (finish ABORT, the tokens so far) is returned to the waiting ``generate``."""

    def __init__(self):
        self.started, self.aborted, self.running = asyncio.Event(), [], set()

    async def info(self):
        return {}

    async def generate(self, req, timeout_s=None):
        self.running.add(req.request_id)
        self.started.set()
        done = asyncio.get_running_loop().create_future()
        self._done = done
        try:
            return await done
        finally:
            self.running.discard(req.request_id)

    async def abort(self, request_id=None):
        self.aborted.append(request_id)
        self._done.set_result(GenerateOutput(request_id, [5], [-1.0], FinishReason.ABORT))
        return 1

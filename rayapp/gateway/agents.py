"""The adapter that runs an agent written against the OpenAI API as an episode (docs/agents.md).

``OpenAIAgent`` is an ``AgentHandler`` around the user's ``async def agent(client, task, sandbox)``.
For each sample it opens an episode on the manager's ``Gateway`` (its own base URL and key), hands
the agent an ``openai.AsyncOpenAI`` client pointed at them, and awaits it. Whatever happens then,
the episode is closed in ``finally``: its key stops working and a call still in flight is aborted
at the engine, so a cancelled or timed-out episode leaves nothing running (the evaluator's clock
bounds the run phase by ``timeout_s`` and classifies what it cut; the client bounds each call).

The sample's token data is what the gateway recorded, never the agent's text re-tokenised: the last
segment's ids, its mask (1 exactly on the engine's ids) and the engine's log-probs. The agent's
return value goes to the verifier: a ``str`` as the result's ``response``, anything else (plain
data) in its metadata under ``agent_output``. An agent that raised after the episode's budget
ended it (``max_turns``, ``max_context_len``: the gateway answered the call past it with an error)
is a truncated episode with that reason; any other error is the evaluator's to classify.

The OpenAI Agents SDK's tracing is switched off in the process (``OPENAI_AGENTS_DISABLE_TRACING=1``
unless the user set it): on, it would send every episode's data to OpenAI.

Its state lives in the user's code, so a cut episode cannot go on where it was (``resumable``
False: partial rollouts restart its group, and a recipe asking ``policy: resume`` is refused).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from rayapp.core.agent import AgentHandler
from rayapp.core.termination import AgentOutputError
from rayapp.envs.protocol import Engine, EngineTokenizer, Executor, Verifier, run_inline
from rayapp.episode import EpisodeContext
from rayapp.gateway.service import EpisodeBinding, EpisodeLog, Gateway
from rayapp.gateway.tool_calls import ToolParser
from rayapp.record import TerminationReason
from rayapp.types import AgentResult, Sample

__all__ = ["OpenAIAgent", "agent_result"]

TRACING_SWITCH = "OPENAI_AGENTS_DISABLE_TRACING"  # the OpenAI Agents SDK's documented environment switch
CLOSE_TIMEOUT_S = 30.0  # closing aborts the calls in flight at the engine (each abort bounded below that)
UserAgent = Callable[[Any, Sample, Any], Awaitable[Any]]


def _openai() -> Any:
    try:
        import openai
    except ImportError:
        raise RuntimeError("a gateway agent needs the openai package where the manager runs "
                           "(pip install 'rayapp[gateway]')") from None
    return openai


class OpenAIAgent(AgentHandler):
    resumable = False  # its state lives in the user's code (module docstring)

    def __init__(self, gateway: Gateway, engine: Engine, agent: UserAgent, verify: Verifier, *,
                 executor: Executor = run_inline, open_sandbox: Callable[..., Awaitable[Any]] | None = None,
                 segments: str = "last", call_timeout_s: float = 300.0,
                 tool_parser: ToolParser | None = None):
        if segments not in ("last", "each"):
            raise ValueError(f"segments: expected 'last' or 'each', got {segments!r}")
        self._client_type = _openai().AsyncOpenAI  # a missing package fails where the agent is built
        # the OpenAI Agents SDK traces by default, sending every episode's prompts and completions to
        # OpenAI; its switch, set before any episode runs here (it reads it once), unless the user set it
        os.environ.setdefault(TRACING_SWITCH, "1")
        self.gateway, self.engine, self.agent, self.verify = gateway, engine, agent, verify
        self.executor, self.open_sandbox = executor, open_sandbox
        self.segments, self.call_timeout_s, self.tool_parser = segments, call_timeout_s, tool_parser
        self._tokenizer = EngineTokenizer(engine)

    async def tokenizer(self) -> Any:
        """The engine's tokenizer (its chat template renders what the agent sends)."""
        return await self._tokenizer.get()

    async def run(self, sample: Sample, ctx: EpisodeContext) -> AgentResult:
        binding = EpisodeBinding(episode_id(sample, ctx), self.engine, await self.tokenizer(), ctx,
                                 tool_parser=self.tool_parser)
        sandbox = None
        if self.open_sandbox is not None:  # closed with the episode, however it ends
            opened = await self.open_sandbox(ctx.token)
            sandbox = ctx.keep("sandbox", opened, opened.close)
        base_url, key = self.gateway.open(binding)
        error: Exception | None = None
        try:
            async with self._client_type(base_url=base_url, api_key=key, max_retries=0,
                                         timeout=self.call_timeout_s) as client:
                value = await self.agent(client, sample, sandbox)
        except Exception as e:  # ended by its budget (below), or the evaluator's to classify
            value, error = None, e
        finally:  # on cancellation too: the key ends and the call in flight is aborted at the engine
            log = await asyncio.wait_for(self.gateway.close(binding.episode_id), CLOSE_TIMEOUT_S)
        if error is not None and log.termination is None:
            raise error
        return agent_result(log, value, self.segments, binding.episode_id)

    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]:
        if inspect.iscoroutinefunction(self.verify):  # a coroutine cannot travel to a bundle: awaited here
            return await self.verify(sample, result)
        return await self.executor(ctx.token, self.verify, sample, result)


def episode_id(sample: Sample, ctx: EpisodeContext) -> str:
    """A name for the sample's episode, unique (a random tail: a restarted group reruns the same
    sample) and readable in the gateway's URLs and logs: ``r<rollout>-<task>-<index>-<hex>``."""
    task = re.sub(r"[^A-Za-z0-9_.-]+", "_", sample.task_id)[:96]
    return f"r{ctx.rollout_id}-{task}-{sample.index}-{secrets.token_hex(4)}"


def agent_result(log: EpisodeLog, value: Any, segments: str = "last", episode: str = "") -> AgentResult:
    """The sample's token data from the episode's recorded segments (module docstring); the metadata's
    ``gateway`` entry names the ``episode`` and counts its calls and segments (and why each began); with
    ``segments`` "each" the earlier segments ride along (``gateway_segments``)."""
    if not log.segments:
        raise AgentOutputError("the gateway agent made no model call: its episode holds no tokens to train on")
    last = log.segments[-1]
    meta: dict[str, Any] = {"gateway": {"episode": episode, "calls": log.calls, "segments": len(log.segments),
                                        "reasons": {str(k): v for k, v in log.reasons.items()}}}
    if value is not None and not isinstance(value, str):
        try:
            meta["agent_output"] = msgspec.to_builtins(value)
        except (TypeError, msgspec.EncodeError) as e:
            raise AgentOutputError(f"the gateway agent returned a {type(value).__name__} the verifier cannot be "
                                   f"sent: {e} (return a str, or plain data: dict, list, numbers, strings)") from None
    if segments == "each":
        meta["gateway_segments"] = [{"tokens": s.ids, "prompt_len": s.prompt_len, "loss_mask": s.mask,
                                     "rollout_log_probs": s.logprobs, "reason": s.reason}
                                    for s in log.segments[:-1]]
    return AgentResult(tokens=list(last.ids), response_length=len(last.ids) - last.prompt_len,
                       response=value if isinstance(value, str) else "", rollout_log_probs=list(last.logprobs),
                       loss_mask=list(last.mask), turns=log.calls,
                       termination_reason=log.termination or TerminationReason.STOP,
                       truncated=log.termination is not None, metadata=meta)

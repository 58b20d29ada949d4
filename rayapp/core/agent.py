"""The handler an EvaluatorSpec binds (docs/scheduler.md §4): the agent that owns one sample's episode.

Two phases run under the one token the sample holds and share one EpisodeContext: ``run`` (the
episode, returns an AgentResult) and ``evaluate`` (the verifier, returns the reward dict). While
it runs, an agent keeps ``ctx.record`` current (``ctx.record_turn`` per model turn), so that an
abort mid-episode still reports how far it got; what it needs from run to verify (a sandbox) it
hands to ``ctx.keep``, which closes it when the episode ends.

This is the one agent protocol: the built-in agents (``rayapp.envs.agents``) subclass it, and a
plug-in agent (a recipe's ``agent``) may either subclass it or just have the two coroutine methods.
Subclassing makes the two methods abstract, so an agent that forgets one fails when it is built.
"""

from __future__ import annotations

import asyncio
import inspect
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from rayapp.episode import EpisodeContext
from rayapp.types import AgentResult, Sample


@runtime_checkable
class AgentHandler(Protocol):
    @abstractmethod
    async def run(self, sample: Sample, ctx: EpisodeContext) -> AgentResult:
        """The episode: token ids, per-token log-probs, loss mask, turns, the agent's own termination reason."""

    @abstractmethod
    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]:
        """The verifier: the reward dict, with at least ``"score"``."""


def phase_caller(fn: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """How to call ``fn`` as a phase, decided once per function (it is on every sample's path): a
    coroutine function as it is, else in a worker thread (a blocking function must not stall the
    loop, or no phase clock could stop it), awaiting what it returns when that is awaitable."""
    if inspect.iscoroutinefunction(fn):
        return fn

    async def in_thread(*args: Any) -> Any:
        value = await asyncio.to_thread(fn, *args)
        return await value if inspect.isawaitable(value) else value

    return in_thread


class FunctionAgent(AgentHandler):
    """An AgentHandler made of two plain functions (sync or async):
    ``run_fn(sample, ctx) -> AgentResult`` and ``verify_fn(sample, result) -> reward dict``."""

    def __init__(
        self,
        run_fn: Callable[[Sample, EpisodeContext], AgentResult | Awaitable[AgentResult]],
        verify_fn: Callable[[Sample, AgentResult], dict[str, float] | Awaitable[dict[str, float]]],
    ):
        self.run_fn, self.verify_fn = run_fn, verify_fn
        self._run, self._verify = phase_caller(run_fn), phase_caller(verify_fn)

    async def run(self, sample: Sample, ctx: EpisodeContext) -> AgentResult:
        return await self._run(sample, ctx)

    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]:
        return await self._verify(sample, result)

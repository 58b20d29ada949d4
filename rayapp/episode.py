"""One episode's context (docs/architecture.md "The episode record"): what the evaluator hands an agent
for one sample (``EpisodeContext``: its token, its resolved settings, the iteration's state, the
episode's record, the resources it keeps between run and verify). The record's Structs are
``rayapp.record``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from contextvars import ContextVar
from typing import Any, TypeVar

import msgspec

from rayapp.record import Actor, EpisodeRecord, Iteration, TurnRecord, WeightVersion
from rayapp.types import SamplingParams, StepKind, StoppingCriteria, Token

R = TypeVar("R")

# The episode the running code belongs to (``rollout3/math-12#0``), set by the evaluator for each
# sample's run and verify: the Ray shell names the work it starts for the sample after it (verifier
# tasks, sandbox hosts), so a person can follow a sample in the dashboard. Threads that run plain
# agent functions inherit it (``asyncio.to_thread`` copies the context).
EPISODE: ContextVar[str | None] = ContextVar("rayapp_episode", default=None)


class EpisodeContext(msgspec.Struct):
    """What the evaluator hands an agent for one sample: its token, its resolved settings, the
    episode's record, and the resources the agent keeps between the run and verify phases.

    The evaluator enters the context (``async with ctx``) around both phases and so closes what
    was kept whatever happens, cancellation included; an agent run outside an evaluator should be
    entered the same way."""

    rollout_id: int
    token: Token | None
    stopping: StoppingCriteria
    sampling: SamplingParams
    iteration: Iteration = Iteration()  # the iteration's published state (DAgger β, t_max)
    step: StepKind = StepKind.ROLLOUT
    record: EpisodeRecord = msgspec.field(default_factory=EpisodeRecord)
    _kept: dict[str, Any] = {}
    _exits: AsyncExitStack | None = None  # made by the first keep: most episodes keep nothing

    def record_turn(self, turn: int, engine: str, actor: Actor | None = None, *,
                    engine_s: float | None = None, weight_version: WeightVersion | None = None) -> None:
        """Count model turn ``turn`` as done and record who answered it, where, how long the engine
        took (``engine_s``) and with which weights (``weight_version``, as the engine reports them)."""
        self.record.turns = turn
        self.record.add_turn(self.turn_record(turn, engine, actor, engine_s=engine_s,
                                                         weight_version=weight_version))

    def turn_record(self, turn: int, engine: str, actor: Actor | None = None, *,
                    engine_s: float | None = None, weight_version: WeightVersion | None = None) -> TurnRecord:
        """The record of model turn ``turn`` (``record_turn``), without counting the turn as done."""
        where = (self.token.node, list(self.token.gpu_ids)) if self.token is not None else (None, None)
        return TurnRecord(turn, engine, *where, actor=actor, engine_s=engine_s, weight_version=weight_version)

    def keep(self, name: str, resource: R, close: Callable[[], Awaitable[Any]]) -> R:
        """Hold ``resource`` under ``name`` until the episode ends; ``close()`` is awaited then."""
        if name in self._kept:
            raise ValueError(f"episode {self.rollout_id}: a resource named {name!r} is already kept")
        self._kept[name] = resource
        if self._exits is None:
            self._exits = AsyncExitStack()
        self._exits.push_async_callback(close)
        return resource

    def kept(self, name: str) -> Any:
        """The resource kept under ``name``; KeyError when none is."""
        return self._kept[name]

    async def __aenter__(self) -> EpisodeContext:
        return self

    async def _close_kept(self) -> None:
        """Close what the agent kept. It runs as a task of its own, where a SystemExit or
        KeyboardInterrupt would stop the event loop itself: agent code's become a plain error here,
        which aborts its sample like any other."""
        try:
            await self._exits.aclose()
        except (SystemExit, KeyboardInterrupt) as e:
            raise RuntimeError(f"closing what episode {self.rollout_id} kept raised {type(e).__name__}: {e}") from e

    async def __aexit__(self, *exc: object) -> None:
        if self._exits is None:
            return
        self._kept.clear()
        # Teardown runs to its end even when the step is cancelled (again) meanwhile: its token must
        # not go back to the pool while a sandbox on it is still being closed.
        closing = asyncio.ensure_future(self._close_kept())
        cancelled = False
        while not closing.done():
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError:
                cancelled = True
        closing.result()  # a close that failed raises here
        if cancelled:
            raise asyncio.CancelledError

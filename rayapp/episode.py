"""One episode's typed record and context (spec §4): what the evaluator hands an agent for one sample
(``EpisodeContext``: its token, its resolved settings, the resources it keeps between run and verify)
and what the episode did (``EpisodeRecord``: turns with their engine, placement, timing and weight
version; the abort record; DAgger labels; the point a cut-short episode may resume from; its
timing). The spec's
metadata keys for the trainer are written from the record in one place, ``EpisodeRecord.to_metadata``.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from contextvars import ContextVar
from typing import Annotated, Any, TypeVar

import msgspec

from rayapp.types import (
    AbortReason,
    Actor,
    EpisodePhase,
    SamplingParams,
    StepKind,
    StoppingCriteria,
    TerminationReason,
    Token,
)


class Placement(msgspec.Struct):
    """The token an episode ran under: where, on which GPUs, what share of each."""

    node: str
    gpu_ids: list[int]
    gpu: float


class TurnRecord(msgspec.Struct, omit_defaults=True):
    """One model turn: which engine answered, how long the call took (``engine_s``, seconds on the
    episode's event-loop clock) and where the episode's token sat (``node`` and ``gpu_ids`` are unset
    without a token); ``actor`` only in a DAgger roll-in. ``weight_version`` names the weights that
    produced the turn (the engine's report; a partial rollout stamps the step's index where it gave
    none), so a trainer sees how stale a turn carried across steps is."""

    turn: int
    engine: str
    node: str | None = None
    gpu_ids: list[int] | None = None
    actor: Actor | None = None
    engine_s: float | None = None
    weight_version: str | None = None


class ToolReplay(msgspec.Struct, forbid_unknown_fields=True):
    """A tool call an episode made, to replay in a fresh sandbox when the episode resumes."""

    name: str
    arguments: dict[str, Any] = {}


RESUME_POINTS = "_resume_points"  # task metadata: each sample's ResumePoint (plain data) or None, by index


class DaggerLabel(msgspec.Struct):
    """The teacher's action in a state the student reached: its output for the same context."""

    turn: int
    state_len: int  # tokens of the state (the request's input ids)
    label_ids: list[int]
    text: str


class ResumePoint(msgspec.Struct, forbid_unknown_fields=True):
    """Where a cut-short episode can go on from (partial rollouts, ``policy: resume``): its token
    data after its last complete turn (the observation that followed included) and what rebuilds
    its environment, and, when the cut came mid-turn, the tokens that turn had generated
    (``partial``: the last ``partial`` of ``tokens``, with their log-probs and mask; the turn
    record of the weights that made them is the last of ``turn_records``). A resumed episode keeps
    all of these as they are and goes on with turn ``turns + 1`` from there; an agent that cannot
    rebuild its state ignores the point and starts afresh."""

    turns: int  # model turns done
    tokens: list[int]  # prompt + response so far
    prompt_len: int
    loss_mask: list[int]  # over the response so far
    rollout_log_probs: list[float]
    turn_records: list[TurnRecord] = []
    tool_calls: list[ToolReplay] = []  # the sandbox tool calls made, in order
    dagger_labels: list[DaggerLabel] = []  # a DAgger roll-in's teacher labels of the kept turns
    partial: Annotated[int, msgspec.Meta(ge=0)] = 0  # tokens of the cut turn at the end of ``tokens``

    def with_cut_turn(self, output_ids: list[int], logprobs: list[float], record: TurnRecord,
                      weight: int = 1) -> ResumePoint:
        """This point with the tokens a cut turn generated after it (loss weight ``weight``)."""
        return msgspec.structs.replace(
            self, tokens=[*self.tokens, *output_ids], loss_mask=[*self.loss_mask, *[weight] * len(output_ids)],
            rollout_log_probs=[*self.rollout_log_probs, *logprobs], turn_records=[*self.turn_records, record],
            partial=self.partial + len(output_ids))


class EpisodeTiming(msgspec.Struct, omit_defaults=True):
    """When one sample's episode waited and worked, on the evaluator's event-loop clock (seconds):
    its batch (``batch``, the scheduler's label) asked the pool (``queued``) and was granted
    (``admitted``; both unset when the batch ran ungated), the episode began on its token
    (``started``), how long its run and verify phases took (unset when it did not get through
    them) and when it ended, however it ended."""

    started: float
    batch: str | None = None
    queued: float | None = None
    admitted: float | None = None
    run_s: float | None = None
    verify_s: float | None = None
    ended: float | None = None


class AbortRecord(msgspec.Struct):
    """What a failure summary needs of an aborted episode."""

    reason: AbortReason
    phase: EpisodePhase
    window: list[float]  # [started, ended]: the evaluator's clock at the episode's start and at its abort
    elapsed_s: float
    node: str | None
    gpu_ids: list[int]
    turns: int
    error: str


class EpisodeKey(enum.StrEnum):
    """The ``Sample.metadata`` keys the trainer reads of an episode (spec §4), written only by
    ``EpisodeRecord.to_metadata``."""

    TURNS = "_turns"
    TERMINATION_REASON = "_termination_reason"  # the abort reason when aborted, else the agent's
    TERMINATION_REASON_AGENT = "_termination_reason_agent"  # the agent's, when an abort overrode it
    PLACEMENT = "_placement"
    TURN_PLACEMENT = "_turn_placement"
    TURN_ACTOR = "_turn_actor"
    DAGGER_LABELS = "_dagger_labels"
    ABORT = "_abort"
    RESUME = "_resume"  # a cut-short sample's ResumePoint (partial rollouts), and a resumed one's start
    TIMING = "_timing"  # EpisodeTiming: its batch's admission wait, its phases' durations


class EpisodeRecord(msgspec.Struct):
    """What one episode did, filled through its EpisodeContext: by the agent while it runs (turns,
    turn records, labels; kept current, so that an abort mid-episode still says how far it got)
    and by the evaluator (placement, the result's turns and reason, the abort)."""

    turns: int | None = None
    termination_reason: TerminationReason | None = None  # the agent's own
    placement: Placement | None = None
    turn_records: list[TurnRecord] = []
    dagger_labels: list[DaggerLabel] = []
    abort: AbortRecord | None = None
    resume: ResumePoint | None = None  # a resumable agent's state after its last complete turn
    timing: EpisodeTiming | None = None

    def to_metadata(self) -> dict[str, Any]:
        """The spec's metadata keys of this record (``EpisodeKey``), plain data, set ones only."""
        out: dict[str, Any] = {}
        if self.placement is not None:
            out[EpisodeKey.PLACEMENT.value] = msgspec.to_builtins(self.placement)
        if self.turns is not None:
            out[EpisodeKey.TURNS.value] = self.turns
        if self.abort is not None:
            out[EpisodeKey.TERMINATION_REASON.value] = str(self.abort.reason)
            if self.termination_reason is not None:
                out[EpisodeKey.TERMINATION_REASON_AGENT.value] = str(self.termination_reason)
            abort = msgspec.to_builtins(self.abort)
            del abort["reason"]  # carried by _termination_reason
            out[EpisodeKey.ABORT.value] = abort
        elif self.turns is not None or self.termination_reason is not None:  # the run phase is over
            reason = self.termination_reason
            out[EpisodeKey.TERMINATION_REASON.value] = None if reason is None else str(reason)
        if self.turn_records:
            out[EpisodeKey.TURN_PLACEMENT.value] = msgspec.to_builtins(self.turn_records)
            actors = [str(t.actor) for t in self.turn_records if t.actor is not None]
            if actors:
                out[EpisodeKey.TURN_ACTOR.value] = actors
        if self.dagger_labels:
            out[EpisodeKey.DAGGER_LABELS.value] = msgspec.to_builtins(self.dagger_labels)
        if self.timing is not None:  # by hand: it is on every sample, and to_builtins costs more here
            t = self.timing
            out[EpisodeKey.TIMING.value] = {k: v for k, v in (
                ("started", t.started), ("batch", t.batch), ("queued", t.queued), ("admitted", t.admitted),
                ("run_s", t.run_s), ("verify_s", t.verify_s), ("ended", t.ended)) if v is not None}
        return out


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
    iteration: dict[str, Any] = {}  # the iteration's published state (e.g. DAgger beta, t_max)
    step: StepKind = StepKind.ROLLOUT
    record: EpisodeRecord = msgspec.field(default_factory=EpisodeRecord)
    _kept: dict[str, Any] = {}
    _exits: AsyncExitStack | None = None  # made by the first keep: most episodes keep nothing

    def record_turn(self, turn: int, engine: str, actor: Actor | None = None, *,
                    engine_s: float | None = None, weight_version: str | None = None) -> None:
        """Count model turn ``turn`` as done and record who answered it, where, how long the engine
        took (``engine_s``) and with which weights (``weight_version``, as the engine names them)."""
        self.record.turns = turn
        self.record.turn_records.append(self.turn_record(turn, engine, actor, engine_s=engine_s,
                                                         weight_version=weight_version))

    def turn_record(self, turn: int, engine: str, actor: Actor | None = None, *,
                    engine_s: float | None = None, weight_version: str | None = None) -> TurnRecord:
        """The record of model turn ``turn`` (``record_turn``), without counting the turn as done."""
        where = (self.token.node, list(self.token.gpu_ids)) if self.token is not None else (None, None)
        return TurnRecord(turn, engine, *where, actor=actor, engine_s=engine_s, weight_version=weight_version or None)

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

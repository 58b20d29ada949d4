"""One batch's episodes (spec §4): created per batch, drains its queue, discarded.

Invariants it keeps:
- at most ``spec.resource.concurrency`` samples run at once (an asyncio.Semaphore);
- each running sample holds exactly one token of the batch's local pool across run AND verify,
  given back in ``finally`` whatever happens, so the batch returns every token it was granted;
- one EpisodeContext spans both phases: what the agent kept in it is closed when the episode ends,
  cancellation included, and its EpisodeRecord becomes the sample's episode metadata keys in
  every outcome but cancellation;
- a failing sample never fails the batch: it becomes an ABORTED 2-token dummy with
  ``remove_sample=True`` and a classified reason, so the trainer's batch shape stays intact;
- ``on_task_done`` fires once per task, as soon as that task's group is finished.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rayapp.core.clock import loop_time
from rayapp.core.termination import AgentTimeout, classify_abort
from rayapp.types import (
    AbortRecord,
    AgentResult,
    EpisodeContext,
    EpisodePhase,
    EvaluatorSpec,
    Placement,
    Sample,
    SamplingParams,
    Status,
    StepKind,
    StoppingCriteria,
    Task,
    TerminationReason,
    Token,
)

log = logging.getLogger(__name__)

OnTaskDone = Callable[[Task, list[Sample]], Awaitable[None] | None]

DUMMY_TOKENS = [0, 0]  # the aborted sample's stand-in: one "prompt" and one masked response token


@dataclass
class TaskRun:
    """One task run: its samples (the task's group, as the spec and the filters mean it) and the
    settings the cascade resolved for them."""

    task: Task
    samples: list[Sample]
    stopping: StoppingCriteria
    sampling: SamplingParams


async def _bounded(coro: Awaitable[Any], timeout_s: float | None, phase: EpisodePhase) -> Any:
    """Await one phase under its wall clock; running out is an AgentTimeout that says which (a
    TimeoutError the phase raised itself passes through as it is)."""
    clock = asyncio.timeout(timeout_s)
    try:
        async with clock:
            return await coro
    except TimeoutError as e:
        if clock.expired():
            raise AgentTimeout(f"{phase} phase ran past its {timeout_s}s limit") from e
        raise


def _checked(result: Any) -> AgentResult:
    """The run phase's result, its termination reason made the enum (a plain agent may give the value)."""
    if not isinstance(result, AgentResult):
        raise TypeError(f"handler.run returned {type(result).__name__}, not AgentResult")
    reason = result.termination_reason
    if reason is not None:
        try:
            result.termination_reason = TerminationReason(reason)
        except ValueError:
            raise TypeError(f"handler.run returned termination_reason {reason!r}, not one of "
                            f"{[r.value for r in TerminationReason]}") from None
    return result


def _populate_token_data(sample: Sample, result: AgentResult) -> None:
    """Copy the trainer's token data off the agent result, checking the shapes line up."""
    n = result.response_length
    if not 0 <= n <= len(result.tokens):
        raise ValueError(f"response_length {n} outside 0..{len(result.tokens)} tokens")
    loss_mask = result.loss_mask if result.loss_mask else [1] * n
    if len(loss_mask) != n:
        raise ValueError(f"loss_mask has {len(loss_mask)} entries for {n} response tokens")
    if result.rollout_log_probs and len(result.rollout_log_probs) != n:
        raise ValueError(f"rollout_log_probs has {len(result.rollout_log_probs)} entries for {n} response tokens")
    sample.tokens = list(result.tokens)
    sample.response = result.response
    sample.response_length = n
    sample.loss_mask = list(loss_mask)
    sample.rollout_log_probs = list(result.rollout_log_probs)


class Evaluator:
    def __init__(
        self,
        spec: EvaluatorSpec,
        *,
        rollout_id: int,
        tokens: list[Token] | None,
        on_task_done: OnTaskDone | None = None,
        clock: Callable[[], float] = loop_time,  # the loop's: the clock its timeouts follow
        iteration: dict[str, Any] | None = None,
        step: StepKind = StepKind.ROLLOUT,
    ):
        self.spec = spec
        self.rollout_id = rollout_id
        self.iteration, self.step = dict(iteration or {}), StepKind(step)
        self.on_task_done = on_task_done
        self.clock = clock
        self._sem = asyncio.Semaphore(max(1, spec.resource.concurrency))
        # The short-lived local pool: the batch's tokens, one handed to each running sample.
        self._local: asyncio.Queue[Token] | None = None
        if tokens is not None:
            if not tokens:
                raise ValueError(f"evaluator {spec.evaluator_id!r}: a gated batch needs at least one token")
            self._local = asyncio.Queue()
            for t in tokens:
                self._local.put_nowait(t)

    async def run(self, groups: list[TaskRun]) -> None:
        """Run every group's samples concurrently; fills the samples in place."""
        await asyncio.gather(*(self._run_group(g) for g in groups))

    async def _run_group(self, group: TaskRun) -> None:
        await asyncio.gather(*(self._execute_sample(s, group) for s in group.samples))
        if self.on_task_done is not None:
            done = self.on_task_done(group.task, group.samples)
            if inspect.isawaitable(done):
                await done

    async def _execute_sample(self, sample: Sample, group: TaskRun) -> None:
        async with self._sem:
            token = await self._local.get() if self._local is not None else None
            ctx = EpisodeContext(self.rollout_id, token, group.stopping, group.sampling, self.iteration, self.step)
            if token is not None:
                ctx.record.placement = Placement(token.node, list(token.gpu_ids), token.gpu)
            phase, started = EpisodePhase.RUN, self.clock()
            try:
                async with ctx:  # closes what the agent kept between the phases, whatever happens
                    result = _checked(await _bounded(self.spec.handler.run(sample, ctx), group.stopping.timeout_s,
                                                     phase))
                    ctx.record.turns = result.turns
                    ctx.record.termination_reason = result.termination_reason
                    sample.metadata.update(result.metadata)
                    phase = EpisodePhase.VERIFY
                    reward = await _bounded(self.spec.handler.evaluate(sample, result, ctx),
                                            self.spec.eval_timeout_s, phase)
                if not isinstance(reward, dict) or "score" not in reward:
                    raise TypeError(f"handler.evaluate returned {reward!r}, not a dict with a 'score'")
                _populate_token_data(sample, result)
                sample.reward = {k: float(v) for k, v in reward.items()}
                sample.status = Status.TRUNCATED if result.truncated else Status.COMPLETED
            except Exception as e:
                self._abort(sample, ctx, e, phase, started)
            finally:
                if self._local is not None and token is not None:
                    self._local.put_nowait(token)
            sample.metadata.update(ctx.record.to_metadata())

    def _abort(self, sample: Sample, ctx: EpisodeContext, e: Exception, phase: EpisodePhase, started: float) -> None:
        reason, ended, token = classify_abort(e), self.clock(), ctx.token
        ctx.record.abort = AbortRecord(
            reason, phase, [started, ended], round(ended - started, 3), token.node if token else None,
            list(token.gpu_ids) if token else [], ctx.record.turns or 0, f"{type(e).__name__}: {e}"[:2000])
        sample.status = Status.ABORTED
        sample.reward = {"score": 0.0}
        sample.tokens = list(DUMMY_TOKENS)
        sample.response = ""
        sample.response_length = 1
        sample.loss_mask = [0]  # zero gradient
        sample.rollout_log_probs = [0.0]
        sample.remove_sample = True
        log.warning("sample %s/%d aborted in %s phase (%s): %s", sample.task_id, sample.index, phase,
                    reason.value, ctx.record.abort.error)

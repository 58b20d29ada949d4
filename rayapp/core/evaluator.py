"""One batch's episodes (docs/scheduler.md §4): created per batch, runs its groups once, discarded.

It exists to run each sample's run and verify phases under the batch's tokens: at most
``spec.resource.concurrency`` samples at once, each holding exactly one token across both phases,
tokens reused inside the batch and, with early release, given back to the pool only once no sample
of the batch waits for one (never while their sample runs, each at most once). Invariant: a failing
sample never fails the batch; it becomes an ABORTED 2-token dummy with ``remove_sample=True`` and a
classified reason, whatever the agent raised, so the trainer's batch shape stays intact; only the
step's own cancellation ends an episode as cancelled. The contracts in full: docs/architecture.md,
"Contracts kept between the parts".
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from itertools import repeat
from typing import Any

import msgspec

from rayapp.core.agent import phase_caller
from rayapp.core.clock import loop_time
from rayapp.core.contracts import StepContext
from rayapp.core.convert import InputError, check, clip, show
from rayapp.core.deadlines import Deadlines
from rayapp.core.termination import AgentOutputError, AgentTimeout, classify_abort
from rayapp.episode import EPISODE, EpisodeContext
from rayapp.record import AbortRecord, EpisodePhase, EpisodeRecord, EpisodeTiming, Placement
from rayapp.types import (
    AgentResult,
    EvaluatorSpec,
    Sample,
    SamplingParams,
    Status,
    StepKind,
    StoppingCriteria,
    Task,
    TaskKey,
    Token,
)

log = logging.getLogger(__name__)

# Hands a finished group on by its position (the Evaluator's) or index (the step's): what it returns is
# awaited in a task of its own; None, nothing to wait for, starts no task. The step's ``run_all`` takes a
# coroutine function (a step log, ``on_task_done``) or a plain function (nothing to pass on).
GroupDone = Callable[[int], Awaitable[None] | None]
ReleaseTokens = Callable[[list[Token]], Awaitable[None]]  # the pool's release_tokens

DUMMY_TOKENS = [0, 0]  # the aborted sample's stand-in: one "prompt" and one masked response token


_ROLLOUT_ID, _EVAL_COPY = TaskKey.ROLLOUT_ID.value, TaskKey.EVAL_COPY.value


class TaskRun(msgspec.Struct, gc=False):
    """One task run: its samples (the task's group, as the spec and the filters mean it) and the
    settings the cascade resolved for them. One per group, alive for the whole step: it stays out of
    the cyclic GC's walks (it holds no cycle; nothing it holds refers back to it)."""

    task: Task
    samples: list[Sample]
    stopping: StoppingCriteria
    sampling: SamplingParams

    @staticmethod
    def samples_of(rollout_id: int, task: Task) -> list[Sample]:
        """The samples a task runs: ``n_samples`` numbered from its eval copy's first or, for the rest of
        a carried group (``Task.carried``), the ones it has left, by index, each with its resume point."""
        meta, carried = task.metadata.copy(), task.carried
        meta[_ROLLOUT_ID] = rollout_id
        if carried is None:  # the first sample takes ``meta``, each other one a copy
            first = meta.get(_EVAL_COPY, 0)
            out = [Sample(task.task_id, first, task.prompt, task.label, metadata=meta)]
            for i in range(first + 1, first + task.config.n_samples):
                out.append(Sample(task.task_id, i, task.prompt, task.label, metadata=meta.copy()))
            return out
        points = carried.points or [None] * len(carried.indices)
        if not len(carried.indices) == len(points) == task.config.n_samples:
            raise ValueError(f"task {task.task_id!r}: its carried run names {len(carried.indices)} samples and "
                             f"{len(points)} resume points for n_samples={task.config.n_samples}")
        return [Sample(task.task_id, i, task.prompt, task.label, metadata=dict(meta), episode=EpisodeRecord(start=p))
                for i, p in zip(carried.indices, points, strict=True)]


def _checked(result: Any) -> AgentResult:
    """The run phase's result put through its own type's bounds (an agent's constructor checks
    nothing): token ids that are not ints, a reason that is not a ``TerminationReason`` (a plain
    agent may give its value) abort the sample instead of reaching the trainer."""
    if not isinstance(result, AgentResult):
        raise AgentOutputError(f"handler.run returned {type(result).__name__}, not AgentResult")
    try:
        return check(result, "handler.run")
    except InputError as e:
        raise AgentOutputError(str(e)) from e


def _step_cancelled() -> bool:
    """Whether the running task was cancelled from outside (the step's cancellation, a failing
    sibling, ``complete_after``), as opposed to an agent raising ``CancelledError`` on its own."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def checked_reward(reward: Any) -> dict[str, float]:
    """The verify phase's reward dict, or an AgentOutputError naming the entry that is not a finite number
    (a bool, a string or NaN would reach the trainer as a reward)."""
    if not isinstance(reward, dict) or "score" not in reward:
        raise AgentOutputError(f"handler.evaluate returned {show(reward)}, not a dict with a 'score'")
    out: dict[str, float] = {}
    for key, value in reward.items():
        if not isinstance(key, str):
            raise AgentOutputError(f"reward key {show(key)} is not a string")
        try:
            number = math.nan if isinstance(value, bool) or not isinstance(value, int | float) else float(value)
        except OverflowError:  # an int past float's range
            number = math.nan
        if not math.isfinite(number):
            raise AgentOutputError(f"reward[{clip(repr(key))}]: expected a finite number, got {show(value)}")
        out[key] = number
    return out


def _populate_token_data(sample: Sample, result: AgentResult) -> None:
    """Copy the trainer's token data off the agent result, checking the shapes line up."""
    n = result.response_length
    if not 0 <= n <= len(result.tokens):
        raise AgentOutputError(f"response_length {n} outside 0..{len(result.tokens)} tokens")
    loss_mask = result.loss_mask if result.loss_mask else [1] * n
    if len(loss_mask) != n:
        raise AgentOutputError(f"loss_mask has {len(loss_mask)} entries for {n} response tokens")
    if result.rollout_log_probs and len(result.rollout_log_probs) != n:
        raise AgentOutputError(f"rollout_log_probs has {len(result.rollout_log_probs)} entries for {n} response tokens")
    sample.tokens = list(result.tokens)
    sample.response = result.response
    sample.response_length = n
    sample.loss_mask = list(loss_mask)
    sample.rollout_log_probs = list(result.rollout_log_probs)


def _notifier(tg: asyncio.TaskGroup, done: GroupDone | None) -> Callable[[int], None]:
    """``finished(k)``: ``done(k)``, and what it returns awaited in a task of ``tg`` (a task per
    group only where there is something to wait for: most steps hand nothing on)."""
    def finished(k: int) -> None:
        if done is not None and (pending := done(k)) is not None:
            tg.create_task(pending)

    return finished


class Evaluator:
    """Runs one batch's groups (``run``) with at most ``spec.resource.concurrency`` samples at once.

    ``tokens`` is the batch's grant (None: ungated). ``release`` (the pool's ``release_tokens``)
    turns on early release: a token no sample of the batch can use any more goes back to the
    global pool at once instead of when the batch closes; without it every token stays in the
    local pool until ``run`` returns (the spec's hold-until-the-batch-ends)."""

    def __init__(self, spec: EvaluatorSpec, step: StepContext, *, tokens: list[Token] | None = None,
                 release: ReleaseTokens | None = None, batch: str | None = None,
                 admission: tuple[float, float] | None = None):
        """``step``: the step's own values (kind, rollout id, iteration), one object for all its
        batches; the rest is this batch's: its grant, the pool's early release, its label and when
        it was admitted."""
        self.spec = spec
        self._run_phase, self._verify_phase = phase_caller(spec.handler.run), phase_caller(spec.handler.evaluate)
        self.batch = batch  # the scheduler's label of the batch, recorded in each sample's timing
        self.admission = admission  # when the batch asked the pool and when it was granted (loop clock)
        self.rollout_id = step.rollout_id
        self.iteration, self.step = step.iteration, StepKind(step.kind)
        self._episode_prefix = f"{self.step.value}{self.rollout_id}/"  # each episode's log label starts so
        self.release = release
        self._concurrency = max(1, spec.resource.concurrency)
        self._deadlines = Deadlines()  # every phase's time limit, on one loop timer
        self._returning: list[Token] = []  # tokens on their way back to the pool (early release)
        self._ran = False
        # The short-lived local pool: the batch's tokens, one handed to each running sample.
        # Nothing ever waits on it (run() starts no more workers than tokens), so a plain deque.
        self._local: deque[Token] | None = None
        if tokens is not None:
            if not tokens:
                raise ValueError(f"evaluator {spec.evaluator_id!r}: a gated batch needs at least one token")
            self._local = deque(tokens)

    async def run(self, groups: list[TaskRun], done: GroupDone | None = None) -> None:
        """Run every group's samples, filling them in place; once group ``k`` (its position in
        ``groups``) finished, ``done(k)`` is called and what it returns awaited in a task of its own,
        so that no token idles while it runs. A callback that raises cancels the batch's
        samples and propagates once they have ended.

        Workers, at most as many as may run at once (the least of the concurrency ceiling, the
        batch's tokens and its samples), take the samples in order, each holding one token across
        them: a token is reused inside the batch while samples wait for one, and no semaphore,
        token queue or task per sample is needed. One batch, one run: a second call is refused."""
        if self._ran:  # its tokens may be back in the global pool, or held by the first run's workers
            raise RuntimeError(f"evaluator {self.spec.evaluator_id!r}: run() once per batch; make a new Evaluator")
        self._ran = True
        queue: deque[tuple[Sample, int]] = deque()  # samples waiting for a token, with their group's position
        for k, g in enumerate(groups):
            queue.extend(zip(g.samples, repeat(k)))
        left = [len(g.samples) for g in groups]
        workers = min(self._concurrency, len(queue))
        local = self._local
        if local is not None:
            workers = min(workers, len(local))
            if self.release is not None and len(local) > workers:  # tokens no sample can ever use
                await self._release([local.popleft() for _ in range(len(local) - workers)])
        try:
            async with asyncio.TaskGroup() as tg:
                finished = _notifier(tg, done)

                async def spawn() -> None:
                    # Runs once the first worker first waits (or is done): the other workers start then, one
                    # per sample still waiting, so samples that end without ever waiting need no task
                    # of their own; the tokens no worker will take are of no use to the batch.
                    n = min(workers - 1, len(queue))
                    for _ in range(n):
                        tg.create_task(self._work(queue, groups, left, finished))
                    if self.release is not None and local is not None and len(local) > n:
                        await self._release_early([local.popleft() for _ in range(len(local) - n)])

                for k in [k for k, n in enumerate(left) if n == 0]:  # an empty group is finished at once
                    finished(k)
                # Every worker is a task of the group, none runs in this one: a cancellation reaches
                # them all at once, not only after this task's own sample finished tearing down.
                if workers:
                    tg.create_task(self._work(queue, groups, left, finished))
                if workers > 1:
                    tg.create_task(spawn())
        finally:
            self._deadlines.idle()

    async def _work(self, queue: deque[tuple[Sample, int]], groups: list[TaskRun], left: list[int],
                    finished: Callable[[int], None]) -> None:
        local = self._local
        token = local.popleft() if local is not None else None  # run() starts no more workers than tokens
        try:
            while queue:
                sample, k = queue.popleft()
                await self._execute_sample(sample, groups[k], token)
                if _step_cancelled():  # an agent swallowed the cancellation: the batch still ends here
                    raise asyncio.CancelledError
                left[k] -= 1
                if left[k] == 0:
                    finished(k)
        except BaseException:  # cancelled: the token stays in the batch, which closes whole
            if token is not None:
                local.append(token)
            raise
        if token is not None:  # its last sample ended and none waits for a token
            if self.release is not None:
                await self._release_early([token])
            else:
                local.append(token)

    async def _release_early(self, tokens: list[Token]) -> None:
        """Back to the global pool now, with the others that end in the same pass of the loop: the
        first to return some waits that pass out and gives back all of them in one call."""
        first = not self._returning
        self._returning += tokens
        if not first:
            return
        try:
            await asyncio.sleep(0)
        finally:  # cancelled: the tokens stay in the batch, which closes whole
            tokens, self._returning = self._returning, []
        await self._release(tokens)

    async def _release(self, tokens: list[Token]) -> None:
        """Early release; a release that fails leaves the tokens to the batch's close (``release_batch``
        gives back whatever the batch still holds), so a pool hiccup never fails a sample."""
        try:
            await self.release(tokens)
        except Exception as e:
            log.warning("early release of %d tokens failed (they go back when the batch closes): %s: %s",
                        len(tokens), type(e).__name__, e)

    async def _bounded(self, coro: Awaitable[Any], timeout_s: float | None, phase: EpisodePhase) -> Any:
        """Await one phase under its wall clock; running out is an AgentTimeout that says which (a
        TimeoutError the phase raised itself passes through as it is). No limit arms no timer."""
        if timeout_s is None:
            return await coro
        limit = self._deadlines.limit(timeout_s)
        try:
            with limit:
                return await coro
        except TimeoutError as e:
            if limit.expired:
                raise AgentTimeout(f"{phase} phase ran past its {timeout_s}s limit") from e
            raise

    async def _execute_sample(self, sample: Sample, group: TaskRun, token: Token | None) -> None:
        ctx = EpisodeContext(self.rollout_id, token, group.stopping, group.sampling, self.iteration, self.step,
                             sample.episode)
        if token is not None:
            ctx.record.placement = Placement(token.node, token.gpu_ids, token.gpu)
        now = asyncio.get_running_loop().time  # core.clock's loop_time, looked up once
        phase, started = EpisodePhase.RUN, now()
        timing = ctx.record.timing = EpisodeTiming(started, self.batch, *(self.admission or ()))
        episode = EPISODE.set(f"{self._episode_prefix}{sample.task_id}#{sample.index}")
        try:
            async with ctx:  # closes what the agent kept between the phases, whatever happens
                limit = group.stopping.timeout_s
                run = self._run_phase(sample, ctx)
                result = _checked(await run if limit is None else await self._bounded(run, limit, phase))
                ctx.record.turns = result.turns
                ctx.record.termination_reason = result.termination_reason
                if result.metadata:
                    sample.metadata.update(result.metadata)
                phase, timing.run_s = EpisodePhase.VERIFY, now() - started
                verify = self._verify_phase(sample, result, ctx)
                reward = await self._bounded(verify, self.spec.eval_timeout_s, phase)
                timing.verify_s = now() - started - timing.run_s
            _populate_token_data(sample, result)
            sample.reward = checked_reward(reward)
            sample.status = Status.TRUNCATED if result.truncated else Status.COMPLETED
        except BaseException as e:  # agent code may raise anything: only the step's cancellation ends the step
            timing.ended = now()
            if not _step_cancelled():
                self._abort(sample, ctx, e, phase, started)
            else:  # the step went on without it (complete_after) or failed: how far it got stays in
                # its record, with where a resumable agent can go on from
                if isinstance(e, asyncio.CancelledError):
                    raise
                raise asyncio.CancelledError from e  # an agent that turned the cancellation into another error
        else:
            timing.ended = now()
        finally:
            EPISODE.reset(episode)
        ctx.record.resume = None  # it ended: there is nothing to go on from

    def _abort(self, sample: Sample, ctx: EpisodeContext, e: BaseException, phase: EpisodePhase,
               started: float) -> None:
        reason, ended, token = classify_abort(e), loop_time(), ctx.token
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

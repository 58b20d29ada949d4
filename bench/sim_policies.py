"""Policies run through the real core: ``TaskScheduler`` + ``Evaluator`` + ``PlacementPool`` in
virtual time, with agents that sleep their trace's turns and verify.

A policy is a row of ``POLICIES``: the ``SchedulerConfig`` fields it sets, its batching strategy,
and for partial rollouts the ``PartialConfig`` its steps run under (``steps.partial``). A field
this scheduler does not have is dropped (so a policy that only restates today's default still
runs), unless the policy ``needs`` it; then the policy is skipped and the table says so.

Partial rollouts carry long episodes into later steps, where they overlap: the per-step lower
bound (summed) does not bound them, and their "÷ LB" can be under 1; the whole run taken as one
step (total demand, the longest episode) still bounds them.

What the pool really held is measured, not assumed: ``MeteredPool`` wraps it and integrates the
GPU share of the tokens held over virtual time; the agents integrate the share of the samples that
are working. Their ratio is the share of reserved capacity that did work; work a partial step
threw away is counted as wasted, not as work: what a sample cut short did since its last resume
point, and all an earlier run of a sample did once the sample starts afresh (``restart``, which
runs a carried group whole again, or a group past ``max_staleness``). Under ``resume`` a carried
group keeps the samples that ended: they do not run again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sim_workloads import GPUS_PER_NODE, GROUP, PER_SAMPLE, TaskTrace, layout

from rayapp.core.agent import FunctionAgent
from rayapp.core.batching import BatchingStrategy, fifo_batching, longest_first_batching
from rayapp.core.clock import loop_time, run_virtual
from rayapp.core.contracts import SchedulerConfig
from rayapp.core.pool import PlacementPool
from rayapp.core.scheduler import TaskScheduler
from rayapp.record import ResumePoint, TurnRecord
from rayapp.steps.partial import PartialConfig, PartialRollouts
from rayapp.types import AgentResult, BatchRequest, EvaluatorSpec, Resource, Status, Task, TaskConfig, Token


@dataclass(frozen=True)
class Policy:
    name: str
    config: dict[str, Any] = field(default_factory=dict)  # SchedulerConfig fields it sets
    batching: BatchingStrategy = fifo_batching
    needs: tuple[str, ...] = ()  # SchedulerConfig fields without which it cannot run
    # "hold": the bench's own copy of the spec's release (a batch's tokens go back only when it
    # closes), which left the product: MeteredPool frees nothing early then. "early": the scheduler's.
    release: str = "early"
    partial: dict[str, Any] | None = None  # PartialConfig fields: its steps are partial rollouts


POLICIES: tuple[Policy, ...] = (
    Policy("hold FIFO", release="hold"),
    Policy("early FIFO"),
    Policy("longest-first, noisy", batching=longest_first_batching),
    Policy("partial (restart)", partial={"over_provision": 1.25, "max_staleness": 1, "policy": "restart"}),
    Policy("partial (resume)", partial={"over_provision": 1.25, "max_staleness": 1, "policy": "resume"}),
)


def supported(policy: Policy) -> bool:
    return all(f in SchedulerConfig.__struct_fields__ for f in policy.needs)


@dataclass
class Run:
    """One policy over every step of one workload on one cluster. Seconds are virtual."""

    policy: str
    release: str
    makespan: float  # the steps' makespans, summed (each step waits for its last group)
    work_gpu_s: float  # GPU share x seconds that samples spent running or verifying (wasted work included)
    held_gpu_s: float  # GPU share x seconds reserved for the policy
    capacity_gpu: float
    samples: int
    wall_s: float  # real seconds the simulation took (its own cost; not a result)
    returned_once: bool = True  # every sample came back exactly once
    pool_restored: bool = True  # the pool ended as it started
    timeline: list[tuple[float, float, float]] | None = None  # (t, held GPUs, working GPUs)
    wasted_gpu_s: float = 0.0  # of work_gpu_s, what partial rollouts threw away (module docstring)

    @property
    def reserved_busy(self) -> float:
        return (self.work_gpu_s - self.wasted_gpu_s) / self.held_gpu_s if self.held_gpu_s else 0.0

    @property
    def cluster_busy(self) -> float:
        return self.work_gpu_s / (self.capacity_gpu * self.makespan) if self.makespan else 0.0


def _gpus(tokens: list[Token]) -> float:
    return sum(t.gpu * len(t.gpu_ids) for t in tokens)


class Meter:
    """Integrates held and working GPU share over the loop's (virtual) clock."""

    def __init__(self, record: bool = False) -> None:
        self.held = self.busy = self.held_area = self.busy_area = self.wasted = 0.0
        self.last = 0.0
        self.timeline: list[tuple[float, float, float]] | None = [] if record else None

    def change(self, held: float = 0.0, busy: float = 0.0) -> None:
        now = loop_time()
        self.held_area += self.held * (now - self.last)
        self.busy_area += self.busy * (now - self.last)
        self.last = now
        self.held += held
        self.busy += busy
        if self.timeline is not None:  # one point per instant: its state once every change at it is done
            if self.timeline and self.timeline[-1][0] == now:
                self.timeline.pop()
            self.timeline.append((now, self.held, self.busy))


class MeteredPool:
    """The scheduler's Pool protocol over a ``PlacementPool``, metering the tokens it holds. Tokens
    given back early (``release_tokens``) stop counting then; ``release_batch`` stops the rest.
    ``hold``: free nothing early (the spec's release, kept here to measure against)."""

    def __init__(self, pool: PlacementPool, meter: Meter, hold: bool = False) -> None:
        self.pool, self.meter, self.hold = pool, meter, hold
        self._held: set[int] = set()

    async def acquire_batch(self, request: BatchRequest) -> list[Token]:
        tokens = await self.pool.acquire_batch(request)
        self._held.update(t.token_id for t in tokens)
        self.meter.change(held=_gpus(tokens))
        return tokens

    async def release_tokens(self, tokens: list[Token]) -> None:
        if self.hold:
            return
        await self.pool.release_tokens(tokens)
        self._held.difference_update(t.token_id for t in tokens)
        self.meter.change(held=-_gpus(tokens))

    async def release_batch(self, tokens: list[Token]) -> None:
        left = [t for t in tokens if t.token_id in self._held]
        try:
            await self.pool.release_batch(tokens)
        finally:
            self._held.difference_update(t.token_id for t in left)
            self.meter.change(held=-_gpus(left))

    async def max_tokens_for(self, per_sample: Resource) -> int:
        return await self.pool.max_tokens_for(per_sample)

    def __getattr__(self, name: str) -> Any:  # anything else the scheduler may ask of a pool
        return getattr(self.pool, name)


def _resume_from(sample) -> tuple[int, float]:
    """Where a carried sample goes on from (partial rollouts, ``policy: resume``), by the resume
    point its record starts from: the turns it did, and the engine seconds its cut turn had done
    (the record of that turn, as a real agent keeps the cut turn's tokens); (0, 0) when it starts
    afresh."""
    point = sample.episode.start
    if point is None:
        return 0, 0.0
    cut = [r.engine_s or 0.0 for r in point.turn_records if r.turn == point.turns + 1]
    return point.turns, sum(cut)


async def _engine_turn(ctx, turn: int, engine_s: float, done_s: float, keep: Callable[[], None]) -> None:
    """The engine's part of a turn, ``done_s`` of it done before a cut. Cut again, the engine
    aborts the request and what it made is kept (``keep()``), as the real agents keep the cut
    turn's tokens."""
    started = loop_time()
    try:
        await asyncio.sleep(engine_s - done_s)
    except asyncio.CancelledError:
        made = done_s + loop_time() - started
        ctx.record.resume = ResumePoint(turn - 1, [], 0, [], [], [TurnRecord(turn, "sim", engine_s=made)])
        keep()
        raise
    ctx.record_turn(turn, "sim", engine_s=engine_s)


def _spec(batch_tasks: int, traces: dict[str, TaskTrace], meter: Meter, runs: Counter) -> EvaluatorSpec:
    """An EvaluatorSpec whose budget admits a whole batch at once; its agent sleeps the trace. Like
    the real agents, it keeps a resume point after each turn but the last (the turn and the tool
    call that followed it) and one in a turn cut while the engine worked (what the engine made is
    kept), and a sample handed one goes on from there. Cut in a tool call or in verify, what it did
    since its last point is lost (the real agents cannot keep a half-run tool call either)."""
    share = PER_SAMPLE.gpu
    since: dict[tuple[str, int], float] = {}  # when the work not yet kept began (start, or the last point)
    kept: dict[tuple[str, int], float] = {}  # GPU share x s of a sample's work its resume point keeps

    def keep(key: tuple[str, int]) -> None:
        kept[key] = kept.get(key, 0.0) + share * (loop_time() - since[key])
        since[key] = loop_time()

    async def run_fn(sample, ctx) -> AgentResult:
        key = (sample.task_id, sample.index)
        trace = traces[key[0]].samples[key[1]]
        runs[key] += 1
        done, done_s = _resume_from(sample)
        if not done and not done_s:  # afresh: whatever an earlier run of it did is thrown away
            meter.wasted += kept.pop(key, 0.0)
        since[key] = loop_time()
        meter.change(busy=share)
        try:
            for turn, (engine_s, tool_s) in enumerate(trace.turns[done:], done + 1):
                await _engine_turn(ctx, turn, engine_s, done_s if turn == done + 1 else 0.0, lambda: keep(key))
                if tool_s:
                    await asyncio.sleep(tool_s)
                if turn < len(trace.turns):
                    ctx.record.resume = ResumePoint(turn, [], 0, [], [])
                    keep(key)
        except asyncio.CancelledError:
            cut_short(key)
            raise
        return AgentResult(tokens=[1, 2], response_length=1, turns=len(trace.turns))

    def cut_short(key: tuple[str, int]) -> None:  # a partial step went on without it: unkept work is wasted
        meter.change(busy=-share)
        meter.wasted += share * (loop_time() - since[key])

    async def verify_fn(sample, result) -> dict[str, float]:
        key = (sample.task_id, sample.index)
        try:
            await asyncio.sleep(traces[key[0]].samples[key[1]].verify_s)
        except asyncio.CancelledError:
            cut_short(key)
            raise
        keep(key)
        meter.change(busy=-share)
        return {"score": 1.0}

    n = batch_tasks * GROUP
    budget = Resource(gpu=share * n, concurrency=n, cpu=PER_SAMPLE.cpu * n, memory_gb=PER_SAMPLE.memory_gb * n)
    return EvaluatorSpec("sim", FunctionAgent(run_fn, verify_fn), batch_size=batch_tasks, resource=budget,
                         run_resource=PER_SAMPLE)


def check_returned_once(steps: list[list[TaskTrace]], groups: list[list[list[Any]]], runs: Counter, *,
                        restarts: bool = False) -> bool:
    """Every sample of every step ran once (at least once with ``restarts``: a partial step cut it
    short) and came back once, completed."""
    want = Counter((t.task_id, i) for step in steps for t in step for i in range(len(t.samples)))
    got = Counter((s.task_id, s.index) for step in groups for g in step for s in g)
    completed = all(s.status is Status.COMPLETED for step in groups for g in step for s in g)
    ran = set(runs) == set(want) if restarts else runs == want
    return completed and got == want and ran


def run_policy(policy: Policy, steps: list[list[TaskTrace]], nodes: int, batch_tasks: int, *,
               timeline: bool = False) -> Run:
    """``policy`` over ``steps`` (one list of tasks per rollout step) on ``nodes`` x 8 GPUs."""
    pool = PlacementPool(layout(nodes))
    before = pool.snapshot()
    meter = Meter(record=timeline)
    runs: Counter = Counter()
    traces = {t.task_id: t for step in steps for t in step}
    fields = SchedulerConfig.__struct_fields__
    config = SchedulerConfig(rollout_batch_size=len(steps[0]), progress=False,
                             **{k: v for k, v in policy.config.items() if k in fields})
    stream = [t for step in steps for t in step]  # the steps' tasks, in order; each step takes what it asks for

    class Source:
        async def get_tasks(self, n: int) -> list[Task]:
            taken, stream[:n] = stream[:n], []
            return [Task(t.task_id, "", TaskConfig("sim", n_samples=len(t.samples), expected_len=t.expected_len))
                    for t in taken]

    metered = MeteredPool(pool, meter, hold=policy.release == "hold")
    sched = TaskScheduler([_spec(batch_tasks, traces, meter, runs)], Source(), metered, config,
                          batching_strategy=policy.batching)
    # partial steps start more groups than they return; the last one drains what is left (the stream ends)
    rollouts = PartialRollouts.over(sched, PartialConfig(**policy.partial)) if policy.partial else sched

    async def main() -> list[list[list[Any]]]:
        out = []
        for i in range(len(steps)):
            out.append((await rollouts.execute_rollout(i)).groups)
        meter.change()
        return out

    wall = time.perf_counter()
    groups = run_virtual(main())
    wall = time.perf_counter() - wall
    release = "batch_end" if policy.release == "hold" else "early"
    return Run(policy.name, release, meter.last, meter.busy_area, meter.held_area,
               nodes * float(GPUS_PER_NODE), sum(len(t.samples) for t in traces.values()), wall,
               returned_once=check_returned_once(steps, groups, runs, restarts=policy.partial is not None),
               pool_restored=pool.snapshot() == before and not pool.batches(), timeline=meter.timeline,
               wasted_gpu_s=meter.wasted)

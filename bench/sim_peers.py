"""Baselines on the same traces and the same capacity: the lower bound, the per-sample FIFO list
schedule, and models of two peers' rollout loops run through the same virtual clock.

* ``lower_bound``: per step, the larger of total GPU work / GPU capacity and the longest episode.
* ``list_schedule``: each sample, in FIFO order, takes a slot as soon as one frees (computed, no loop).
* ``slime_model``: one global semaphore of N concurrent samples (N = what the cluster holds), as
  slime's rollout bounds its generate calls.
* ``verl_model``: the step's samples cut up front into equal contiguous chunks, one per worker (one
  worker per node here), each running its chunk with its own share of the slots, as verl's agent
  loop splits a batch over its workers.

The peers hold their engines for the whole step, so their reserved capacity is the cluster times
the makespan.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from itertools import pairwise

from sim_policies import Run
from sim_workloads import GPUS_PER_NODE, PER_SAMPLE, SLOTS_PER_NODE, SampleTrace, TaskTrace

from rayapp.core.clock import loop_time, run_virtual


def _flat(step: list[TaskTrace]) -> list[SampleTrace]:
    return [s for t in step for s in t.samples]


def lower_bound(steps: list[list[TaskTrace]], nodes: int) -> float:
    capacity = nodes * GPUS_PER_NODE
    total = 0.0
    for step in steps:
        durations = [s.duration for s in _flat(step)]
        total += max(sum(durations) * PER_SAMPLE.gpu / capacity, max(durations))
    return total


def list_schedule(steps: list[list[TaskTrace]], nodes: int) -> float:
    """The steps' per-sample FIFO list-schedule makespans, summed."""
    slots = nodes * SLOTS_PER_NODE
    total = 0.0
    for step in steps:
        free = [0.0] * min(slots, len(_flat(step)))  # when each slot frees; a heap
        start = end = 0.0
        for s in _flat(step):
            start = max(start, free[0])  # FIFO: never before the sample ahead of it
            finish = start + s.duration
            heapq.heapreplace(free, finish)
            end = max(end, finish)
        total += end
    return total


async def _play(sample: SampleTrace) -> None:
    for engine_s, tool_s in sample.turns:
        await asyncio.sleep(engine_s)
        if tool_s:
            await asyncio.sleep(tool_s)
    await asyncio.sleep(sample.verify_s)


async def _bounded(samples: list[SampleTrace], limit: int) -> None:
    sem = asyncio.Semaphore(limit)

    async def one(sample: SampleTrace) -> None:
        async with sem:
            await _play(sample)

    await asyncio.gather(*(one(s) for s in samples))


def _run(name: str, steps: list[list[TaskTrace]], nodes: int, step_fn) -> Run:
    async def main() -> float:
        for step in steps:
            await step_fn(_flat(step))
        return loop_time()

    wall = time.perf_counter()
    makespan = run_virtual(main())
    wall = time.perf_counter() - wall
    capacity = nodes * float(GPUS_PER_NODE)
    work = sum(s.duration for step in steps for s in _flat(step)) * PER_SAMPLE.gpu
    return Run(name, "step_end", makespan, work, capacity * makespan, capacity,
               sum(len(_flat(step)) for step in steps), wall)


def slime_model(steps: list[list[TaskTrace]], nodes: int) -> Run:
    return _run("slime: global semaphore", steps, nodes, lambda samples: _bounded(samples, nodes * SLOTS_PER_NODE))


def verl_model(steps: list[list[TaskTrace]], nodes: int) -> Run:
    async def chunks(samples: list[SampleTrace]) -> None:
        size, extra = divmod(len(samples), nodes)
        cuts = [0]
        for w in range(nodes):
            cuts.append(cuts[-1] + size + (w < extra))
        await asyncio.gather(*(_bounded(samples[a:b], SLOTS_PER_NODE) for a, b in pairwise(cuts)))

    return _run("verl: static chunks", steps, nodes, chunks)

"""In-process overhead of a rollout step: samples per second with a no-op agent.

A full ``TaskScheduler.execute_rollout`` (fetch, distribute, batch, admission through the core
``PlacementPool``, one Evaluator per batch with early release, callbacks, metrics) over an agent
that returns a fixed ``AgentResult`` at once (a coroutine that never waits), against a bare
``asyncio.gather`` of the same agent's run + evaluate calls for the same number of samples; both
measured in the same run, best of ``--rounds``, and the ratio printed. The no-op row is the target
(>= 30k samples/s, <= 3x the gather). Its samples never wait on the loop, so the Evaluator's first
worker runs them all and starts no task per sample; a second row with an agent that waits on the
loop once per episode, as every real one does, shows the step with one task per sample (its
concurrency here is the whole batch). The run sweeps the shapes users run, groups of 1 to 16 in
small and large batches, and prints the worst shape last: the target holds only if it holds there.
Figures only; nothing here asserts on time (``tests/test_bench_smoke.py`` runs ``--smoke``, seconds
long, to see that it runs).

Run from the repo root: ``.venv/bin/python bench/overhead.py [--samples N] [--groups G ...]
[--batch-samples B ...] [--rounds R]``; ``--profile`` prints the top functions (cProfile) of one
scheduler run (the first group and batch size) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayapp.core.agent import FunctionAgent
from rayapp.core.pool import PlacementPool
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.types import AgentResult, EvaluatorSpec, NodeSpec, Resource, Sample, Task, TaskConfig

RESULT = AgentResult(tokens=[1, 2, 3], response_length=1, response="4", rollout_log_probs=[-0.5],
                     loss_mask=[1], termination_reason="stop")
REWARD = {"score": 1.0}
PER_SAMPLE = Resource(cpu=0.125)  # so each sample holds a real token of the pool


# Coroutines that never wait: a plain function would run in a worker thread (so that one that
# blocks keeps its time limit), which is a cost of blocking code, not of the scheduler.
async def _run(sample: Sample, ctx: object) -> AgentResult:
    return RESULT


async def _run_yielding(sample: Sample, ctx: object) -> AgentResult:
    await asyncio.sleep(0)
    return RESULT


async def _verify(sample: Sample, result: AgentResult) -> dict[str, float]:
    return REWARD


AGENTS = {"no-op": FunctionAgent(_run, _verify), "yields once": FunctionAgent(_run_yielding, _verify)}


class Source:
    def __init__(self, tasks: list[Task]):
        self.tasks = tasks

    async def get_tasks(self, n: int) -> list[Task]:
        return self.tasks[:n]


def make_scheduler(agent: FunctionAgent, n_tasks: int, group: int, batch_tasks: int) -> TaskScheduler:
    tasks = [Task(f"t{i}", "p", TaskConfig("noop", n_samples=group), label="4") for i in range(n_tasks)]
    tokens = batch_tasks * group
    spec = EvaluatorSpec("noop", agent, batch_size=batch_tasks, run_resource=PER_SAMPLE,
                         resource=Resource(concurrency=tokens, cpu=tokens * PER_SAMPLE.cpu))
    # room for two batches at once, so admission waits and wakes as in a real step
    pool = PlacementPool({"n0": NodeSpec(cpu=2 * tokens * PER_SAMPLE.cpu, memory_gb=64)})
    return TaskScheduler([spec], Source(tasks), pool, SchedulerConfig(rollout_batch_size=n_tasks, progress=False))


async def bare(agent: FunctionAgent, n_samples: int) -> None:
    samples = [Sample("t", i, "p", "4") for i in range(n_samples)]

    async def one(s: Sample) -> None:
        result = await agent.run(s, None)
        await agent.evaluate(s, result, None)

    await asyncio.gather(*(one(s) for s in samples))


async def scheduled(sched: TaskScheduler) -> int:
    result = await sched.execute_rollout(0)
    return sum(map(len, result.groups))


def timed(coro) -> float:
    """Seconds to ``asyncio.run(coro)``, from a collected heap."""
    gc.collect()
    start = time.perf_counter()
    asyncio.run(coro)
    return time.perf_counter() - start


def measure(agent: FunctionAgent, n_tasks: int, group: int, batch_tasks: int, rounds: int) -> tuple[float, float]:
    """Best of ``rounds`` for each, in samples/s: (scheduler, bare gather), alternating."""
    n = n_tasks * group
    best_sched = best_bare = float("inf")
    for _ in range(rounds):
        sched = make_scheduler(agent, n_tasks, group, batch_tasks)
        best_sched = min(best_sched, timed(scheduled(sched)))
        best_bare = min(best_bare, timed(bare(agent, n)))
    return n / best_sched, n / best_bare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=65536, help="samples per run")
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 4, 8, 16], help="samples per task")
    ap.add_argument("--batch-samples", type=int, nargs="+", default=[64, 4096], help="samples per batch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run (tests)")
    ap.add_argument("--profile", action="store_true", help="cProfile the scheduler run")
    args = ap.parse_args()
    if args.smoke:
        args.samples, args.groups, args.batch_samples, args.rounds = 2048, [1, 16], [64], 1
    if args.profile:
        group, batch = args.groups[0], args.batch_samples[0]
        sched = make_scheduler(AGENTS["no-op"], max(1, args.samples // group), group, max(1, batch // group))
        prof = cProfile.Profile()
        prof.runcall(asyncio.run, scheduled(sched))
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    print(f"{args.samples} samples a run, best of {args.rounds}; ratio: bare asyncio.gather samples/s over the "
          "TaskScheduler's")
    print(f"{'agent':13}{'group':>6}{'batch':>7}{'TaskScheduler/s':>17}{'bare gather/s':>15}{'ratio':>8}")
    worst: dict[str, tuple[float, str]] = {}
    for name, agent in AGENTS.items():
        for group in args.groups:
            for batch in args.batch_samples:
                n_tasks, batch_tasks = max(1, args.samples // group), max(1, batch // group)
                sched_rate, bare_rate = measure(agent, n_tasks, group, batch_tasks, args.rounds)
                print(f"{name:13}{group:>6}{batch_tasks * group:>7}{sched_rate:>17,.0f}{bare_rate:>15,.0f}"
                      f"{bare_rate / sched_rate:>7.2f}x", flush=True)
                shape = f"groups of {group}, {batch_tasks * group} samples a batch"
                worst[name] = min(worst.get(name, (sched_rate, shape)), (sched_rate, shape))
    for name, (rate, shape) in worst.items():
        print(f"worst for {name}: {rate:,.0f} samples/s ({shape})")


if __name__ == "__main__":
    main()

"""`make demo`: one rollout step and one eval step of the built-in arithmetic task, through the
whole core path (fetch -> distribute -> batch -> admit -> run -> verify), in one process.

The placement pool is a two-node layout with logical GPUs; every sample holds a quarter GPU, so
the placement printed shows fractional sharing and the spread across nodes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections import Counter

from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.envs.arithmetic import ArithmeticSource, arithmetic_spec
from rayapp.record import Placement
from rayapp.types import Sample, StoppingCriteria, Task

DEMO_LAYOUT = '{"node-a": [0, 1], "node-b": {"gpus": [0, 1], "cpu": 8, "memory_gb": 32}}'


def _line(s: Sample) -> str:
    where = s.episode.placement or Placement("-", (), 0.0)
    gpus = ",".join(map(str, where.gpu_ids))
    return (f"  {s.task_id}#{s.index}  {s.status.value:<9} score={s.reward.get('score', 0):.0f}  "
            f"tokens={len(s.tokens):>2} loss_mask_sum={sum(s.loss_mask):>2}  "
            f"placed on {where.node} gpu {gpus} ({where.gpu:.2f})  "
            f"{s.response!r}")


async def main(rollout_batch_size: int, n_samples: int, eval_copies: int, progress: bool) -> None:
    layout = parse_cluster_layout(DEMO_LAYOUT, default_cpus=8, default_memory_gb=32)
    pool = PlacementPool(layout)
    initial = pool.snapshot()
    eval_sets: dict[str, list[Task]] = {
        "arith-easy": ArithmeticSource(seed=101, task_type="arithmetic").take(4),
        "arith-hard": ArithmeticSource(seed=202, task_type="arithmetic").take(4),
    }
    config = SchedulerConfig(rollout_batch_size=rollout_batch_size, n_samples_per_eval_prompt=eval_copies,
                             global_stopping=StoppingCriteria(max_turns=1, max_context_len=64, timeout_s=30),
                             progress=progress)
    scheduler = TaskScheduler([arithmetic_spec(concurrency=4, batch_size=2)],
                              ArithmeticSource(seed=0, n_samples=n_samples), pool, config, eval_datasets=eval_sets)
    streamed: list[str] = []

    async def stream(task: Task, samples: list[Sample]) -> None:
        streamed.append(task.task_id)

    result = await scheduler.execute_rollout(0, on_task_done=stream)
    print(f"\n== rollout 0: {len(result.groups)} tasks x {n_samples} samples (streamed in order: "
          f"{', '.join(streamed)})")
    for group in result.groups:
        for s in group:
            print(_line(s))
    print("  failure classes:", {k: v for k, v in result.metrics.items() if v})
    ev = await scheduler.execute_eval(0)
    print(f"\n== eval 0: {eval_copies} copies per prompt, interleaved across {list(eval_sets)}")
    for name, value in sorted(ev.metrics.items()):
        print(f"  {name:<28} {value:.3f}")
    nodes = Counter(s.episode.placement.node for g in result.groups for s in g if s.episode.placement)
    print(f"\n== placement: samples per node {dict(nodes)}; pool back to its initial state: "
          f"{pool.snapshot() == initial}")


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rollout-batch-size", type=int, default=6)
    p.add_argument("--n-samples", type=int, default=2)
    p.add_argument("--eval-copies", type=int, default=4)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main(a.rollout_batch_size, a.n_samples, a.eval_copies, not a.no_progress))


if __name__ == "__main__":
    cli()

"""PlacementPool decision cost: a 64-token batch acquired and released, on 8, 128 and 1,024 nodes.

Prints microseconds per token and per batch (acquire + release), on an empty pool and on a pool
pre-filled to about half its GPU with a random mix of held tokens (so the node order is not uniform),
plus the 1,024-node / 8-node ratio. Figures only; nothing here asserts on time.

Run from the repo root: ``.venv/bin/python bench/pool.py [--rounds N]``.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayapp.core.pool import PlacementPool
from rayapp.types import NodeSpec, Resource

BATCH = 64
PER_SAMPLE = Resource(gpu=0.25, cpu=1, memory_gb=4)
BUDGET = Resource(gpu=BATCH * 0.25, concurrency=BATCH, cpu=BATCH, memory_gb=BATCH * 4)
FILL_SHAPES = [
    Resource(gpu=0.1, cpu=1, memory_gb=2),
    Resource(gpu=0.33, cpu=2, memory_gb=8),
    Resource(gpu=0.5, cpu=4, memory_gb=16),
    Resource(gpu=1, cpu=8, memory_gb=32),
    Resource(gpu=2, cpu=8, memory_gb=64),
    Resource(gpu=0, cpu=3, memory_gb=12),
]


def make_pool(n_nodes: int) -> PlacementPool:
    layout = {
        f"10.0.{i // 256}.{i % 256}": NodeSpec(gpus=tuple(range(8)), cpu=96, memory_gb=512)
        for i in range(n_nodes)
    }
    return PlacementPool(layout)


def half_fill(pool: PlacementPool, seed: int = 0) -> int:
    """Hold random tokens until about half the GPU capacity is taken; returns tokens held."""
    rng = random.Random(seed)
    target = sum(r.gpu for r in pool.capacity().values()) / 2
    taken = 0.0
    while taken < target:
        shape = rng.choice(FILL_SHAPES)
        got = pool.try_acquire_batch(
            Resource(gpu=1e9, concurrency=64, cpu=1e9, memory_gb=1e9), shape, rng.randint(1, 16)
        )
        if got is None:
            break
        taken += sum(t.gpu * len(t.gpu_ids) for t in got)
    return pool.held


def measure(pool: PlacementPool, rounds: int) -> float:
    """Seconds per batch (acquire + release), best of three runs of ``rounds`` rounds."""
    acquire, release = pool.try_acquire_batch, pool.release
    for _ in range(200):  # warm-up
        release(acquire(BUDGET, PER_SAMPLE, BATCH))
    best = float("inf")
    gc.disable()
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(rounds):
                tokens = acquire(BUDGET, PER_SAMPLE, BATCH)
                release(tokens)
            best = min(best, (time.perf_counter() - t0) / rounds)
    finally:
        gc.enable()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    print(f"batch of {BATCH} tokens x {PER_SAMPLE}; {args.rounds} rounds, best of 3")
    print(f"{'nodes':>6} {'state':>10} {'held':>6} {'us/token':>9} {'us/batch':>9}")
    figures: dict[tuple[int, str], float] = {}
    for n_nodes in (8, 128, 1024):
        for state in ("empty", "half-full"):
            pool = make_pool(n_nodes)
            held = half_fill(pool) if state == "half-full" else 0
            before = pool.snapshot()
            per_batch = measure(pool, args.rounds)
            assert pool.snapshot() == before  # the bench must leave the ledger as it found it
            figures[n_nodes, state] = per_batch
            print(
                f"{n_nodes:>6} {state:>10} {held:>6} {per_batch / BATCH * 1e6:>9.2f} {per_batch * 1e6:>9.1f}"
            )
    for state in ("empty", "half-full"):
        ratio = figures[1024, state] / figures[8, state]
        print(f"ratio 1024/8 nodes ({state}): {ratio:.2f}x")


if __name__ == "__main__":
    main()

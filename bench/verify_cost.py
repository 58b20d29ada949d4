"""What running a verifier in the sample's bundle costs, next to the same verifier inline.

In a rollout the agents' verifiers run where the sample's token is reserved: ``run_in_bundle``, a Ray
task in the token's placement-group bundle asking for the token's share (``rayapp/actors/pool_service.py``).
In an eval step without a pool, or with ``executor`` inline, the same function runs in a worker
thread of the manager (``run_inline``). This times both on one local Ray, in one run: a real
placement group with a CPU/memory bundle and a (logical) GPU bundle, as the pool's; the worker pool
warm after a first round. Per call p50, p90 and max in ms, for a trivial verifier (``score`` from
``response`` and ``label``) and the built-in math verifier, one call at a time and 8 at once, and the
bundle's overhead (p50 in the bundle minus p50 inline). The target: at most 50 ms (p50, warm) for
the trivial verifier. Then what a training loop meets: a burst of ``--burst`` math verifications at
once after a ``--pause-s`` pause (the trainer's update), as Ray tasks (``run_in_bundle``) and on the
warm hosts (``WorkHosts``, the manager's default): the burst's seconds and how many processes it
started. Figures only; nothing here asserts on time. Ray listens on 127.0.0.1 only, with
Ray's token authentication on (a throwaway token).

Run from the repo root: ``.venv/bin/python bench/verify_cost.py [--calls N] [--burst N] [--pause-s S] [--smoke]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rayapp.actors.pool_service import GROUP_PREFIX, run_in_bundle
from rayapp.actors.work_hosts import WorkHosts
from rayapp.cli.local_cluster import process_auth_token
from rayapp.envs.math import verify as math_verify
from rayapp.envs.protocol import run_inline
from rayapp.types import AgentResult, Sample, Token

SAMPLE = Sample("t0", 0, "What is 2+2?", "4")
RESULT = AgentResult(tokens=[1, 2], response_length=1, response="The answer is 4.", rollout_log_probs=[-0.1],
                     loss_mask=[1])
CONCURRENT = 8


def trivial(sample: Sample, result: AgentResult) -> dict[str, float]:
    return {"score": float(result.response.strip(" .").endswith(str(sample.label)))}


async def timed(executor, token: Token | None, fn, calls: int, concurrent: int) -> list[float]:
    """Milliseconds per call, ``concurrent`` calls at a time."""
    async def one() -> float:
        start = time.perf_counter()
        reward = await executor(token, fn, SAMPLE, RESULT)
        assert reward["score"] == 1.0, reward
        return (time.perf_counter() - start) * 1000

    out: list[float] = []
    while len(out) < calls:
        out += await asyncio.gather(*(one() for _ in range(concurrent)))
    return out


def row(name: str, where: str, concurrent: int, ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=10)
    return f"{name:9}{where:>11}{concurrent:>8}{statistics.median(ms):>9.1f}{q[8]:>9.1f}{max(ms):>9.1f}"


async def run(tokens: dict[str, Token], calls: int) -> None:
    print(f"{'verifier':9}{'where':>11}{'at once':>8}{'p50 ms':>9}{'p90 ms':>9}{'max ms':>9}")
    overhead = {}
    for name, fn in (("trivial", trivial), ("math", math_verify)):
        for concurrent in (1, CONCURRENT):
            inline = await timed(run_inline, None, fn, calls, concurrent)
            print(row(name, "inline", concurrent, inline))
            for kind, token in tokens.items():
                await timed(run_in_bundle, token, fn, CONCURRENT, concurrent)  # warm: workers up, fn imported
                bundle = await timed(run_in_bundle, token, fn, calls, concurrent)
                print(row(name, f"{kind} bundle", concurrent, bundle), flush=True)
                overhead[name, kind, concurrent] = statistics.median(bundle) - statistics.median(inline)
    for (name, kind, concurrent), ms in overhead.items():
        print(f"bundle overhead, {name} verifier, {kind} bundle, {concurrent} at once: {ms:.1f} ms (p50)")


def math_where(sample: Sample, result: AgentResult) -> tuple[int, dict[str, float]]:
    return os.getpid(), math_verify(sample, result)


@ray.remote(num_cpus=0)
class Replica:
    """Stands for one of the app's Serve actors (controller, proxy, manager, pool, two engine replicas):
    Ray counts actors among the workers it keeps when idle."""

    def ready(self) -> bool:
        return True


async def bursts(token: Token, size: int, pause_s: float, rounds: int = 3) -> None:
    """``rounds`` bursts of ``size`` math verifications at once, ``pause_s`` apart, for each executor,
    beside six idle actors as the app's (the token's CPU share is the GRPO demo's eval share, 0.1)."""
    replicas = [Replica.remote() for _ in range(6)]
    await asyncio.gather(*(r.ready.remote() for r in replicas))
    print(f"\n{size} math verifications at once after a {pause_s:.0f} s pause, {token.placement_group}"
          f"[{token.bundle_index}], CPU share {token.cpu}, beside {len(replicas)} idle actors:")
    print(f"{'executor':10}{'round':>6}{'seconds':>9}{'processes':>11}{'new':>5}")
    hosts = WorkHosts()
    for name, executor in (("hosts", hosts.run), ("tasks", run_in_bundle)):
        seen: set[int] = set()
        await asyncio.gather(*(executor(token, math_where, SAMPLE, RESULT) for _ in range(CONCURRENT)))  # warm
        for r in range(rounds):
            await asyncio.sleep(pause_s)
            start = time.perf_counter()
            out = await asyncio.gather(*(executor(token, math_where, SAMPLE, RESULT) for _ in range(size)))
            took = time.perf_counter() - start
            assert all(reward["score"] == 1.0 for _, reward in out)
            pids = {pid for pid, _ in out}
            print(f"{name:10}{r + 1:>6}{took:>9.2f}{len(pids):>11}{len(pids - seen):>5}", flush=True)
            seen |= pids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=64, help="calls per row")
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run (tests)")
    ap.add_argument("--burst", type=int, default=128, help="calls at once after each pause")
    ap.add_argument("--pause-s", type=float, default=15.0, help="the pause before each burst (longer than Ray's "
                    "idle-worker time)")
    args = ap.parse_args()
    calls = 16 if args.smoke else args.calls
    burst, pause_s = (16, 2.0) if args.smoke else (args.burst, args.pause_s)
    process_auth_token()
    ray.init(num_cpus=8, num_gpus=2, include_dashboard=False, logging_level="error", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    name = f"{GROUP_PREFIX}bench/verify"  # as the pool's: a CPU/memory bundle and a (logical) GPU one
    pg = placement_group([{"CPU": 2.0, "memory": 2**30}, {"GPU": 2.0}], name=name)
    try:
        ray.get(pg.ready(), timeout=60)
        tokens = {"cpu": Token(0, "n0", (), 0.0, 0.25, 0.1, placement_group=name, bundle_index=0),
                  "gpu": Token(1, "n0", (0,), 0.25, 0.0, 0.0, placement_group=name, bundle_index=1)}
        asyncio.run(run(tokens, calls))
        asyncio.run(bursts(Token(2, "n0", (), 0.0, 0.1, 0.1, placement_group=name, bundle_index=0), burst, pause_s))
    finally:
        remove_placement_group(pg)
        ray.shutdown()


if __name__ == "__main__":
    main()

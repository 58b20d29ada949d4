"""The group stream (``rayapp.core.stream``) in the simulator: the real stream, scheduler, evaluator and
pool in virtual time (``drive`` under ``run_virtual``), on the simulator's workloads, against the
synchronous loop (η = 0: the same stream, where each batch starts only once the last was trained).

The trainer has GPUs of its own: it trains a batch of B groups in s x the synchronous rollout step
(the first batch's makespan at η = 0), s in {0.25, 0.5, 1.0}, and publishes the next version at
once (no weight-sync time yet). Per row: trained samples per virtual second, that over the
end-to-end limit (the lower of the pool's work-conserving rate, samples ÷ (Σ work ÷ capacity), and
the trainer's, B·group ÷ its time a batch), the share of the run the trainer trained, and the
staleness of what was trained; beside them, the peer model of AReaL's rule (its count, groups
handed over as they finish, so no per-group bound). Figures only; a run that loses or repeats a group exits 1.

Run from the repo root: ``.venv/bin/python bench/sim_stream.py [--nodes 8] [--workload lognormal,...]
[--steps 8] [--waves 2] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim_policies import Meter, _spec
from sim_workloads import GROUP, PER_SAMPLE, SLOTS_PER_NODE, WORKLOADS, layout, workload

from rayapp.core.clock import loop_time, run_virtual
from rayapp.core.contracts import SchedulerConfig
from rayapp.core.pool import PlacementPool
from rayapp.core.scheduler import TaskScheduler
from rayapp.core.staleness import StalenessBound
from rayapp.core.stream import GroupStream, StreamConfig
from rayapp.types import Task, TaskConfig


class FinishOrder(StalenessBound):
    """The peer model of AReaL's rule: its admission count, groups handed over as they finish."""

    def may_take(self, deadline: int) -> bool:
        return self.left >= 1


def run(traces, nodes: int, batch: int, eta: int, train_s: float, *, areal: bool = False) -> dict:
    """Every task of ``traces`` through one stream; the trainer takes ``train_s`` a batch. ``areal``:
    hand over as groups finish (``FinishOrder``) instead of by deadline."""
    by_id = {t.task_id: t for t in traces}
    left = list(traces)
    pool = PlacementPool(layout(nodes))
    before = pool.snapshot()

    class Source:
        async def get_tasks(self, n):
            taken, left[:n] = left[:n], []
            return [Task(t.task_id, "", TaskConfig("sim", n_samples=len(t.samples))) for t in taken]

    spec = _spec(8, by_id, Meter(), Counter())
    sched = TaskScheduler([spec], Source(), pool, SchedulerConfig(progress=False))
    steps: list[float] = []  # when each batch was complete (the trainer's wait ended)

    async def trainer(stream):
        trained, busy = [], 0.0
        while got := await stream.next_batch():
            steps.append(loop_time())
            trained += got
            await asyncio.sleep(train_s)
            busy += train_s
            await stream.ack(g.group_id for g in got)
            stream.set_version(stream.version + 1)
        return trained, busy

    async def main():
        stream = GroupStream(sched, StreamConfig(batch_size=batch, max_staleness=eta))
        if areal:
            stream.bound = FinishOrder(batch, eta)
        await stream.start()
        try:
            return await trainer(stream)
        finally:
            report.append(await stream.close())

    report = []
    trained, busy = run_virtual(main())
    report = report[0]
    ok = sorted(g.task.task_id for g in trained) == sorted(by_id) and pool.snapshot() == before
    if not ok or report.unacked or report.undelivered or report.cancelled:
        sys.exit(f"stream eta={eta}: groups lost or repeated, or the pool not restored")
    end = steps[-1] + train_s if steps else 0.0
    ages = Counter(g.staleness() for g in trained)
    first_step = steps[0] if steps else 0.0
    return {"end": end, "samples": len(trained) * GROUP, "busy": busy, "ages": dict(sorted(ages.items())),
            "first": first_step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--workload", default=",".join(WORKLOADS))
    ap.add_argument("--steps", type=int, default=8, help="train steps (batches) per run")
    ap.add_argument("--waves", type=float, default=2.0, help="a batch = waves x the groups the cluster runs at once")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    batch = max(1, round(args.waves * args.nodes * SLOTS_PER_NODE / GROUP))
    print(f"{args.nodes} nodes x 8 GPUs, B = {batch} groups of {GROUP} a batch, {args.steps} batches\n")
    print("| workload | s | policy | samples/s | ÷ limit | trainer busy | staleness (groups) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.workload.split(","):
        traces = workload(name, batch * args.steps, args.seed)
        work = sum(s.duration for t in traces for s in t.samples) * PER_SAMPLE.gpu / (args.nodes * 8)
        pool_rate = len(traces) * GROUP / work
        sync0 = run(traces, args.nodes, batch, 0, 0.0)  # the synchronous rollout step, without training
        step = sync0["first"]  # the first batch's makespan: a synchronous step from a cold start
        for s in (0.25, 0.5, 1.0):
            train_s = s * step
            limit = min(pool_rate, batch * GROUP / train_s)
            for eta, areal in ((0, False), (1, False), (2, False), (1, True)):
                r = run(traces, args.nodes, batch, eta, train_s, areal=areal)
                rate = r["samples"] / r["end"]
                label = "synchronous (η=0)" if eta == 0 else f"stream η={eta}"
                label = f"AReaL count, finish order η={eta}" if areal else label
                print(f"| {name} | {s} | {label} | {rate:,.1f} | {rate / limit:.2f} | {r['busy'] / r['end']:.0%} "
                      f"| {r['ages']} |")


if __name__ == "__main__":
    main()

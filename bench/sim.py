"""The long-tail simulator: the real ``TaskScheduler``, ``Evaluator`` and ``PlacementPool`` in virtual
time (``rayapp.core.clock.run_virtual``), on seeded long-tailed workloads and clusters of 8, 128 and
1,024 nodes x 8 GPUs, policy by policy, next to the per-sample FIFO list schedule and models of
slime's and verl's rollout loops on the same traces and capacity.

Per policy it prints makespan (virtual seconds), makespan / lower bound, makespan / list schedule,
the share of reserved capacity that did work, the share of the whole cluster that did, and samples
per virtual second; then one summary table per cluster size. Figures only: nothing here asserts on
speed, but a run whose samples did not all come back exactly once, or whose pool did not end as it
started, exits 1.

Run from the repo root: ``.venv/bin/python bench/sim.py [--smoke] [--nodes 8,128,1024]
[--workload lognormal,...] [--seed 0] [--steps 1] [--waves N] [--plot docs] [--json out.json]``.
``--waves`` sizes a step: samples = waves x the slots the cluster holds (8 below 1,024 nodes, 2 at
1,024 nodes and up, so the largest run takes minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sim_peers import list_schedule, lower_bound, slime_model, verl_model
from sim_policies import POLICIES, Run, run_policy, supported
from sim_workloads import GROUP, SLOTS_PER_NODE, WORKLOADS, workload

PEERS = (slime_model, verl_model)
COLUMNS = ("policy", "release", "makespan s", "÷ LB", "÷ list", "reserved busy", "cluster busy", "samples/s")


def default_waves(nodes: int) -> float:
    return 8.0 if nodes < 1024 else 2.0


def _row(case: dict, run: Run | None, name: str, release: str, makespan: float) -> dict:
    row = {**case, "policy": name, "release": release, "makespan": makespan,
           "ratio_lb": makespan / case["lb"], "ratio_list": makespan / case["list"],
           "samples_per_s": case["samples"] * case["steps"] / makespan}
    if run is not None:
        row.update(reserved_busy=run.reserved_busy, cluster_busy=run.cluster_busy, wall_s=run.wall_s,
                   returned_once=run.returned_once, pool_restored=run.pool_restored)
    return row


def simulate(name: str, nodes: int, *, seed: int = 0, steps: int = 1, waves: float | None = None,
             batch_tasks: int = 8, noise: float = 0.5, timelines: bool = False) -> tuple[list[dict], list[Run]]:
    """Every policy, the list schedule and the peer models on one workload and cluster: the table's
    rows (plain data) and the runs behind them."""
    waves = default_waves(nodes) if waves is None else waves
    n_tasks = max(1, round(waves * nodes * SLOTS_PER_NODE / GROUP))
    traces = [workload(name, n_tasks, seed, step=s, noise=noise) for s in range(steps)]
    case = {"workload": name, "nodes": nodes, "seed": seed, "steps": steps, "waves": waves, "tasks": n_tasks,
            "samples": n_tasks * GROUP, "batch_tasks": batch_tasks,
            "lb": lower_bound(traces, nodes), "list": list_schedule(traces, nodes)}
    rows, runs = [], []
    for policy in POLICIES:
        if not supported(policy):
            rows.append({**case, "policy": policy.name, "release": "not in this scheduler", "makespan": None})
            continue
        run = run_policy(policy, traces, nodes, batch_tasks, timeline=timelines)
        runs.append(run)
        rows.append(_row(case, run, run.policy, run.release, run.makespan))
    rows.append(_row(case, None, "list schedule (computed)", "per sample", case["list"]))
    for model in PEERS:
        run = model(traces, nodes)
        runs.append(run)
        rows.append(_row(case, run, run.policy, run.release, run.makespan))
    return rows, runs


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def print_case(rows: list[dict]) -> None:
    c = rows[0]
    print(f"\n### {c['workload']}, {c['nodes']:,} nodes x 8 GPUs ({c['nodes'] * SLOTS_PER_NODE:,} slots): "
          f"{c['steps']} step(s) of {c['tasks']:,} tasks ({c['samples']:,} samples, {c['waves']:g} waves), "
          f"{c['batch_tasks']} tasks a batch; lower bound {c['lb']:,.0f} s, list schedule {c['list']:,.0f} s\n")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in rows:
        if r["makespan"] is None:
            print(f"| {r['policy']} | {r['release']} |" + " |" * (len(COLUMNS) - 2))
            continue
        print(f"| {r['policy']} | {r['release']} | {r['makespan']:,.0f} | {r['ratio_lb']:.2f} | {r['ratio_list']:.2f} "
              f"| {_pct(r.get('reserved_busy'))} | {_pct(r.get('cluster_busy'))} | {r['samples_per_s']:,.1f} |")


def print_summary(rows: list[dict]) -> None:
    """Per cluster size: makespan / lower bound and reserved busy share, policy by workload."""
    for nodes in sorted({r["nodes"] for r in rows}):
        mine = [r for r in rows if r["nodes"] == nodes]
        names = list(dict.fromkeys(r["workload"] for r in mine))
        print(f"\n### Summary, {nodes:,} nodes x 8 GPUs: makespan ÷ lower bound (÷ list schedule), "
              f"reserved capacity that did work\n")
        print("| policy | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for policy in dict.fromkeys(r["policy"] for r in mine):
            cells = []
            for w in names:
                r = next(x for x in mine if x["policy"] == policy and x["workload"] == w)
                cells.append("n/a" if r["makespan"] is None else
                             f"{r['ratio_lb']:.2f} ({r['ratio_list']:.2f}) {_pct(r.get('reserved_busy'))}".strip())
            print(f"| {policy} | " + " | ".join(cells) + " |")


def print_partial_target(rows: list[dict]) -> None:
    """The bar for partial rollouts (>= 85% of reserved capacity doing work over 5 steps), per policy."""
    if not any(r["steps"] >= 5 for r in rows):  # one step carries nothing over: it says nothing of the bar
        print("target partial rollouts >= 85% of reserved capacity doing work over 5 steps: not measured "
              "(run bench/sim.py --nodes 8 --steps 5)")
        return
    for name in dict.fromkeys(r["policy"] for r in rows if r["policy"].startswith("partial")):
        mine = [r for r in rows if r["policy"] == name and r.get("reserved_busy") is not None and r["steps"] >= 5]
        if mine:
            worst = min(mine, key=lambda r: r["reserved_busy"])
            where = (f"worst {_pct(worst['reserved_busy'])} ({worst['workload']}, {worst['nodes']:,} nodes, "
                     f"{worst['steps']} steps) over {len(mine)} cases")
            if "restart" in name:  # it throws cut work away on purpose (staleness 0): no bar to meet
                print(f"for comparison, {name} (discards what a cut group did, by design): {where}")
                continue
            print(f"target {name} >= 85% of reserved capacity doing work over 5 steps: "
                  f"{'met' if worst['reserved_busy'] >= 0.85 else 'NOT met'}; {where}")


def print_targets(rows: list[dict]) -> None:
    """The bars the simulator measures: early release, then partial rollouts."""
    early = [r for r in rows if r["policy"] == "early FIFO" and r["makespan"] is not None]
    if not early:
        print("\ntarget early FIFO <= 1.1x the list schedule: not measured (no early release in this scheduler)")
        return  # partial rollouts need early release too
    worst = max(early, key=lambda r: r["ratio_list"])
    print(f"\ntarget early FIFO <= 1.1x the list schedule: {'met' if worst['ratio_list'] <= 1.1 else 'NOT met'}; "
          f"worst {worst['ratio_list']:.2f}x ({worst['workload']}, {worst['nodes']:,} nodes) over {len(early)} cases")
    print_partial_target(rows)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="2 nodes, 2 waves, 2 steps, every workload: seconds")
    p.add_argument("--nodes", default="8,128,1024", help="comma-separated node counts (8 GPUs each)")
    p.add_argument("--workload", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1, help="rollout steps per run")
    p.add_argument("--waves", type=float, default=None, help="samples per step / slots (default: 8, or 2 at 1,024+)")
    p.add_argument("--batch-tasks", type=int, default=8, help="tasks per batch (8 samples each)")
    p.add_argument("--noise", type=float, default=0.5, help="sigma of the lognormal error on length estimates")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots there (needs matplotlib: the 'bench' extra)")
    p.add_argument("--json", metavar="PATH", help="write every row as JSON")
    a = p.parse_args(argv)
    if a.smoke:
        a.nodes, a.waves, a.steps = "2", a.waves or 2.0, max(a.steps, 2)
    try:
        a.nodes = [int(n) for n in a.nodes.split(",")]
    except ValueError:
        p.error(f"--nodes: expected comma-separated integers, got {a.nodes!r}")
    a.workload = a.workload.split(",")
    bad = [w for w in a.workload if w not in WORKLOADS]
    if bad or min(a.nodes) < 1 or a.steps < 1 or (a.waves is not None and a.waves <= 0) or a.batch_tasks < 1:
        p.error(f"need workloads of {sorted(WORKLOADS)} (got {bad or 'those'}), nodes, steps, waves and "
                f"batch-tasks > 0")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    rows: list[dict] = []
    timelines: dict[str, list] = {}
    started = time.perf_counter()
    for nodes in a.nodes:
        for name in a.workload:
            record = a.plot is not None and nodes == a.nodes[0] and name == a.workload[0]
            case, runs = simulate(name, nodes, seed=a.seed, steps=a.steps, waves=a.waves,
                                  batch_tasks=a.batch_tasks, noise=a.noise, timelines=record)
            print_case(case)
            print(f"\n(simulated in {sum(r.wall_s for r in runs):.1f} s of real time)", flush=True)
            rows += case
            timelines.update({f"{r.policy} ({r.release})": r.timeline for r in runs if r.timeline})
    print_summary(rows)
    print_targets(rows)
    broken = [r for r in rows if r.get("returned_once") is False or r.get("pool_restored") is False]
    print(f"\n{len(rows)} rows in {time.perf_counter() - started:.0f} s; "
          + (f"SEMANTICS BROKEN in {[(r['workload'], r['nodes'], r['policy']) for r in broken]}" if broken
             else "every sample came back exactly once and every pool ended as it started"))
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "timelines": timelines}, indent=1))
    if a.plot:
        from plot_sim import plot
        for path in plot(rows, timelines, Path(a.plot)):
            print(f"wrote {path}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

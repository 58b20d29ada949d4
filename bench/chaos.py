"""Chaos run: rollout steps against the Ray app's parts while faults are injected at seeded random
moments, then a table of what came back.

    python bench/chaos.py            # ~4 minutes on 2 cores: 9 faults, at least 12 steps
    python bench/chaos.py --smoke    # one engine kill, at least 2 steps (~30 s with the cluster's start)
    python bench/chaos.py --faults disk --steps 4   # only the faults named

Real: a ``ray.cluster_utils.Cluster`` (a head and two worker nodes labelled ``rayapp.io/node``, logical
GPUs), Serve deployments with the app's options (the PlacementPoolService replica on the head, a
manager replica hosting the TaskScheduler behind ``StepResults``, engine replicas), the pool's
placement groups, sandbox hosts in the samples' bundles, ``run_in_bundle`` work, and every kill
(``ray.kill`` of a replica or sandbox host, ``Cluster.remove_node``). Faked: the agent (it sleeps a
random time in its sandbox and its bundle, then calls the engine) and the engine (it sleeps and
answers token ids; ``bench/chaos_weights.py``), so the run measures the shell's fault handling, not a model.

The driver asks for steps 0..N-1 in order and retries a step whose call failed (a killed manager, a
pool that is restarting): a step id is idempotent. Per completed step, *lost* is a requested sample
(task, index) missing from its result and *duplicated* one returned twice. *Time to recover* is, for
each fault, the seconds from the kill until the next step completes. After the run the driver asks
for every completed step id again: *repeats answered differently* counts those whose samples (each
with a nonce of its run) differ from what the driver received first.

*disk full mid-step*: the disk under the manager's step results fills up (every write there fails with
ENOSPC, faked in the replica's process: the bench needs no privileges) until a step's result failed
to be written; then the manager replica is killed, as in a restart. No step handed out may be lost to
it, and a repeat of its id must return the samples the driver received.

*engine killed after a weight update*: the manager applies new weights, then an engine replica is
killed; its replacement starts on the old ones. *Stale-weight samples* counts the samples of steps
begun after an update whose turn came from other weights than that update's (``chaos_weights``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # 127.0.0.1 only on one machine

import chaos_disk  # bench/, beside this file
import chaos_weights
import ray
from ray import serve
from ray.cluster_utils import Cluster

from rayapp.actors.app import HEAD, POOL_MAX_ONGOING, STICKY_ROUTER
from rayapp.actors.engine import EngineClient
from rayapp.actors.nodes import NODE_LABEL
from rayapp.actors.pool_client import PoolClient
from rayapp.actors.pool_service import GROUP_PREFIX, PlacementPoolService, run_in_bundle
from rayapp.actors.sandbox import open_sandbox
from rayapp.cli.local_cluster import process_auth_token
from rayapp.core.agent import FunctionAgent
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.envs.sandboxes import SandboxLimits
from rayapp.inference.client import GenerateRequest
from rayapp.inference.weight_sync import WeightSync
from rayapp.steps.results import StepResults
from rayapp.types import AgentResult, EvaluatorSpec, Resource, SamplingParams, Status, StepKind, Task, TaskConfig

APP = "rayapp-chaos"
NODES = ("node-a", "node-b")
LAYOUT = '{"node-a": {"gpus": [0, 1], "cpu": 4, "memory_gb": 2}, "node-b": {"gpus": [0, 1], "cpu": 4, "memory_gb": 2}}'
KINDS = ("engine", "sandbox", "pool", "manager", "node", "disk", "weights")
MASK = re.compile(r"[0-9a-f]{12,}|\d+")  # ids and numbers, so that like aborts count together
LIMITS = SandboxLimits(wall_seconds=30, cpu_seconds=10)
SANDBOX_WAIT_S = 20.0  # how long one kill request waits in the manager replica for a live sandbox host
INJECT_WITHIN_S = 120.0  # a fault that finds nothing to kill for this long is given up (and reported)

# The manager replica's live sandbox hosts: the chaos driver asks the replica to kill one of them.
SANDBOXES: set = set()


def nap(seconds: float) -> str:
    """The agent's work inside its bundle."""
    time.sleep(seconds)
    return ray.get_runtime_context().get_node_id()


def make_spec(engine) -> EvaluatorSpec:
    async def run(sample, ctx):
        rng = random.Random(f"{sample.task_id}#{sample.index}")
        if sample.index == 0:  # one sandbox per group: each host is a Ray worker process to start
            sandbox = await open_sandbox(ctx.token, limits=LIMITS)
            SANDBOXES.add(sandbox.actor)
            try:
                await sandbox.exec(f"sleep {rng.uniform(0.5, 2.0):.2f}")
            finally:
                SANDBOXES.discard(sandbox.actor)
                await sandbox.close()
        await run_in_bundle(ctx.token, nap, rng.uniform(0.2, 1.0), timeout_s=60)
        out = await engine.generate(GenerateRequest([0], SamplingParams(max_new_tokens=3)))
        ids = out.output_ids
        return AgentResult(tokens=[0, *ids], response_length=len(ids), response=chaos_weights.response(out),
                           rollout_log_probs=out.logprobs, loss_mask=[1] * len(ids))

    agent = FunctionAgent(run, lambda s, r: {"score": 1.0})
    return EvaluatorSpec("chaos", agent, resource=Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1),
                         run_resource=Resource(gpu=0.25, cpu=0.5, memory_gb=0.25), batch_size=4)


class StepSource:
    """The same tasks for every attempt at a step, so a retried step asks for the same samples."""

    def __init__(self, rollout_id: int, n_samples: int):
        self.rollout_id, self.n_samples = rollout_id, n_samples

    async def get_tasks(self, n: int) -> list[Task]:
        return [Task(f"r{self.rollout_id}-t{i}", "chaos", TaskConfig("chaos", n_samples=self.n_samples))
                for i in range(n)]


class ChaosManager:
    """The manager replica's part here: a TaskScheduler per step behind the app's StepResults, over
    a PoolClient; a replacement replica first frees what its predecessor held, as the app's does."""

    def __init__(self, pool, engine, batch_size: int, n_samples: int, results_dir: str | None = None):
        self.pool = PoolClient(pool, "chaos-manager", call_timeout_s=30)  # as the app's manager
        self.engine = EngineClient(engine, "engine", timeout_s=30)  # as the app's: turns on stale weights retried
        self.weights = self.engine.weights = WeightSync({"engine": self.engine})
        self.spec, self.batch_size, self.n_samples = make_spec(self.engine), batch_size, n_samples
        self.steps = StepResults(results_dir, keep=1000)  # on disk, as the app's with a checkpoint_dir
        self.results_dir = results_dir
        self.freed_previous: asyncio.Task | None = None

    async def generate(self, rollout_id: int):
        if self.freed_previous is None:
            self.freed_previous = asyncio.ensure_future(self.pool.release_owner())
        await asyncio.shield(self.freed_previous)
        await self.weights.restore()  # as the app's manager, before each step: a replacement on the record
        return await self.steps.once(StepKind.ROLLOUT, rollout_id, self._run)

    async def update_weights(self, path: str) -> int:
        await self.weights.update("engine", path)
        return self.weights.applied["engine"].version

    async def _run(self, rollout_id: int):
        config = SchedulerConfig(rollout_batch_size=self.batch_size, progress=False, acquire_timeout_s=60)
        sched = TaskScheduler([self.spec], StepSource(rollout_id, self.n_samples), self.pool, config)
        return await sched.execute_rollout(rollout_id)

    async def kill_a_sandbox(self, wait_s: float) -> float | None:
        """Kill a live sandbox host, waiting up to ``wait_s`` for one (a host lives only while its
        sample's command runs); the kill's time (monotonic), or None when none was live."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not SANDBOXES:
            if loop.time() > deadline:
                return None
            await asyncio.sleep(0.02)
        at = time.monotonic()
        ray.kill(random.choice(sorted(SANDBOXES, key=id)))
        return at

    async def fill_disk(self, wait_s: float) -> float | None:
        return await chaos_disk.fill_disk(self.results_dir, wait_s)


@dataclass
class Run:
    faults: list[tuple[str, float]] = field(default_factory=list)  # (kind, monotonic time) of each kill
    done: dict[int, float] = field(default_factory=dict)  # step id -> completion time
    took: dict[int, float] = field(default_factory=dict)  # step id -> seconds from its first call
    began: dict[int, float] = field(default_factory=dict)  # step id -> its first call's time
    updates: list[tuple[float, int]] = field(default_factory=list)  # (time, version) of each weight update
    planned: int = 0
    requested_steps: int = 0
    aborts: Counter = field(default_factory=Counter)  # (node, error with its numbers masked)
    results: dict[int, object] = field(default_factory=dict)
    failed_calls: Counter = field(default_factory=Counter)


def replica(deployment: str):
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and f"{APP}#{deployment}#" in a["name"]]
    return ray.get_actor(sorted(names)[0], namespace="serve") if names else None


def inject(kind: str, cluster: Cluster, nodes: dict, manager, run: Run) -> float | None:
    """One real kill of ``kind``: its time (monotonic), or None when there was nothing of that kind to
    kill just then."""
    if kind == "sandbox":  # the manager replica waits for a live host, up to SANDBOX_WAIT_S
        return manager.kill_a_sandbox.remote(SANDBOX_WAIT_S).result(timeout_s=SANDBOX_WAIT_S + 30)
    if kind == "disk":
        return chaos_disk.disk_full(manager, lambda: replica("ChaosManager"), SANDBOX_WAIT_S)
    if kind == "weights":
        return chaos_weights.update_then_kill(manager, lambda: replica("engine"), run.updates)
    if kind == "node":  # a worker node dies; a fresh one with the same label joins for the next pool
        # All nodes share 127.0.0.1, so the driver may be attached to a worker's raylet: spare that one.
        mine = ray._private.worker.global_worker.node._raylet_socket_name
        name = next(n for n in sorted(nodes) if nodes[n] is not None and nodes[n]._raylet_socket_name != mine)
        at = time.monotonic()
        cluster.remove_node(nodes[name])
        nodes[name] = None  # removed: a retry must not remove it again
        for attempt in range(1, 4):  # a loaded machine may time a raylet's start out: the kill stands
            try:
                nodes[name] = cluster.add_node(num_cpus=4, num_gpus=2, labels={NODE_LABEL: name},
                                               node_ip_address="127.0.0.1")
                break
            except Exception as e:
                print(f"  could not start a node in place of {name} (try {attempt} of 3): {str(e)[:120]}", flush=True)
                time.sleep(5)
        return at
    target = replica({"engine": "engine", "pool": "PlacementPoolService", "manager": "ChaosManager"}[kind])
    if target is None:
        return None
    at = time.monotonic()
    ray.kill(target)
    return at


def chaos(plan: list[tuple[float, str]], t0: float, run: Run, stop: threading.Event, cluster, nodes, manager):
    for at, kind in plan:
        if stop.wait(max(0.0, t0 + at - time.monotonic())):
            return
        give_up = time.monotonic() + INJECT_WITHIN_S
        while time.monotonic() < give_up:  # what to kill may not exist at this very moment (or the
            try:                           # manager asked to kill a sandbox is itself restarting)
                killed = inject(kind, cluster, nodes, manager, run)
                if killed is not None:
                    run.faults.append((kind, killed))
                    break
            except Exception as e:
                print(f"  could not inject {kind} yet: {type(e).__name__}: {str(e)[:200]}", flush=True)
            if stop.wait(0.5):
                return
        else:
            print(f"  gave up injecting {kind}: nothing of that kind was live for {INJECT_WITHIN_S:.0f}s", flush=True)


def drive(manager, min_steps: int, faults_over: threading.Event, run: Run, step_timeout_s: float,
          attempts: int) -> None:
    """Steps 0, 1, ... until ``min_steps`` ran and every planned fault was injected."""
    rid = 0
    while rid < min_steps or not faults_over.is_set():
        began = run.began[rid] = time.monotonic()
        for _ in range(attempts):
            try:
                run.results[rid] = manager.generate.remote(rid).result(timeout_s=step_timeout_s)
                run.done[rid] = time.monotonic()
                run.took[rid] = run.done[rid] - began
                break
            except Exception as e:
                run.failed_calls[type(e).__name__] += 1
                time.sleep(1.0)
        rid += 1
    run.requested_steps = rid


def start(args) -> tuple[Cluster, dict, object, object]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1",
                                                             "include_dashboard": False})
    nodes = {n: cluster.add_node(num_cpus=4, num_gpus=2, labels={NODE_LABEL: n}, node_ip_address="127.0.0.1")
             for n in NODES}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=APP, logging_level="error", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(chaos_disk)
    ray.cloudpickle.register_pickle_by_value(chaos_weights)
    serve.start(proxy_location="Disabled")
    pool = serve.deployment(PlacementPoolService, name="PlacementPoolService", max_ongoing_requests=POOL_MAX_ONGOING,
                            ray_actor_options={"num_cpus": 0, "resources": {HEAD: 0.001}})
    pool = pool.bind(LAYOUT, None, None, 20.0)
    engine = serve.deployment(chaos_weights.FakeEngine, name="engine", num_replicas=2,  # routed as the app's are
                              ray_actor_options={"num_cpus": 0}, request_router_config=STICKY_ROUTER).bind()
    manager = serve.deployment(ChaosManager, name="ChaosManager", max_ongoing_requests=1000,
                               ray_actor_options={"num_cpus": 0, "resources": {HEAD: 0.001}})
    handle = serve.run(manager.bind(pool, engine, args.batch_size, args.n_samples, args.results_dir), name=APP,
                       route_prefix=None)
    pool_handle = serve.get_deployment_handle("PlacementPoolService", APP)
    return cluster, nodes, handle, pool_handle


def plan_faults(args) -> list[tuple[float, str]]:
    rng = random.Random(args.seed)
    kinds = ["engine"] if args.smoke else args.faults or [*KINDS, "engine", "sandbox"]
    rng.shuffle(kinds)
    lo, hi = args.fault_window
    return sorted((rng.uniform(lo, hi), k) for k in kinds)


def uncordoned(snapshot: dict) -> dict:
    """A pool snapshot with every node's cordon flag cleared: a node lost for good stays cordoned."""
    return {n: {**v, "cordoned": False} if isinstance(v, dict) and "cordoned" in v else v for n, v in snapshot.items()}


def settle(pool_handle, initial: dict, timeout_s: float = 60.0) -> tuple[dict, dict]:
    """The pool's snapshot and placement once held tokens are back (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = pool_handle.snapshot.remote().result(timeout_s=30)
        placement = pool_handle.placement.remote().result(timeout_s=30)
        if uncordoned(snap) == uncordoned(initial) or time.monotonic() > deadline:
            return snap, placement
        time.sleep(1.0)


def leaked_groups() -> list[str]:
    """Live rayapp groups beyond one per layout node (``rayapp/node/<node>@<incarnation>``, the pool's
    own): a batch's, or a dead pool incarnation's."""
    live = [pg["name"] for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith(GROUP_PREFIX) and pg["state"] != "REMOVED"]
    own = Counter(n.split("@")[0] for n in live if n.split("@")[0] in {f"{GROUP_PREFIX}node/{node}" for node in NODES})
    return [n for n in live if n.split("@")[0] not in own] + [n for n, k in own.items() for _ in range(k - 1)]


def table(run: Run, args, snap_ok: bool, held: int, groups: list[str], wall_s: float,
          cordoned: list[str]) -> list[tuple[str, str]]:
    requested = run.requested_steps * args.batch_size * args.n_samples
    returned, lost, duplicated, statuses, reasons = 0, 0, 0, Counter(), Counter()
    for rid, result in run.results.items():
        samples = [s for g in result.groups for s in g]
        keys = [(s.task_id, s.index) for s in samples]
        want = {(f"r{rid}-t{i}", k) for i in range(args.batch_size) for k in range(args.n_samples)}
        returned += len(samples)
        lost += len(want - set(keys))
        duplicated += len(keys) - len(set(keys))
        statuses.update(s.status.value for s in samples)
        aborted = [s.episode.abort for s in samples if s.status is Status.ABORTED]
        reasons.update(str(a.reason) for a in aborted)
        run.aborts.update((a.node, MASK.sub("#", a.error)[:110]) for a in aborted)
    recover = [min((d for d in run.done.values() if d > t), default=float("nan")) - t for _, t in run.faults]
    kinds = Counter(k for k, _ in run.faults)
    by_kind = ", ".join(f"{k} {kinds[k]}" for k in KINDS if kinds[k])
    took = list(run.took.values()) or [0.0]
    return [
        ("faults injected", f"{len(run.faults)} of {run.planned} planned ({by_kind})"),
        ("steps completed", f"{len(run.results)} of {run.requested_steps}"),
        ("step calls failed and retried", f"{sum(run.failed_calls.values())} {dict(run.failed_calls) or ''}".strip()),
        ("samples requested / returned", f"{requested} / {returned}"),
        ("samples by status", ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))),
        ("aborted by class", ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "none"),
        ("lost", str(lost)),
        ("duplicated", str(duplicated)),
        ("stale-weight samples", f"{chaos_weights.stale_samples(run.results, run.began, run.updates)} "
                                 f"(weight updates: {len(run.updates)})"),
        ("leaked placement groups", f"{len(groups)} {groups or ''}".strip()),
        ("leaked tokens", f"{held} (snapshot {'equals' if snap_ok else 'differs from'} the initial one"
                          + (f", {', '.join(cordoned)} cordoned)" if cordoned else ")")),
        ("time to recover, s", ", ".join(f"{k} {r:.1f}" for (k, _), r in zip(run.faults, recover, strict=True))
         or "-"),
        ("slowest step, s", f"{max(took):.1f} (median {statistics.median(took):.1f})"),
        ("wall time, s", f"{wall_s:.0f}"),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12, help="at least this many; more while faults remain")
    p.add_argument("--batch-size", type=int, default=4, help="tasks per step")
    p.add_argument("--n-samples", type=int, default=2, help="samples per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="2 steps, one engine kill: seconds, for a test")
    p.add_argument("--faults", nargs="+", choices=KINDS, help="inject only these (one each), e.g. --faults disk")
    a = p.parse_args()
    if a.smoke:
        a.steps = 2
    a.fault_window = (1.0, 3.0) if a.smoke else (5.0, 5.0 + 10.0 * len(a.faults)) if a.faults else (5.0, 75.0)
    a.results_dir = tempfile.mkdtemp(prefix="rayapp-chaos-results-")
    cluster, nodes, manager, pool_handle = start(a)
    try:
        initial = pool_handle.snapshot.remote().result(timeout_s=60)
        run, stop, t0 = Run(), threading.Event(), time.monotonic()
        # Faults from the main thread: Cluster.remove_node/add_node use signals, which only it may.
        faults_over = threading.Event()
        driver = threading.Thread(target=lambda: (drive(manager, a.steps, faults_over, run, 120, 8), stop.set()),
                                  daemon=True)
        driver.start()
        plan = plan_faults(a)
        run.planned = len(plan)
        chaos(plan, t0, run, stop, cluster, nodes, manager)
        faults_over.set()
        driver.join()
        wall_s = time.monotonic() - t0
        differ = chaos_disk.repeats_differ(manager, run.results, 120)
        snap, placement = settle(pool_handle, initial)
        rows = table(run, a, uncordoned(snap) == uncordoned(initial), placement.get("held_tokens", -1),
                     leaked_groups(), wall_s, placement.get("cordoned", []))
        at = [k for k, _ in rows].index("duplicated") + 1
        rows.insert(at, ("repeats answered differently", f"{differ} of {len(run.results)}"))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(a.results_dir, ignore_errors=True)
    width = max(len(k) for k, _ in rows)
    print(f"| {'chaos run':<{width}} | |\n|{'-' * (width + 2)}|---|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")
    for (node, error), n in run.aborts.most_common(6):
        print(f"  aborted on {node} x{n}: {error}")
    must_be_0 = ("lost", "duplicated", "stale-weight samples", "leaked placement groups", "leaked tokens")
    bad = [k for k, v in rows if k in must_be_0 and v.split()[0] != "0"] + (["repeats"] if differ else [])
    return 1 if bad or len(run.results) < run.requested_steps else 0


if __name__ == "__main__":
    process_auth_token()  # Ray's token auth on, with a throwaway token (never ~/.ray's)
    sys.exit(main())

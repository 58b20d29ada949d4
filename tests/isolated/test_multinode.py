"""A multi-node fake cluster (ray.cluster_utils.Cluster), a Ray of its own: tokens land on
the nodes the ledger chose, in each node's long-lived group, cross-node batches spread, and a node
removed mid-run turns its samples into infra aborts while the step still returns every sample, the
other node's group keeps working, the dead node is cordoned and the next step runs on the survivors."""

import asyncio
import os
import sys
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from rayapp.actors.app import HEAD  # noqa: E402
from rayapp.actors.pool_client import PoolClient  # noqa: E402
from rayapp.actors.pool_service import PlacementPoolService, run_in_bundle  # noqa: E402
from rayapp.cli.local_cluster import auth_token  # noqa: E402
from rayapp.core.agent import FunctionAgent  # noqa: E402
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler  # noqa: E402
from rayapp.envs.arithmetic import ArithmeticSource  # noqa: E402
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Status  # noqa: E402

# Ray workers cannot import this test module: ship its functions by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

LAYOUT = '{"node-a": {"gpus": [0, 1], "cpu": 4, "memory_gb": 1}, "node-b": {"gpus": [0, 1], "cpu": 4, "memory_gb": 1}}'


@pytest.fixture(scope="module")
def cluster():
    with auth_token():  # Ray's token authentication on, with a throwaway token
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1",
                                                           "include_dashboard": False})
        nodes = {name: c.add_node(num_cpus=4, num_gpus=2, labels={"rayapp.io/node": name},
                                  node_ip_address="127.0.0.1") for name in ("node-a", "node-b")}
        c.wait_for_nodes()
        ray.init(address=c.address, namespace="rayapp-multinode", logging_level="warning", log_to_driver=False)
        yield c, nodes
        ray.shutdown()
        c.shutdown()


def where_am_i(delay: float) -> tuple[str, str]:
    time.sleep(delay)
    return ray.get_runtime_context().get_node_id(), ray.util.get_current_placement_group().id.hex()


def make_spec(delay: float, seen: list, pieces: int = 1) -> EvaluatorSpec:
    """Each sample runs ``pieces`` tasks at once in its bundle: past four quarters of one GPU's bundle
    the rest wait there for a free share."""
    async def run(sample, ctx):
        done = await asyncio.gather(*(run_in_bundle(ctx.token, where_am_i, delay, timeout_s=120)
                                      for _ in range(pieces)))
        node_id, group_id = done[0]
        seen.append((ctx.token.node, node_id, group_id))
        return AgentResult(tokens=[1, 2], response_length=1, response=str(sample.label))

    verify = FunctionAgent(run, lambda s, r: {"score": 1.0})
    return EvaluatorSpec("arithmetic", verify, resource=Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=0.5),
                         run_resource=Resource(gpu=0.25, cpu=0.5, memory_gb=0.1), batch_size=4)


def start_pool():
    """The pool lives on the head node, as the app builder places it: losing a worker node must not
    take the ledger with it."""
    return ray.remote(PlacementPoolService).options(num_cpus=0, resources={HEAD: 0.001}).remote(
        LAYOUT, pg_ready_timeout_s=20)


def test_tokens_land_on_the_chosen_nodes_and_batches_spread(cluster):
    pool = start_pool()
    placement = ray.get(pool.placement.remote(), timeout=60)
    initial = ray.get(pool.snapshot.remote(), timeout=60)
    seen: list = []
    sched = TaskScheduler([make_spec(0.0, seen)], ArithmeticSource(), PoolClient(pool, "t1"),
                          SchedulerConfig(rollout_batch_size=4, progress=False))
    result = asyncio.run(sched.execute_rollout(0))
    assert all(s.status is Status.COMPLETED for g in result.groups for s in g)
    resolved = ray.get(pool.__ray_call__.remote(lambda self: self.node_ids), timeout=60)
    assert all(resolved[ledger_node] == ray_node for ledger_node, ray_node, _ in seen), seen
    assert {ledger_node for ledger_node, _, _ in seen} == {"node-a", "node-b"}  # one batch spread over both
    # each sample's work ran in its node's long-lived group, the one the pool reserved at start-up
    names = ray.get(pool.__ray_call__.remote(lambda self: self.groups.names), timeout=60)
    groups = {pg["name"]: i for i, pg in ray.util.placement_group_table().items() if pg["state"] == "CREATED"}
    assert all(group_id == groups[names[ledger_node]] for ledger_node, _, group_id in seen), seen
    assert ray.get(pool.snapshot.remote(), timeout=60) == initial
    assert placement["batches"] == {}
    ray.kill(pool)


def test_a_node_removed_mid_run_aborts_its_samples_and_the_step_returns_them_all(cluster):
    c, nodes = cluster
    pool = start_pool()
    initial = ray.get(pool.snapshot.remote(), timeout=60)
    seen: list = []
    # Three pieces per sample: some wait for their share in node-b's bundle when it dies. Ray keeps
    # those pending (its group is RESCHEDULING) until their 120 s timeout; the bundle watch ends them
    # as infra_sandbox instead.
    sched = TaskScheduler([make_spec(8.0, seen, pieces=3)], ArithmeticSource(seed=1), PoolClient(pool, "t2"),
                          SchedulerConfig(rollout_batch_size=4, progress=False))

    async def scenario():
        step = asyncio.create_task(sched.execute_rollout(0))
        await asyncio.sleep(4.0)  # every sample is inside its bundle by now
        await asyncio.to_thread(c.remove_node, nodes["node-b"])
        return await asyncio.wait_for(step, 300)

    result = asyncio.run(scenario())
    samples = [s for g in result.groups for s in g]
    assert len(samples) == 4
    aborted = [s for s in samples if s.status is Status.ABORTED]
    assert aborted and all(s.episode.placement.node == "node-b" for s in aborted)
    assert all(s.episode.reason == "infra_sandbox" for s in aborted)
    assert all(s.remove_sample and s.loss_mask == [0] for s in aborted)
    assert all(s.status is Status.COMPLETED for s in samples if s.episode.placement.node == "node-a")
    placement = ray.get(pool.placement.remote(), timeout=60)
    assert placement["lost_nodes"] == ["node-b"] and placement["groups"]["node-a"]["state"] == "CREATED"
    # node-b is cordoned: out of the free view, its tokens all back, nothing else changed
    assert placement["cordoned"] == ["node-b"] and set(placement["free"]) == {"node-a"}
    cordoned = {**initial, "node-b": {**initial["node-b"], "cordoned": True}}
    assert ray.get(pool.snapshot.remote(), timeout=60) == cordoned

    # The next step runs entirely on the surviving node: nothing is placed on node-b, nothing aborts.
    seen.clear()
    sched_next = TaskScheduler([make_spec(0.0, seen)], ArithmeticSource(seed=2), PoolClient(pool, "t2"),
                               SchedulerConfig(rollout_batch_size=4, progress=False))
    after = [s for g in asyncio.run(asyncio.wait_for(sched_next.execute_rollout(1), 120)).groups for s in g]
    assert len(after) == 4
    assert all(s.status is Status.COMPLETED and s.episode.placement.node == "node-a" for s in after)
    assert {ledger_node for ledger_node, _, _ in seen} == {"node-a"}
    assert ray.get(pool.snapshot.remote(), timeout=60) == cordoned
    ray.kill(pool)

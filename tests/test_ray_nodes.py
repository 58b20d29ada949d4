"""Layout nodes and Ray nodes: node resolution, and a layout read off the live cluster (what the
engines leave free; never more than a node has)."""

import pytest
from ray_helpers import stop

from rayapp.types import BatchRequest, Resource


def test_node_resolution_and_layout_from_cluster_are_pure():
    from rayapp.actors.nodes import NodeResolutionError, layout_from_cluster, resolve_nodes

    nodes = [
        {"Alive": True, "NodeID": "aa", "NodeManagerAddress": "10.0.0.1", "Labels": {},
         "Resources": {"CPU": 16.0, "GPU": 2.0, "memory": 64 * 2**30}},
        {"Alive": True, "NodeID": "bb", "NodeManagerAddress": "10.0.0.2", "Labels": {"rayapp.io/node": "gpu-b"},
         "Resources": {"CPU": 8.0, "GPU": 1.0, "memory": 32 * 2**30}},
        {"Alive": True, "NodeID": "cc", "NodeManagerAddress": "10.0.0.2", "Labels": {},
         "Resources": {"CPU": 4.0, "memory": 8 * 2**30}},
        {"Alive": False, "NodeID": "dd", "NodeManagerAddress": "10.0.0.9", "Labels": {}, "Resources": {"CPU": 4.0}},
    ]
    layout = layout_from_cluster(nodes)
    assert list(layout) == ["10.0.0.1", "gpu-b", "cc"]
    assert layout["10.0.0.1"].gpus == (0, 1) and layout["10.0.0.1"].memory_gb == 64
    assert layout_from_cluster(nodes, num_cpus=2)["gpu-b"].cpu == 2
    assert resolve_nodes(["10.0.0.1", "gpu-b", "cc"], nodes) == {"10.0.0.1": "aa", "gpu-b": "bb", "cc": "cc"}
    with pytest.raises(NodeResolutionError, match=r"'10\.0\.0\.2' matches 2 Ray nodes"):
        resolve_nodes(["10.0.0.2"], nodes)
    with pytest.raises(NodeResolutionError, match=r"'10\.0\.0\.9' matches no live Ray node"):
        resolve_nodes(["10.0.0.9"], nodes)


def test_a_node_group_read_off_the_live_cluster_never_asks_for_more_than_the_node_has():
    from rayapp.actors.nodes import layout_from_cluster
    from rayapp.actors.pool_service import node_bundles

    # Ray detects odd amounts (bytes of memory free at start, CPU in steps of 1e-4): rounding them to
    # the ledger's units must go down, or Ray can never make the node's group and the pool cannot start.
    for memory, cpu in ((17180917759, 7.9996), (16 * 2**30 + 2**19, 6.0005), (3 * 2**30 - 1, 1.0)):
        node = {"Alive": True, "NodeID": "aa", "NodeManagerAddress": "127.0.0.1", "Labels": {},
                "Resources": {"CPU": cpu, "GPU": 4.0, "memory": memory}}
        (spec,) = layout_from_cluster([node]).values()
        rest = node_bundles(spec)[-1]
        assert rest.get("memory", 0) <= memory and rest.get("CPU", 0) <= cpu + 1e-12, (rest, memory, cpu)


def test_a_layout_read_off_the_live_cluster_counts_only_what_the_engines_leave_free(ray_session):
    ray = ray_session
    from rayapp.actors.nodes import layout_from_cluster
    from rayapp.actors.pool_service import PlacementPoolService, remove_leftovers

    node = {"Alive": True, "NodeID": "aa", "NodeManagerAddress": "10.0.0.1", "Labels": {},
            "Resources": {"CPU": 16.0, "GPU": 4.0, "memory": 64 * 2**30}}
    free = {"aa": {"CPU": 12.0, "GPU": 2.5, "memory": 48 * 2**30}}  # an engine holds 1.5 GPUs
    (spec,) = layout_from_cluster([node], available=free).values()
    assert spec.gpus == (0, 1) and spec.cpu == 12 and spec.memory_gb == 48
    (capped,) = layout_from_cluster([node], num_cpus=20, memory_gb=8, available=free).values()
    assert capped.cpu == 12 and capped.memory_gb == 8  # the flags cap what is free, never raise it

    @ray.remote(num_gpus=1, num_cpus=2)
    class Engine:
        def ready(self):
            return True

    remove_leftovers()  # killed services' groups (Ray ties them to the job) would hold every GPU
    engine = Engine.remote()
    ray.get(engine.ready.remote(), timeout=60)
    service = ray.remote(PlacementPoolService).options(num_cpus=0).remote(None, pg_ready_timeout_s=10.0)
    try:
        # the session has 4 GPUs; the engine holds one: three are the pool's, and the check is true
        assert ray.get(service.max_tokens_for.remote(Resource(gpu=1)), timeout=60) == 3
        budget = Resource(gpu=3, concurrency=3)
        tokens = ray.get(service.acquire_batch.remote(BatchRequest(budget, Resource(gpu=1), 3, label="all")),
                         timeout=60)
        assert len(tokens) == 3
        ray.get(service.release_batch.remote(tokens), timeout=60)
    finally:
        stop(ray, service)
        ray.kill(engine)

"""The PlacementPool on real Ray placement groups (one local Ray, logical GPUs)."""

import asyncio

import pytest

from rayapp.types import BatchRequest, Resource

LAYOUT = '{"127.0.0.1": {"gpus": [0, 1, 2, 3], "cpu": 8, "memory_gb": 4}}'
QUARTER = Resource(gpu=0.25, cpu=0.5, memory_gb=0.25)


@pytest.fixture
def pool(ray_session):
    from rayapp.actors.pool import PlacementPoolService

    ray = ray_session
    actor = ray.remote(PlacementPoolService).options(num_cpus=0).remote(LAYOUT, pg_ready_timeout_s=2.0)
    initial = ray.get(actor.snapshot.remote(), timeout=30)
    yield actor
    assert ray.get(actor.snapshot.remote(), timeout=30) == initial, "the pool did not return to its initial state"
    assert ray.get(actor.placement.remote(), timeout=30)["batches"] == {}
    ray.kill(actor)


def pg_state(ray, name):
    states = [pg["state"] for pg in ray.util.placement_group_table().values() if pg["name"] == name]
    return states[-1] if states else None


def test_a_batch_group_exists_while_held_and_is_gone_after(ray_session, pool):
    ray = ray_session
    budget = Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1)
    tokens = ray.get(pool.acquire_batch.remote(BatchRequest(budget, QUARTER, 4, label="r0/b0/math")), timeout=30)
    assert len(tokens) == 4 and {t.placement_group for t in tokens} == {tokens[0].placement_group}
    name = tokens[0].placement_group
    assert name.startswith("rayapp/r0/b0/math/") and [t.bundle_index for t in tokens] == [0, 1, 2, 3]
    assert pg_state(ray, name) == "CREATED"
    held = ray.get(pool.placement.remote(), timeout=30)["batches"]
    assert [(t["placement_group"], t["bundle_index"], t["gpu"]) for b in held.values() for t in b["tokens"]] == [
        (name, i, 0.25) for i in range(4)]
    table = next(pg for pg in ray.util.placement_group_table().values() if pg["name"] == name)
    assert all(b == {"CPU": 0.5, "GPU": 0.25, "memory": 0.25 * 2**30} for b in table["bundles"].values())
    ray.get(pool.release_batch.remote(tokens), timeout=30)
    assert pg_state(ray, name) == "REMOVED"


def test_fractional_bundles_share_one_gpu_as_the_ledger_says(ray_session, pool):
    ray = ray_session
    from rayapp.actors.pool import bundle_strategy

    budget = Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1)
    tokens = ray.get(pool.acquire_batch.remote(BatchRequest(budget, QUARTER, 4, label="share")), timeout=30)
    try:
        assert len({t.gpu_ids for t in tokens}) == 1  # the ledger packed all four onto one GPU

        @ray.remote(num_gpus=0.25, num_cpus=0.5)
        def where():
            return ray.get_gpu_ids(), ray.get_runtime_context().get_node_id()

        seen = ray.get([where.options(scheduling_strategy=bundle_strategy(t)).remote() for t in tokens], timeout=60)
        assert len({tuple(g) for g, _ in seen}) == 1, f"Ray spread the quarters over GPUs: {seen}"
        # while they are held, Ray has exactly one GPU less to give
        assert ray.available_resources().get("GPU", 0) == pytest.approx(3.0)
    finally:
        ray.get(pool.release_batch.remote(tokens), timeout=30)


def test_an_oversubscribed_batch_waits_and_is_admitted_when_another_releases(ray_session, pool):
    ray = ray_session
    whole = Resource(gpu=4.0, concurrency=16, cpu=8, memory_gb=4)
    first = ray.get(pool.acquire_batch.remote(BatchRequest(whole, QUARTER, 16, label="first")), timeout=30)
    assert len(first) == 16
    waiting = pool.acquire_batch.remote(BatchRequest(whole, QUARTER, 16, label="second", timeout_s=60))
    ready, _ = ray.wait([waiting], timeout=1.0)
    assert not ready, "admitted while the pool was full"
    ray.get(pool.release_batch.remote(first), timeout=30)
    second = ray.get(waiting, timeout=30)
    assert len(second) == 16
    ray.get(pool.release_batch.remote(second), timeout=30)


def test_a_group_ray_cannot_satisfy_is_retried_until_the_timeout_with_nothing_leaked(ray_session):
    ray = ray_session
    from rayapp.actors.pool import PlacementPoolService

    # the ledger believes in 100 TB of memory; Ray has far less, so the group never becomes ready
    layout = '{"127.0.0.1": {"gpus": [0], "cpu": 8, "memory_gb": 100000}}'
    actor = ray.remote(PlacementPoolService).options(num_cpus=0).remote(layout, pg_ready_timeout_s=1.0)
    initial = ray.get(actor.snapshot.remote(), timeout=30)
    big = Resource(cpu=1, memory_gb=50000)
    request = BatchRequest(Resource(concurrency=1, cpu=1, memory_gb=50000), big, 1, label="too-big", timeout_s=2.5)
    with pytest.raises(TimeoutError, match=r"too-big.*refused \d+ times"):
        ray.get(actor.acquire_batch.remote(request), timeout=30)
    assert ray.get(actor.snapshot.remote(), timeout=30) == initial
    assert ray.get(actor.placement.remote(), timeout=30)["batches"] == {}
    assert all(pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values()
               if pg["name"].startswith("rayapp/too-big/"))
    ray.kill(actor)


def test_a_restarted_owner_frees_what_its_predecessor_held(ray_session, pool):
    ray = ray_session
    tokens = ray.get(pool.acquire_batch.remote(BatchRequest(Resource(gpu=1, concurrency=4, cpu=2, memory_gb=1), QUARTER,
                                                            4, label="orphan", owner="manager")), timeout=30)
    assert ray.get(pool.release_owner.remote("manager"), timeout=30) == 1
    assert pg_state(ray, tokens[0].placement_group) == "REMOVED"


def test_release_owner_cancels_the_acquires_a_dead_owner_left_waiting(ray_session, pool):
    ray = ray_session
    budget = Resource(gpu=4, concurrency=16, cpu=8, memory_gb=4)
    full = BatchRequest(budget, QUARTER, 16, label="full", owner="alive")
    held = ray.get(pool.acquire_batch.remote(full), timeout=30)
    waiting = pool.acquire_batch.remote(BatchRequest(budget, QUARTER, 4, label="orphan", owner="dead"))
    for _ in range(100):  # until the pool has the orphan in its queue
        if ray.get(pool.placement.remote(), timeout=30)["waiting"]:
            break
    assert ray.get(pool.placement.remote(), timeout=30)["waiting"] == 1
    assert ray.get(pool.release_owner.remote("dead"), timeout=30) == 0  # held nothing, waited for one
    with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
        ray.get(waiting, timeout=30)
    assert ray.get(pool.placement.remote(), timeout=30)["waiting"] == 0
    ray.get(pool.release_batch.remote(held), timeout=30)  # nothing was granted to the dead owner
    assert ray.get(pool.placement.remote(), timeout=30)["batches"] == {}


def test_releasing_a_foreign_or_partial_batch_is_refused(ray_session, pool):
    ray = ray_session
    tokens = ray.get(pool.acquire_batch.remote(BatchRequest(Resource(gpu=1, concurrency=4, cpu=2, memory_gb=1), QUARTER,
                                                            4, label="partial")), timeout=30)
    with pytest.raises(ray.exceptions.RayTaskError, match="released whole"):
        ray.get(pool.release_batch.remote(tokens[:2]), timeout=30)
    ray.get(pool.release_batch.remote(tokens), timeout=30)


def test_node_resolution_and_layout_from_cluster_are_pure():
    from rayapp.actors.pool import NodeResolutionError, layout_from_cluster, resolve_nodes

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


def test_acquire_cancelled_while_waiting_holds_nothing(ray_session, pool):
    ray = ray_session
    whole = Resource(gpu=4.0, concurrency=16, cpu=8, memory_gb=4)
    first = ray.get(pool.acquire_batch.remote(BatchRequest(whole, QUARTER, 16, label="hog")), timeout=30)
    waiting = pool.acquire_batch.remote(BatchRequest(whole, QUARTER, 16, label="cancelled", timeout_s=60))
    ray.wait([waiting], timeout=0.5)
    ray.cancel(waiting)
    with pytest.raises((ray.exceptions.TaskCancelledError, asyncio.CancelledError)):
        ray.get(waiting, timeout=30)
    ray.get(pool.release_batch.remote(first), timeout=30)

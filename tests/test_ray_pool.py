"""The PlacementPool on real Ray placement groups, one per layout node (one local Ray, logical GPUs)."""

import asyncio
import time

import pytest
from ray_helpers import pool_service, stop

from rayapp.types import BatchRequest, Resource

LAYOUT = '{"127.0.0.1": {"gpus": [0, 1, 2, 3], "cpu": 8, "memory_gb": 4}}'
QUARTER = Resource(gpu=0.25, cpu=0.5, memory_gb=0.25)


@pytest.fixture
def pool(ray_session):
    ray = ray_session
    with pool_service(ray, LAYOUT) as actor:
        initial = ray.get(actor.snapshot.remote(), timeout=30)
        yield actor
        assert ray.get(actor.snapshot.remote(), timeout=30) == initial, "the pool did not return to its initial state"
        assert ray.get(actor.placement.remote(), timeout=30)["batches"] == {}


class _NodeGroup(str):
    """Equal to the node's group name of any service: rayapp/node/127.0.0.1@<incarnation>."""

    def __eq__(self, other):
        return isinstance(other, str) and other.startswith(self + "@")

    __hash__ = str.__hash__


GROUP = _NodeGroup("rayapp/node/127.0.0.1")


def live_groups(ray):
    """Every rayapp group Ray has not removed: {id: (name, state)}."""
    return {i: (pg["name"], pg["state"]) for i, pg in ray.util.placement_group_table().items()
            if pg["name"].startswith("rayapp/") and pg["state"] != "REMOVED"}


def test_the_node_group_is_reserved_at_start_and_tokens_map_to_their_bundles(ray_session, pool):
    ray = ray_session
    (group,) = [pg for pg in ray.util.placement_group_table().values()
                if pg["name"] == GROUP and pg["state"] == "CREATED"]
    assert list(group["bundles"].values()) == [{"GPU": 1.0}] * 4 + [{"CPU": 8.0, "memory": 4 * 2**30}]
    before = live_groups(ray)
    budget = Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1)
    tokens = ray.get(pool.acquire_batch.remote(BatchRequest(budget, QUARTER, 4, label="r0/b0/math")), timeout=30)
    cpu_only = ray.get(pool.acquire_batch.remote(BatchRequest(Resource(concurrency=2, cpu=2), Resource(cpu=1), 2,
                                                              label="cpu")), timeout=30)
    try:
        (gpu,) = {t.gpu_ids for t in tokens}  # the ledger packed the four quarters onto one GPU
        assert [(t.placement_group, t.bundle_index) for t in tokens] == [(GROUP, gpu[0])] * 4
        assert [(t.placement_group, t.bundle_index) for t in cpu_only] == [(GROUP, 4)] * 2
        view = ray.get(pool.placement.remote(), timeout=30)
        held = {name: [(t["placement_group"], t["bundle_index"], t["gpu_ids"]) for t in b["tokens"]]
                for name, b in view["batches"].items()}
        assert sorted(held.values()) == sorted([[(GROUP, gpu[0], [gpu[0]])] * 4, [(GROUP, 4, [])] * 2])
        assert view["groups"]["127.0.0.1"]["state"] == "CREATED" and view["lost_nodes"] == []
    finally:
        ray.get(pool.release_batch.remote(tokens), timeout=30)
        ray.get(pool.release_batch.remote(cpu_only), timeout=30)
    assert live_groups(ray) == before, "admission made or removed a placement group"


def test_sample_work_runs_inside_its_bundle_and_quarters_share_the_gpu_as_the_ledger_says(ray_session, pool):
    ray = ray_session
    from rayapp.actors.pool_service import run_in_bundle, work_options

    def where():
        pg = ray.util.get_current_placement_group()
        return pg.id.hex(), tuple(ray.get_gpu_ids()), ray.get_runtime_context().get_assigned_resources()

    budget = Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1)
    tokens = ray.get(pool.acquire_batch.remote(BatchRequest(budget, QUARTER, 4, label="share")), timeout=30)
    try:
        async def run_all():
            return await asyncio.gather(*(run_in_bundle(t, where, timeout_s=60) for t in tokens))

        seen = asyncio.run(run_all())
        (group_id,) = [i for i, pg in ray.util.placement_group_table().items()
                       if pg["name"] == GROUP and pg["state"] == "CREATED"]
        assert {pg for pg, _, _ in seen} == {group_id}
        assert len({gpus for _, gpus, _ in seen}) == 1, f"Ray spread the quarters over GPUs: {seen}"
        assert all(sum(v for k, v in res.items() if k.startswith("GPU")) == pytest.approx(0.25) for _, _, res in seen)

        # Four quarters fill the GPU's bundle: a fifth piece of work there waits until one ends.
        @ray.remote
        class Gate:
            def __init__(self):
                self.open = False

            def set(self):
                self.open = True

            def is_open(self):
                return self.open

        gate = Gate.options(num_cpus=0).remote()

        def hold(g):
            while not ray.get(g.is_open.remote()):
                time.sleep(0.05)

        call = ray.remote(max_retries=0)(hold)
        holders = [call.options(**work_options(t)).remote(gate) for t in tokens]
        extra = call.options(**work_options(tokens[0])).remote(gate)
        ready, _ = ray.wait([extra], timeout=2.0)
        assert not ready, "Ray ran more work in the bundle than the ledger granted"
        ray.get(gate.set.remote(), timeout=30)
        ray.get([*holders, extra], timeout=60)
        ray.kill(gate)
    finally:
        ray.get(pool.release_batch.remote(tokens), timeout=30)


def test_releasing_tokens_early_admits_the_next_batch_with_the_groups_untouched(ray_session, pool):
    ray = ray_session
    whole = Resource(gpu=4.0, concurrency=16, cpu=8, memory_gb=4)
    before = live_groups(ray)
    first = ray.get(pool.acquire_batch.remote(BatchRequest(whole, QUARTER, 16, label="first")), timeout=30)
    four = Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1)
    waiting = pool.acquire_batch.remote(BatchRequest(four, QUARTER, 4, label="next", timeout_s=60))
    ready, _ = ray.wait([waiting], timeout=1.0)
    assert not ready, "admitted while the pool was full"
    done = [t for t in first if t.gpu_ids == first[0].gpu_ids]  # the samples on one GPU ended
    ray.get(pool.release_tokens.remote(done), timeout=30)
    second = ray.get(waiting, timeout=30)
    assert {t.gpu_ids for t in second} == {first[0].gpu_ids}  # the freed GPU, in the same bundle
    assert {(t.placement_group, t.bundle_index) for t in second} == {(done[0].placement_group, done[0].bundle_index)}
    assert live_groups(ray) == before, "early release made or removed a placement group"
    ray.get(pool.release_batch.remote(first), timeout=30)
    ray.get(pool.release_batch.remote(second), timeout=30)


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


def test_a_layout_ray_cannot_hold_fails_at_start_with_nothing_left(ray_session):
    ray = ray_session
    from rayapp.actors.pool_service import PlacementPoolService

    # the layout claims 100 TB of memory; Ray has far less, so the node's group never becomes ready
    layout = '{"127.0.0.1": {"gpus": [0], "cpu": 8, "memory_gb": 100000}}'
    actor = ray.remote(PlacementPoolService).options(num_cpus=0).remote(layout, pg_ready_timeout_s=1.0)
    with pytest.raises(ray.exceptions.RayActorError, match=r"could not reserve the layout of 1 nodes"):
        ray.get(actor.snapshot.remote(), timeout=60)
    assert live_groups(ray) == {}


def test_a_restarted_service_removes_what_its_dead_predecessor_left_and_makes_its_own(ray_session):
    ray = ray_session
    from rayapp.actors.pool_service import PlacementPoolService

    service = ray.remote(PlacementPoolService).options(num_cpus=0)
    old = service.remote(LAYOUT, pg_ready_timeout_s=10.0)
    budget = Resource(gpu=1, concurrency=4, cpu=2, memory_gb=1)
    # the old service held a batch when it was killed; Ray ties its groups to the job, so they stay
    stale = ray.get(old.acquire_batch.remote(BatchRequest(budget, QUARTER, 4, label="held")), timeout=30)
    old_name = ray.get(old.__ray_call__.remote(lambda self: self.groups.names["127.0.0.1"]), timeout=30)
    # a group left by the one-group-per-batch design (it cannot fit: the node group holds every GPU)
    stray = ray.util.placement_group([{"GPU": 1}], name="rayapp/rollout0/b0/math/1")
    (old_id,) = [i for i, (name, _) in live_groups(ray).items() if name == GROUP]
    stop(ray, old)
    new = service.remote(LAYOUT, pg_ready_timeout_s=10.0)
    try:
        tokens = ray.get(new.acquire_batch.remote(BatchRequest(budget, QUARTER, 4, label="fresh")), timeout=30)
        (new_id,) = [i for i, (name, state) in live_groups(ray).items() if name == GROUP and state == "CREATED"]
        assert new_id != old_id and live_groups(ray) == {new_id: (GROUP, "CREATED")}
        assert {t.placement_group for t in tokens} != {old_name}  # the new service's own group
        # the old service's samples cannot run in the new group unaccounted: a lost bundle, infra_sandbox
        from rayapp.actors.pool_service import run_in_bundle
        from rayapp.core.termination import SandboxError, classify_abort

        with pytest.raises(SandboxError, match="is gone") as info:
            asyncio.run(run_in_bundle(stale[0], sum, [1, 2], timeout_s=30))
        assert classify_abort(info.value).value == "infra_sandbox"
        assert ray.util.placement_group_table(stray)["state"] == "REMOVED"
        assert all(t.placement_group == GROUP for t in tokens)
        ray.get(new.release_batch.remote(tokens), timeout=30)
    finally:
        stop(ray, new)


def test_a_second_service_refuses_to_start_beside_a_live_one_and_leaves_its_groups_alone(ray_session):
    """Two applications on one cluster: the second pool service names the first and starts nothing;
    the first's groups stay, and its next batch runs in its bundle."""
    ray = ray_session
    from rayapp.actors.pool_service import PlacementPoolService, run_in_bundle

    service = ray.remote(PlacementPoolService)
    first = service.options(num_cpus=0, name="first-pool").remote(LAYOUT, pg_ready_timeout_s=10.0)
    try:
        ray.get(first.snapshot.remote(), timeout=30)
        before = live_groups(ray)
        second = service.options(num_cpus=0).remote(LAYOUT, pg_ready_timeout_s=0.5)
        with pytest.raises(ray.exceptions.RayActorError,
                           match=r"another pool service is running on this Ray cluster: actor first-pool .* holds"
                                 r" \['rayapp/node/127\.0\.0\.1@"):
            ray.get(second.snapshot.remote(), timeout=60)
        assert live_groups(ray) == before
        budget = Resource(gpu=1, concurrency=4, cpu=2, memory_gb=1)
        tokens = ray.get(first.acquire_batch.remote(BatchRequest(budget, QUARTER, 4, label="next")), timeout=30)
        assert asyncio.run(run_in_bundle(tokens[0], sum, [1, 2], timeout_s=30)) == 3
        ray.get(first.release_batch.remote(tokens), timeout=30)
    finally:
        stop(ray, first)


def test_a_restarted_owner_frees_what_its_predecessor_held(ray_session, pool):
    ray = ray_session
    tokens = ray.get(pool.acquire_batch.remote(BatchRequest(Resource(gpu=1, concurrency=4, cpu=2, memory_gb=1), QUARTER,
                                                            4, label="orphan", owner="manager")), timeout=30)
    assert ray.get(pool.release_owner.remote("manager"), timeout=30) == 1
    # the node's group stays for the next batch
    assert list(live_groups(ray).values()) == [(tokens[0].placement_group, "CREATED")]


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


def test_every_set_of_tokens_the_ledger_holds_fits_the_node_bundles_ray_reserves():
    import random

    from rayapp.actors.pool_service import NodeGroups, node_bundles, token_share
    from rayapp.core.ledger import Ledger
    from rayapp.types import NodeSpec

    layout = {"a": NodeSpec(gpus=(3, 5, 7), cpu=10.5, memory_gb=6.3), "b": NodeSpec(cpu=4, memory_gb=2)}
    assert node_bundles(layout["a"]) == [{"GPU": 1.0}] * 3 + [{"CPU": 10.5, "memory": round(6.3 * 1024) * 2**20}]
    assert node_bundles(NodeSpec(gpus=(0,))) == [{"GPU": 1.0}, {"CPU": 0.001}]
    hook = NodeGroups(layout, {"a": "id-a", "b": "id-b"})
    shapes = [Resource(gpu=g, cpu=c, memory_gb=m) for g in (0, 0.1, 0.25, 1 / 3, 0.5, 1, 2)
              for c in (0, 0.3, 1, 2.5) for m in (0, 0.07, 0.5)]
    rng = random.Random(7)
    for _ in range(200):
        ledger, held = Ledger(layout), []
        for _ in range(40):
            got = ledger.try_acquire_batch(Resource(gpu=99, concurrency=9, cpu=99, memory_gb=99), rng.choice(shapes),
                                           rng.randint(1, 3))
            held += got or []
            if held and rng.random() < 0.3:  # some end early, as samples do
                ledger.release([held.pop(rng.randrange(len(held)))])
        asked: dict = {}
        for t in held:
            bundle = asked.setdefault((t.node, hook.bundle_of(t)), {})
            share = token_share(t)
            assert bool(t.gpu_ids) == (hook.bundle_of(t) < len(layout[t.node].gpus))
            for key, ray_key in (("num_gpus", "GPU"), ("num_cpus", "CPU"), ("memory", "memory")):
                bundle[ray_key] = bundle.get(ray_key, 0) + share.get(key, 0)
        for (node, index), need in asked.items():
            have = node_bundles(layout[node])[index]
            assert all(v <= have.get(k, 0) + 1e-9 for k, v in need.items() if v), (node, index, need, have)


def test_a_service_stopped_in_order_removes_its_groups(ray_session):
    ray = ray_session
    from rayapp.actors.pool_service import PlacementPoolService

    service = PlacementPoolService(LAYOUT, pg_ready_timeout_s=10.0)  # in this process, as Serve's replica holds it
    assert [name for name, state in live_groups(ray).values() if state == "CREATED"] == [GROUP]
    del service  # Serve calls __del__ when it stops a replica
    assert live_groups(ray) == {}



def test_an_acquire_whose_caller_gave_up_is_withdrawn_or_its_grant_freed(ray_session, pool):
    from rayapp.actors.pool_client import PoolClient

    budget = Resource(gpu=4, concurrency=16, cpu=8, memory_gb=4)
    client = PoolClient(pool, "gone", call_timeout_s=0.5)

    async def scenario():
        held = await client.acquire_batch(BatchRequest(budget, QUARTER, 16, label="hog"))
        # Its caller stops waiting while it is parked: the client's cancel withdraws it.
        with pytest.raises(TimeoutError):
            await client.acquire_batch(BatchRequest(budget, QUARTER, 4, label="parked", timeout_s=0.5))
        for _ in range(100):
            if not (await client.placement())["waiting"]:
                break
            await asyncio.sleep(0.05)
        assert (await client.placement())["waiting"] == 0
        await client.release_batch(held)
        # Granted, but its caller is gone by the time the answer lands: cancel(request_id) frees it.
        tokens = await pool.acquire_batch.remote(BatchRequest(budget, QUARTER, 4, label="late", owner="gone"), "r-late")
        assert tokens and await pool.cancel.remote("r-late") == "released"
        assert (await client.placement())["batches"] == {}

    asyncio.run(scenario())


def test_an_owner_that_stops_renewing_has_its_batches_freed_after_the_lease(ray_session):
    ray = ray_session
    from rayapp.actors.pool_client import PoolClient
    from rayapp.actors.pool_service import PlacementPoolService

    actor = ray.remote(PlacementPoolService).options(num_cpus=0).remote(LAYOUT, pg_ready_timeout_s=10.0,
                                                                        state_poll_s=0.2, lease_s=2.0)
    try:
        budget = Resource(gpu=1, concurrency=4, cpu=2, memory_gb=1)
        live = PoolClient(actor, "live", renew_s=0.3)

        async def scenario():
            await live.acquire_batch(BatchRequest(budget, QUARTER, 4, label="kept"))
            # a manager that hangs: it got its batch, then never calls again
            await actor.acquire_batch.remote(BatchRequest(budget, QUARTER, 4, label="hung", owner="hung"))
            for _ in range(100):
                owners = {b["owner"] for b in (await live.placement())["batches"].values()}
                if owners == {"live"}:
                    break
                await asyncio.sleep(0.1)
            return owners

        assert asyncio.run(scenario()) == {"live"}  # the renewing client keeps its batch
        assert ray.get(actor.release_owner.remote("live"), timeout=30) == 1
    finally:
        ray.kill(actor)


def test_a_sandbox_host_carries_its_episode_and_a_task_only_its_functions_name(ray_session, pool):
    # the sandbox host a sample starts shows its episode (EPISODE, set by the evaluator) in the dashboard's
    # actor list; a task is named after its function alone: Ray keeps nine ray_tasks series per task name
    # for good, and one name per episode grew the manager with every step (issue 19 point 8)
    ray = ray_session
    from rayapp.actors.pool_service import run_in_bundle
    from rayapp.actors.sandbox import open_sandbox
    from rayapp.episode import EPISODE

    def task_name():
        return ray.get_runtime_context().get_task_name()

    budget = Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1)
    tokens = ray.get(pool.acquire_batch.remote(BatchRequest(budget, QUARTER, 1, label="named")), timeout=30)
    try:
        async def episode(name):
            EPISODE.set(name)
            names = {await run_in_bundle(tokens[0], task_name, timeout_s=60) for _ in range(2)}
            sandbox = await open_sandbox(tokens[0])
            try:
                host = await sandbox.actor.__ray_call__.remote(lambda self: repr(self))
            finally:
                await sandbox.close()
            return names, host

        assert asyncio.run(episode("rollout3/swe-2#1")) == ({"task_name"}, "SandboxHost(rollout3/swe-2#1)")
        assert asyncio.run(episode("rollout4/swe-7#0")) == ({"task_name"}, "SandboxHost(rollout4/swe-7#0)")
    finally:
        ray.get(pool.release_batch.remote(tokens), timeout=30)

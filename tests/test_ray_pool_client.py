"""The pool service's calls as the manager's client makes them (one local Ray, logical GPUs): packed
on the wire, releases sent in the background, and the group states read once per period."""

import asyncio

import msgspec
import pytest
from ray_helpers import pool_service

from rayapp.types import BatchRequest, Resource

LAYOUT = '{"127.0.0.1": {"gpus": [0, 1, 2, 3], "cpu": 8, "memory_gb": 4}}'
QUARTER = Resource(gpu=0.25, cpu=0.5, memory_gb=0.25)


@pytest.fixture
def pool(ray_session):
    """A service on the whole layout that must end with nothing held."""
    with pool_service(ray_session, LAYOUT) as actor:
        initial = ray_session.get(actor.snapshot.remote(), timeout=30)
        yield actor
        assert ray_session.get(actor.snapshot.remote(), timeout=30) == initial, "tokens left held"


def test_the_service_reads_its_groups_states_once_per_period_however_often_it_admits(monkeypatch):
    """The background watcher reads every ``state_poll_s``; admissions in between use its reading
    (one GCS read per period, not one more at each period's edge). Virtual time, Ray's groups faked."""
    from rayapp.actors import pool_service as pool_mod
    from rayapp.core.clock import run_virtual

    reads: list = []

    class Groups(pool_mod.NodeGroups):
        def start(self, timeout_s):
            pass

        def states(self):
            reads.append(1)
            return {node: "CREATED" for node in self.layout}

    monkeypatch.setattr(pool_mod, "NodeGroups", Groups)
    monkeypatch.setattr(pool_mod.ray, "nodes", lambda: [])
    monkeypatch.setattr(pool_mod, "resolve_nodes", lambda names, nodes: {n: f"id-{n}" for n in names})
    service = pool_mod.PlacementPoolService(LAYOUT, state_poll_s=1.0, lease_s=None)

    async def expire_leases():  # the watcher's other work takes time too, between its read and its sleep
        await asyncio.sleep(0.05)
        return 0

    service.pool.expire_leases = expire_leases
    budget = Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1)

    async def admit_for(seconds: float) -> int:
        loop, admitted = asyncio.get_running_loop(), 0
        end = loop.time() + seconds
        while loop.time() < end:  # an admission every 10 ms, landing on every edge of the period
            tokens = await service.acquire_batch(BatchRequest(budget, QUARTER, 4, label=f"b{admitted}"))
            await service.release_batch(tokens)
            admitted += 1
            await asyncio.sleep(0.01)
        service._watch.cancel()
        return admitted

    assert run_virtual(admit_for(50.0)) > 500  # many admissions in every period
    assert 45 <= len(reads) <= 51  # one read per period (1 s + the watcher's 50 ms) over 50 s, none on demand


def test_a_background_release_lands_before_the_clients_next_call_and_a_refusal_is_logged(ray_session, pool,
                                                                                         caplog):
    from rayapp.actors.pool_client import PoolClient

    client = PoolClient(pool, "bg", background_release=True)
    whole = BatchRequest(Resource(gpu=4.0, concurrency=16, cpu=8, memory_gb=4), QUARTER, 16, label="all")

    async def scenario():
        for _ in range(5):  # the whole layout each time: the next grant needs the last release applied
            tokens = await client.acquire_batch(whole)
            await client.release_batch(tokens)  # returns once sent
            assert (await client.placement())["batches"] == {}  # sent after it: sees it applied
        tokens = await client.acquire_batch(whole)
        await client.release_batch(tokens[:3])  # a partial batch: refused by the pool, logged here
        await client.drain()
        assert len((await client.placement())["batches"]) == 1
        await client.release_batch(tokens)
        await client.drain()

    asyncio.run(scenario())
    assert any("background release_batch of 3 tokens failed" in r.getMessage() for r in caplog.records)


def test_the_clients_packed_call_gets_the_tokens_a_plain_call_would_and_bad_packed_input_changes_nothing(
        ray_session, pool):
    from rayapp.actors.pool_client import PoolClient
    from rayapp.core.units import PoolError
    from rayapp.types import Token

    request = BatchRequest(Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1), QUARTER, 4, label="packed")

    async def scenario():
        tokens = await PoolClient(pool, "packed").acquire_batch(request)
        plain = await pool.acquire_batch.remote(msgspec.structs.replace(request, owner="plain"))  # the Structs
        view = await pool.placement.remote()
        try:
            assert all(type(t) is Token for t in tokens) and len(tokens) == 4
            assert {(t.placement_group, t.gpu, t.cpu) for t in tokens} == {(t.placement_group, t.gpu, t.cpu)
                                                                           for t in plain}
            held = {b["owner"]: sorted((t["node"], tuple(t["gpu_ids"]), t["bundle_index"]) for t in b["tokens"])
                    for b in view["batches"].values()}
            assert held["packed"] == sorted((t.node, t.gpu_ids, t.bundle_index) for t in tokens)
            for call, what in ((pool.release_batch.remote(b"\xc1"), "release_batch: the packed tokens"),
                               (pool.acquire_batch.remote(b"\x93\x01"), "acquire_batch: the packed request")):
                with pytest.raises(PoolError, match=f"{what} did not decode"):
                    await call
            assert await pool.placement.remote() == view  # refused: nothing changed
        finally:
            await PoolClient(pool, "packed").release_batch(tokens)
            await pool.release_batch.remote(plain)

    asyncio.run(scenario())

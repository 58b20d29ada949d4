"""LeasedPool: a grant whose caller is gone is freed, by a cancel naming its request id or when its
owner's lease runs out (virtual time: the loop's clock jumps over the waits)."""

from __future__ import annotations

import asyncio

import pytest
from pool_helpers import node, req

from rayapp.core.clock import run_virtual
from rayapp.core.leases import LeasedPool
from rayapp.core.pool import PoolError
from rayapp.types import Resource

GPU = Resource(gpu=1)
LONG = 3600


def leased(lease_s=60.0) -> LeasedPool:
    return LeasedPool({"a": node(2)}, lease_s=lease_s)


def test_cancel_frees_a_grant_whose_caller_is_gone_and_withdraws_a_waiter():
    async def main():
        pool = leased()
        initial = pool.snapshot()
        await pool.acquire_batch(req(GPU, 2, owner="m"), request_id="r1")  # its caller timed out meanwhile
        waiting = asyncio.create_task(pool.acquire_batch(req(GPU, 1, owner="m", timeout_s=LONG), request_id="r2"))
        await asyncio.sleep(0)
        assert pool.waiting == 1
        assert await pool.cancel("r2") == "withdrawn"
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pool.waiting == 0 and pool.held == 2
        assert await pool.cancel("r1") == "released"
        assert pool.held == 0 and pool.batches() == [] and pool.snapshot() == initial
        assert await pool.cancel("r1") == "early"  # its batch is gone: nothing left to free

    run_virtual(main())


def test_a_cancel_that_overtakes_its_acquire_refuses_it_and_ids_are_unique():
    async def main():
        pool = leased()
        assert await pool.cancel("r3") == "early"
        with pytest.raises(PoolError, match="cancelled before it came"):
            await pool.acquire_batch(req(GPU, 1), request_id="r3")
        got = await pool.acquire_batch(req(GPU, 1), request_id="r4")
        with pytest.raises(PoolError, match="in use"):
            await pool.acquire_batch(req(GPU, 1), request_id="r4")
        await pool.release_batch(got)  # released by its caller: the id is done with
        assert await pool.cancel("r4") == "early" and pool.held == 0
        with pytest.raises(PoolError, match="request_id"):
            await pool.acquire_batch(req(GPU, 1), request_id=7)

    run_virtual(main())


def test_an_owner_that_stops_renewing_loses_its_batches_after_the_lease_and_a_renewing_one_keeps_them():
    async def main():
        pool = leased(lease_s=60)
        dead = await pool.acquire_batch(req(GPU, 1, owner="hung"))
        alive = await pool.acquire_batch(req(GPU, 1, owner="live"))
        for _ in range(4):
            await asyncio.sleep(20)
            pool.renew("live")
            await pool.expire_leases()
        assert [b.owner for b in pool.batches()] == ["live"]  # 80 s: the hung owner's lease ran out
        await pool.release_batch(dead)  # its late release is ignored, not an error
        await pool.release_batch(alive)
        assert pool.held == 0

    run_virtual(main())


def test_an_expired_owner_waiting_for_room_is_cancelled_and_a_later_acquire_expires_it_first():
    async def main():
        pool = leased(lease_s=60)
        hog = await pool.acquire_batch(req(GPU, 2, owner="hung"))
        waiting = asyncio.create_task(pool.acquire_batch(req(GPU, 1, owner="hung", timeout_s=LONG)))
        await asyncio.sleep(61)
        got = await pool.acquire_batch(req(GPU, 2, owner="live", timeout_s=LONG))  # expires "hung" first
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert [b.owner for b in pool.batches()] == ["live"]
        await pool.release_batch(got)
        await pool.release_batch(hog)
        assert pool.held == 0

    run_virtual(main())


def test_lease_of_none_never_expires_and_bad_leases_are_refused():
    async def main():
        pool = leased(lease_s=None)
        got = await pool.acquire_batch(req(GPU, 1, owner="m"))
        await asyncio.sleep(10**6)
        assert await pool.expire_leases() == 0 and pool.held == 1
        await pool.release_batch(got)

    run_virtual(main())
    for bad in (0, -1, True, "60"):
        with pytest.raises(PoolError, match="lease_s"):
            LeasedPool({"a": node(1)}, lease_s=bad)

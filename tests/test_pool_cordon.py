"""PlacementPool with cordoned nodes (their reservation is lost): no new tokens there, capacity and
waiters adjusted at once, held tokens released as usual."""

from __future__ import annotations

import asyncio

import pytest
from pool_helpers import ScriptedHook, node, pool_of, req

from rayapp.core.pool import PlacementPool, PoolError
from rayapp.types import Resource

GPU = Resource(gpu=1)
LONG = 3600




def test_a_cordoned_node_gets_no_new_tokens_and_its_held_tokens_release_normally():
    async def main():
        pool = pool_of(a=node(2), b=node(2))
        initial = pool.snapshot()
        on_b = [t for t in await pool.acquire_batch(req(GPU, 4)) if t.node == "b"]
        assert pool.cordon("b") and not pool.cordon("b")
        assert pool.capacity_for(GPU) == 2 and set(pool.free()) == {"a"} and pool.cordoned == ["b"]
        batch = next(b for b in pool.batches() if b.tokens[0] in on_b or on_b[0] in b.tokens)
        await pool.release_batch(list(batch.tokens))  # the dead node's tokens go back as usual
        assert pool.snapshot()["b"]["held"] == 0
        got = await pool.acquire_batch(req(GPU, 2, timeout_s=LONG))
        assert {t.node for t in got} == {"a"}  # b is free, but cordoned
        await pool.release_batch(got)
        assert pool.uncordon("b") and pool.capacity_for(GPU) == 4
        assert pool.snapshot() == initial

    asyncio.run(main())


def test_waiters_that_can_no_longer_fit_fail_at_once_when_a_node_is_cordoned():
    async def main():
        pool = pool_of(a=node(2), b=node(2))
        hold = await pool.acquire_batch(req(GPU, 4))
        big = asyncio.create_task(pool.acquire_batch(req(GPU, 3, label="big", timeout_s=LONG)))
        await asyncio.sleep(0)
        small = asyncio.create_task(pool.acquire_batch(req(GPU, 2, label="small", timeout_s=LONG)))
        await asyncio.sleep(0)
        assert pool.waiting == 2
        pool.cordon("b")
        with pytest.raises(PoolError, match=r"big: 3 tokens .* can never fit; the whole pool holds 2 .*\[.b.\]"):
            await asyncio.wait_for(big, LONG)
        assert not small.done() and pool.waiting == 1  # two GPUs still fit: it waits for a release
        await pool.release_batch(hold)
        got = await asyncio.wait_for(small, LONG)
        assert {t.node for t in got} == {"a"}
        await pool.release_batch(got)
        with pytest.raises(PoolError, match="can never fit"):
            await pool.acquire_batch(req(GPU, 3))
        assert pool.held == 0 and pool.waiting == 0

    asyncio.run(main())


def test_a_node_cordoned_while_the_hook_realises_a_grant_is_placed_anew():
    class CordonDuringReserve(ScriptedHook):
        async def reserve(self, name, tokens):
            if "b" not in pool.cordoned and any(t.node == "b" for t in tokens):
                pool.cordon("b")
            return await super().reserve(name, tokens)

    async def main():
        got = await pool.acquire_batch(req(GPU, 2, timeout_s=LONG))
        assert {t.node for t in got} == {"a"} and pool.snapshot()["b"]["held"] == 0
        await pool.release_batch(got)
        assert not hook.held

    hook = CordonDuringReserve()
    pool = PlacementPool({"a": node(2), "b": node(2)}, hook)
    asyncio.run(main())

"""PlacementPool admission (docs/scheduler.md §3): waiting (wake-up, timeout, cancellation, FIFO), the reservation
hook (refusal retried at the head of the queue, errors and cancellation holding nothing), and
batches tracked with their owners."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from pool_helpers import HookError, ScriptedHook, node, placed, pool_of, req, take

from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool, PoolError
from rayapp.types import BatchRequest, Resource, Token

GPU = Resource(gpu=1)
LONG = 3600  # a bound no test reaches: a hang fails the test instead of stalling it


def count_tries(pool: PlacementPool) -> list[int]:
    calls = [0]
    real = pool._try

    def counted(*args):
        calls[0] += 1
        return real(*args)

    pool._try = counted
    return calls


def hooked(n_gpus: int, script: list[str] = (), retry_s: float = LONG) -> tuple[PlacementPool, ScriptedHook]:
    hook = ScriptedHook(script)
    return PlacementPool({"a": node(n_gpus)}, hook, retry_s=retry_s), hook


# ---- waiting --------------------------------------------------------------------------------------


def test_waiter_is_admitted_by_a_release_not_by_polling():
    async def main():
        pool = pool_of(a=node(1))
        holder = take(pool, GPU)
        tries = count_tries(pool)
        events: list[str] = []

        async def wait():
            got = await pool.acquire_batch(req(Resource(gpu=0.5), 2, timeout_s=LONG))
            events.append("admitted")
            return got

        task = asyncio.create_task(wait())
        await asyncio.sleep(0.05)  # a poller would have retried many times by now
        assert not task.done() and tries[0] == 1 and pool.waiting == 1
        events.append("released")
        pool.release(holder)
        got = await asyncio.wait_for(task, LONG)
        assert events == ["released", "admitted"] and tries[0] == 2
        assert placed(got) == [("a", (0,)), ("a", (0,))] and pool.waiting == 0
        await pool.release_batch(got)

    asyncio.run(main())


def test_timeout_raises_and_holds_nothing():
    async def main():
        pool = pool_of(a=node(1))
        holder = take(pool, Resource(gpu=0.6))
        before = pool.snapshot()
        with pytest.raises(TimeoutError, match="not admitted within"):
            await pool.acquire_batch(req(Resource(gpu=0.5), 1, timeout_s=0.01))
        assert pool.snapshot() == before and pool.held == 1 and pool.waiting == 0
        pool.release(holder)
        assert len(await pool.acquire_batch(req(Resource(gpu=0.5), 2, timeout_s=0.01))) == 2

    asyncio.run(main())


def test_cancellation_holds_nothing_and_keeps_the_queue_working():
    async def main():
        pool = pool_of(a=node(2))
        holder = take(pool, GPU, 2)
        first = asyncio.create_task(pool.acquire_batch(req(GPU, 2)))
        second = asyncio.create_task(pool.acquire_batch(req(GPU, 1)))
        await asyncio.sleep(0)
        assert pool.waiting == 2
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert pool.waiting == 1 and pool.held == 2
        pool.release(holder[:1])
        assert len(await asyncio.wait_for(second, LONG)) == 1  # the new head was woken and admitted
        assert pool.held == 2 and pool.waiting == 0

    asyncio.run(main())


def test_fifo_big_waiter_is_not_starved_by_later_small_ones():
    async def main():
        pool = pool_of(a=node(4))
        holder = take(pool, GPU, 3)
        big = asyncio.create_task(pool.acquire_batch(req(GPU, 4)))
        await asyncio.sleep(0)
        small = asyncio.create_task(pool.acquire_batch(req(GPU, 1)))
        await asyncio.sleep(0.01)
        assert not small.done()  # one GPU is free, but the earlier big batch is first in line
        pool.release(holder)
        big_tokens = await asyncio.wait_for(big, LONG)
        await asyncio.sleep(0.01)
        assert len(big_tokens) == 4 and not small.done()
        await pool.release_batch(big_tokens)
        assert len(await asyncio.wait_for(small, LONG)) == 1

    asyncio.run(main())


def test_a_batch_that_can_never_fit_fails_fast():
    async def main():
        pool = pool_of(a=node(1))
        take(pool, GPU)
        with pytest.raises(PoolError, match="can never fit"):
            await pool.acquire_batch(req(Resource(gpu=0.5), 3))
        assert pool.waiting == 0

    asyncio.run(main())


# ---- the reservation hook -------------------------------------------------------------------------


def test_a_refused_batch_retries_at_the_head_and_a_later_small_one_does_not_overtake_it():
    async def main():
        pool, hook = hooked(4, ["none"])
        initial = pool.snapshot()
        big = asyncio.create_task(pool.acquire_batch(req(GPU, 4, label="big")))
        await asyncio.sleep(0)
        # refused once: the ledger is rolled back, the hook holds nothing, big waits at the head
        assert hook.calls == ["big/1"] and pool.snapshot() == initial and not hook.held and pool.waiting == 1
        small = asyncio.create_task(pool.acquire_batch(req(GPU, 1, label="small")))
        await asyncio.sleep(0.01)
        assert not small.done() and not big.done()  # the ledger has room for small, but big is first
        pool.release(take(pool, Resource(cpu=1)))  # any release wakes the head, back-off or not
        big_tokens = await asyncio.wait_for(big, LONG)
        await asyncio.sleep(0.01)
        assert [t.placement_group for t in big_tokens] == ["big/2"] * 4 and [t.bundle_index for t in big_tokens] == [
            0, 1, 2, 3]
        assert not small.done() and hook.calls == ["big/1", "big/2"]
        await pool.release_batch(big_tokens)
        small_tokens = await asyncio.wait_for(small, LONG)
        assert hook.calls[-1] == "small/3" and set(hook.held) == {t.token_id for t in small_tokens}
        await pool.release_batch(small_tokens)
        assert pool.snapshot() == initial and not hook.held

    asyncio.run(main())


def test_a_refused_head_retries_after_its_back_off_without_any_release():
    async def main():
        pool, hook = hooked(2, ["none", "none"], retry_s=0.001)
        tokens = await asyncio.wait_for(pool.acquire_batch(req(GPU, 2)), LONG)
        assert len(hook.calls) == 3 and len(tokens) == 2
        await pool.release_batch(tokens)

    asyncio.run(main())


def test_a_timeout_after_refusals_says_so_and_holds_nothing():
    async def main():
        pool, hook = hooked(2, ["none"] * 10_000, retry_s=0.001)
        initial = pool.snapshot()
        with pytest.raises(TimeoutError, match=r"not admitted within 0\.05s .*refused \d+ times"):
            await pool.acquire_batch(req(GPU, 2, timeout_s=0.05))
        assert pool.snapshot() == initial and not hook.held and pool.waiting == 0 and hook.calls

    asyncio.run(main())


@pytest.mark.parametrize("how", ["raise", "timeout", "cancel"])
def test_a_hook_that_raises_or_is_cancelled_leaves_nothing_held_and_the_next_waiter_goes_on(how):
    async def main():
        pool, hook = hooked(2, ["raise" if how == "raise" else "hang"])
        initial = pool.snapshot()
        first = asyncio.create_task(pool.acquire_batch(req(GPU, 2, timeout_s=0.05 if how == "timeout" else None)))
        await asyncio.sleep(0)
        second = asyncio.create_task(pool.acquire_batch(req(GPU, 1)))
        await asyncio.sleep(0)
        if how == "cancel":
            first.cancel()
        error = {"raise": HookError, "timeout": TimeoutError, "cancel": asyncio.CancelledError}[how]
        with pytest.raises(error):
            await asyncio.wait_for(first, LONG)
        tokens = await asyncio.wait_for(second, LONG)  # the failed head let the next one in
        assert hook.pending == 0 and len(tokens) == 1 and set(hook.held) == {tokens[0].token_id}
        await pool.release_batch(tokens)
        assert pool.snapshot() == initial and pool.waiting == 0

    asyncio.run(main())


def test_a_hook_that_answers_with_other_tokens_is_an_error_and_is_released():
    class Liar(ScriptedHook):
        async def reserve(self, name, tokens):
            got = await super().reserve(name, tokens)
            return [msgspec.structs.replace(got[0], gpu_ids=(9,)), *got[1:]]

        async def release(self, tokens):
            self.held.clear()

    async def main():
        hook = Liar()
        pool = PlacementPool({"a": node(2)}, hook)
        with pytest.raises(PoolError, match="must return the 2 tokens it was given"):
            await pool.acquire_batch(req(GPU, 2))
        assert not hook.held and pool.held == 0 and pool.batches() == []

    asyncio.run(main())


def test_a_hook_whose_release_fails_still_gives_the_ledger_back():
    class Sticky(ScriptedHook):
        async def release(self, tokens):
            raise HookError("Ray is gone")

    async def main():
        pool = PlacementPool({"a": node(2)}, Sticky())
        initial = pool.snapshot()
        tokens = await pool.acquire_batch(req(GPU, 2))
        with pytest.raises(HookError):
            await pool.release_batch(tokens)
        assert pool.snapshot() == initial and pool.batches() == []

    asyncio.run(main())


# ---- batches and owners ---------------------------------------------------------------------------


def test_a_batch_goes_back_whole_and_only_through_release_batch():
    async def main():
        pool, hook = hooked(4)
        a = await pool.acquire_batch(req(GPU, 2, label="a", owner="m"))
        b = await pool.acquire_batch(req(GPU, 1, label="b", owner="m"))
        loose = take(pool, GPU)
        before = pool.snapshot()
        with pytest.raises(PoolError, match="a/1: a batch is released whole"):
            await pool.release_batch(a[:1])
        with pytest.raises(PoolError, match="3 tokens of 2 batches"):
            await pool.release_batch([*a, *b])
        with pytest.raises(PoolError, match="belongs to batch 'b/2'"):
            pool.release(b)
        with pytest.raises(PoolError, match="try_acquire_batch"):
            await pool.release_batch(loose)
        assert pool.snapshot() == before and len(hook.held) == 3
        assert [(x.name, x.owner, list(x.tokens)) for x in pool.batches()] == [("a/1", "m", a), ("b/2", "m", b)]
        await pool.release_batch(a)
        await pool.release_batch(a)  # already freed (say, by release_owner): a warning, nothing else
        await pool.release_batch([])
        await pool.release_batch(b)
        pool.release(loose)
        assert pool.held == 0 and not hook.held

    asyncio.run(main())


def test_release_owner_frees_its_batches_and_cancels_its_waiting_acquires():
    async def main():
        pool, hook = hooked(4)
        initial = pool.snapshot()
        dead = await pool.acquire_batch(req(GPU, 2, owner="dead"))
        alive = await pool.acquire_batch(req(GPU, 1, owner="alive"))
        orphan = asyncio.create_task(pool.acquire_batch(req(GPU, 4, owner="dead")))
        await asyncio.sleep(0)
        assert pool.waiting == 1
        assert await pool.release_owner("dead") == 1
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(orphan, LONG)
        assert pool.waiting == 0 and [b.owner for b in pool.batches()] == ["alive"]
        assert set(hook.held) == {t.token_id for t in alive}
        await pool.release_batch(dead)  # the dead owner's late release changes nothing
        await pool.release_batch(alive)
        assert pool.snapshot() == initial and await pool.release_owner("dead") == 0

    asyncio.run(main())


def test_tokens_from_the_ledger_alone_carry_no_reservation():
    async def main():
        pool = pool_of(a=node(2))
        tokens = await pool.acquire_batch(req(GPU, 2, owner="m"))
        assert [(t.placement_group, t.bundle_index) for t in tokens] == [("", -1)] * 2
        assert await pool.release_owner("m") == 1 and pool.held == 0
        assert await pool.acquire_batch(req(GPU, 0)) == [] and pool.batches() == []  # nothing to track

    asyncio.run(main())


def test_batch_request_budget_sizes_the_batch():
    async def main():
        pool = pool_of(a=node(2))
        tokens = await pool.acquire_batch(req(Resource(gpu=0.33), 10, budget=Resource(gpu=0.99, concurrency=9)))
        assert len(tokens) == 3 and all(isinstance(t, Token) for t in tokens)
        await pool.release_batch(tokens)

    asyncio.run(main())


def test_tokens_given_back_early_free_their_capacity_at_once_and_the_batch_closes_whole():
    async def main():
        hook = ScriptedHook()
        pool = PlacementPool({"a": node(2)}, hook)
        initial = pool.snapshot()
        first = await pool.acquire_batch(req(GPU, 2, label="first"))
        waiter = asyncio.create_task(pool.acquire_batch(req(GPU, 1, label="second")))
        await asyncio.sleep(0)
        assert pool.waiting == 1
        await pool.release_tokens(first[:1])  # its sample ended and nothing of its batch waits for a token
        second = await asyncio.wait_for(waiter, LONG)  # admitted while the first batch still runs
        assert second[0].gpu_ids == first[0].gpu_ids and hook.held.keys() == {first[1].token_id, second[0].token_id}
        assert [list(b.tokens) for b in pool.batches()] == [first[1:], second]
        with pytest.raises(PoolError, match="release_tokens"):
            await pool.release_tokens(first[:1])  # already back
        with pytest.raises(PoolError, match="release_tokens"):
            await pool.release_tokens([first[1], second[0]])  # two batches at once
        with pytest.raises(PoolError, match="released whole"):
            await pool.release_batch(first[1:])  # a batch closes with every token it was granted
        await pool.release_batch(first)  # what it still holds goes back
        await pool.release_batch(second)
        assert pool.snapshot() == initial and not hook.held and pool.batches() == []

    asyncio.run(main())


def test_release_tokens_after_release_owner_freed_the_batch_is_tolerated_like_release_batch():
    """pool.py: release_batch of a batch release_owner already freed is 'ignored with a warning' (the
    presumed-dead owner was alive after all); release_tokens of the same tokens raises PoolError, so
    the same race fails a step only when the batch gave tokens back early."""
    pool = PlacementPool(parse_cluster_layout('{"n0": {"gpus": [0, 1], "cpu": 8, "memory_gb": 64}}', 8, 64))
    initial = pool.snapshot()

    async def main():
        tokens = await pool.acquire_batch(BatchRequest(Resource(gpu=2), Resource(gpu=1), 2, owner="old"))
        assert await pool.release_owner("old") == 1
        await pool.release_tokens(tokens[:1])  # the old owner's episode ends: ignored with a warning
        await pool.release_batch(tokens)  # ignored with a warning

    try:
        asyncio.run(main())
    finally:
        assert pool.snapshot() == initial


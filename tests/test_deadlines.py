"""Phase time limits on one loop timer (``core.deadlines``) keep ``asyncio.timeout``'s semantics:
checked in virtual time, where the loop's clock is exact."""

import asyncio
import random

import pytest

from rayapp.core.clock import loop_time, run_virtual
from rayapp.core.deadlines import Deadlines


async def phase(deadlines, limit_s, takes_s, ended):
    """Sleep ``takes_s`` under a ``limit_s`` limit; record (how it ended, when)."""
    lim = deadlines.limit(limit_s)
    try:
        with lim:
            await asyncio.sleep(takes_s)
        ended.append(("done", loop_time(), lim.expired))
    except TimeoutError:
        ended.append(("timeout", loop_time(), lim.expired))


def test_each_phase_ends_at_its_own_limit_whatever_order_they_began_in():
    rng = random.Random(3)
    cases = [(rng.choice([5.0, 20.0, 60.0]), rng.uniform(0, 90)) for _ in range(200)]  # (limit, takes)

    async def main():
        deadlines = Deadlines()
        ended = [[] for _ in cases]
        tasks = []
        for (limit, takes), out in zip(cases, ended, strict=True):
            tasks.append(asyncio.ensure_future(phase(deadlines, limit, takes, out)))
            await asyncio.sleep(rng.choice([0, 0.5]))  # later limits may end before earlier ones
        await asyncio.gather(*tasks)
        deadlines.idle()
        return [e[0] for e in ended], deadlines._timer

    ended, timer = run_virtual(main())
    for (limit, takes), (how, _, expired) in zip(cases, ended, strict=True):
        assert (how, expired) == (("timeout", True) if takes > limit else ("done", False))
    assert timer is None  # nothing left armed: a virtual clock would jump to it


def test_a_phase_times_out_exactly_at_its_limit():
    async def main():
        deadlines, ended = Deadlines(), []
        await asyncio.gather(phase(deadlines, 30, 100, ended), phase(deadlines, 10, 100, ended),
                             phase(deadlines, 50, 40, ended))
        return sorted(ended)

    assert run_virtual(main()) == [("done", 40.0, False), ("timeout", 10.0, True), ("timeout", 30.0, True)]


def test_a_cancellation_from_outside_is_not_a_timeout():
    async def main():
        deadlines, ended = Deadlines(), []
        task = asyncio.ensure_future(phase(deadlines, 10, 100, ended))
        await asyncio.sleep(5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(20)  # the limit's time passes: nothing left to expire
        return ended, task.cancelling()

    assert run_virtual(main()) == ([], 1)


def test_a_cancellation_that_races_the_limit_still_propagates():
    async def main():
        deadlines = Deadlines()

        async def body():
            with deadlines.limit(10):
                await asyncio.sleep(100)

        task = asyncio.ensure_future(body())
        await asyncio.sleep(10)  # the limit fires in this pass: cancel from outside too
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_virtual(main())


def test_a_timeout_the_phase_raises_itself_is_not_the_limits():
    async def main():
        deadlines = Deadlines()
        lim = deadlines.limit(10)
        with pytest.raises(TimeoutError, match="tool call"), lim:
            await asyncio.sleep(1)
            raise TimeoutError("tool call")
        return lim.expired

    assert run_virtual(main()) is False

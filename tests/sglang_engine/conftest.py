"""The event loop of the lane's modules: each builds its engine with this loop current and awaits on it
(SGLang's tokenizer manager keeps the loop of its first request)."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    # the tasks SGLang left on the loop (its receive loop, its watchdog) are cancelled before it closes
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:  # none when no request reached the engine (gather() of nothing takes another loop's future)
        loop.run_until_complete(asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10))
    loop.close()
    asyncio.set_event_loop(None)

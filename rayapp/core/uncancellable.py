"""Calls run to their end: awaited to the end even when the caller is cancelled meanwhile.

A call that gives something back (a batch's tokens to the pool, a checkpoint write in a thread)
cannot be abandoned half way: a cancelled pool request leaves its tokens held for as long as the
owner's lease is renewed, and a thread cannot be stopped, so its write would happen after the step
that made it returned. ``run_to_end`` waits the call out, then raises the cancellation it absorbed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def run_to_end(call: Awaitable[T]) -> T:
    """``await call`` to its end whatever cancels the caller meanwhile; then the cancellation (if
    any) is raised, else the call's result or error comes back."""
    work = asyncio.ensure_future(call)
    cancelled = False
    while not work.done():
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            if work.cancelled():  # the call itself was cancelled (its own doing): nothing left to wait for
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return work.result()

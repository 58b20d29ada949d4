"""A placement pool whose grants cannot outlive their callers: request ids that can be cancelled,
and owner leases that expire.

``LeasedPool`` is the ``PlacementPool`` plus two ways for the pool to free what nobody waits for
any more, since a caller in another process can vanish without a word:

* **Request ids.** ``acquire_batch(request, request_id=...)`` names the call. ``cancel(request_id)``
  withdraws it while it waits, or frees its batch once granted (a caller whose bounded call timed
  out or was cancelled sends it, best effort). A cancel that arrives before its acquire is kept (a
  bounded number of ids) and refuses that acquire when it lands.
* **Leases.** Every call of an owner (``acquire_batch``, ``renew``) renews its lease; an owner not
  heard from for ``lease_s`` seconds is presumed dead: ``expire_leases`` frees its batches and
  cancels its waiting acquires, as ``release_owner`` does for a restarted manager's predecessor. A
  live owner that holds batches longer than ``lease_s`` renews in the background.

Time is the running loop's (``loop_time``), so a virtual-time loop drives leases too. Pure Python +
asyncio; never imports ray.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from rayapp.core.clock import loop_time
from rayapp.core.pool import HeldBatch, PlacementPool, PoolError, Reservations
from rayapp.types import BatchRequest, NodeSpec, Token

__all__ = ["LEASE_S", "LeasedPool"]

log = logging.getLogger(__name__)

LEASE_S = 120.0  # an owner not heard from for this long is presumed dead
MAX_EARLY_CANCELS = 4096  # cancels kept for acquires that have not arrived yet


class LeasedPool(PlacementPool):
    """``PlacementPool`` with cancellable request ids and owner leases of ``lease_s`` seconds (None:
    owners never expire)."""

    def __init__(self, layout: dict[str, NodeSpec], reservations: Reservations | None = None, *,
                 retry_s: float = 1.0, lease_s: float | None = LEASE_S) -> None:
        super().__init__(layout, reservations, retry_s=retry_s)
        if lease_s is not None and (isinstance(lease_s, bool) or not isinstance(lease_s, int | float)
                                    or not lease_s > 0):
            raise PoolError(f"lease_s: expected seconds > 0 or None, got {lease_s!r}")
        self.lease_s = lease_s
        self._seen: dict[str, float] = {}  # owner -> loop time of its last call
        self._requests: dict[str, asyncio.Task | str] = {}  # request id -> its waiting call, or its batch
        self._request_of: dict[str, str] = {}  # batch name -> the request id that got it
        self._early: OrderedDict[str, None] = OrderedDict()  # ids cancelled before their acquire came

    def renew(self, owner: str) -> None:
        """``owner`` is alive: its lease runs ``lease_s`` seconds from now."""
        if not isinstance(owner, str):
            raise PoolError(f"renew: owner must be a string, got {type(owner).__name__}")
        self._seen[owner] = loop_time()

    async def expire_leases(self) -> int:
        """Free the batches of every owner whose lease ran out, and cancel its waiting acquires.
        Returns how many batches were freed."""
        if self.lease_s is None:
            return 0
        now = loop_time()
        dead = [o for o, seen in self._seen.items() if now - seen > self.lease_s]
        freed = 0
        for owner in dead:
            del self._seen[owner]
            n = await self.release_owner(owner)
            if n:
                log.warning("owner %r not heard from for %.0fs: its lease expired, %d batches freed",
                            owner, self.lease_s, n)
            freed += n
        return freed

    async def acquire_batch(self, request: BatchRequest, request_id: str | None = None) -> list[Token]:
        """``PlacementPool.acquire_batch``, renewing the owner's lease; with ``request_id``, the call
        can be withdrawn, or its grant freed, by ``cancel(request_id)``."""
        if request_id is not None and not isinstance(request_id, str):
            raise PoolError(f"request_id: expected a string, got {type(request_id).__name__}")
        self.renew(request.owner)
        await self.expire_leases()
        if request_id is None:
            return await super().acquire_batch(request)
        if request_id in self._early:
            del self._early[request_id]
            raise PoolError(f"acquire_batch {request.label}: request {request_id!r} was cancelled before it came")
        if request_id in self._requests:
            raise PoolError(f"acquire_batch {request.label}: request id {request_id!r} is in use")
        self._requests[request_id] = asyncio.current_task()
        try:
            tokens = await super().acquire_batch(request)
        except BaseException:
            del self._requests[request_id]
            raise
        if not tokens:
            del self._requests[request_id]
            return tokens
        name = self._batch_of[tokens[0].token_id]
        self._requests[request_id] = name  # no await since the grant: cancel sees one or the other
        self._request_of[name] = request_id
        return tokens

    async def cancel(self, request_id: str) -> str:
        """Withdraw a waiting acquire (``"withdrawn"``), free its batch if granted and still open
        (``"released"``), or, for an id not seen yet, refuse that acquire when it comes (``"early"``)."""
        if not isinstance(request_id, str):
            raise PoolError(f"cancel: request_id must be a string, got {type(request_id).__name__}")
        entry = self._requests.get(request_id)
        if entry is None:
            self._early[request_id] = None
            while len(self._early) > MAX_EARLY_CANCELS:
                self._early.popitem(last=False)
            return "early"
        if isinstance(entry, asyncio.Task):
            entry.cancel()
            return "withdrawn"
        log.warning("cancel %s: its caller is gone; freeing batch %s", request_id, entry)
        await self._free(self._batches[entry])
        return "released"

    async def _free(self, batch: HeldBatch) -> None:
        request_id = self._request_of.pop(batch.name, None)
        if request_id is not None:
            del self._requests[request_id]
        await super()._free(batch)

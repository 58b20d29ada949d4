"""The core's Pool protocol over the PlacementPoolService deployment's handle (or a plain actor's).

Every call is bounded and cancelled when its caller stops waiting (``rayapp.actors.remote``). A
waiting acquire is bounded by its own ``timeout_s`` plus ``call_timeout_s`` for the trip. Retrying a
batch Ray could not place is the core pool's business (at the head of its queue), not the client's.
Each request carries the client's ``owner``, so a replica that replaces a crashed one frees what its
predecessor held. A grant must never outlive its caller:

* each acquire carries a fresh request id; when its call times out or is cancelled, the client sends
  a bounded, best-effort ``cancel(request_id)``, which withdraws the waiter or frees the grant that
  crossed the cancellation in flight;
* while the client is in use it renews its owner's lease every ``renew_s`` seconds in the
  background, so a client that hangs or dies stops renewing and the pool frees its batches;
* a release that fails for want of an answer (a timeout, a lost replica) is retried with backoff
  and logged each time; a release the pool refuses (a PoolError) is not retried.

The request and the tokens travel as msgpack bytes (``pool_wire``): Ray pickles nothing per
token. With ``background_release`` a release costs its caller no round trip: ``release_batch`` and
``release_tokens`` return once the call is sent, and its answer is awaited (and retried as above)
in the background, never cancelled with its caller; a refusal is logged instead of raised, and
``drain()`` waits for the releases in flight. Calls of one client to one actor run in the order
sent, so the pool frees the tokens before it sees this client's next acquire. The owner's lease
still frees what a release that never lands held.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import msgspec

from rayapp.actors.pool_wire import pack, unpack_tokens
from rayapp.actors.remote import bounded, is_lost
from rayapp.core.units import PoolError
from rayapp.types import BatchRequest, Resource, Token

log = logging.getLogger(__name__)

NO_BOUND_S = 86400.0  # an acquire without a timeout still ends its trip some day
RENEW_S = 30.0  # well inside the pool's lease (120 s by default): three renewals may fail in a row
RELEASE_TRIES = 4  # a release is sent at most this often
RELEASE_BACKOFF_S = 0.5  # doubled after each failed try


class PoolClient:
    def __init__(self, handle: Any, owner: str, call_timeout_s: float = 60.0, renew_s: float = RENEW_S,
                 background_release: bool = False):
        self.handle, self.owner, self.call_timeout_s, self.renew_s = handle, owner, call_timeout_s, renew_s
        self.background_release = background_release
        self._renewer: asyncio.Task | None = None
        self._cancels: set[asyncio.Task] = set()  # best-effort cancels in flight (kept from the GC)
        self._releases: set[asyncio.Task] = set()  # background releases in flight (kept from the GC)

    def _wire(self, value: BatchRequest | list[Token]) -> Any:
        """What a request or tokens travel as (``pool_wire``)."""
        return pack(value)

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        return await bounded(getattr(self.handle, method).remote(*args), timeout_s or self.call_timeout_s)

    def _keep_renewing(self) -> None:
        """Start the renewal task on the caller's loop (again, if a previous loop ended)."""
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _renew_forever(self) -> None:
        while True:
            try:
                await self._call("renew", self.owner, timeout_s=min(self.call_timeout_s, self.renew_s))
            except Exception as e:  # the next renewal may land; the lease has room for a few misses
                log.warning("pool: renewing the lease of %r failed: %s", self.owner, e)
            await asyncio.sleep(self.renew_s)

    def close(self) -> None:
        """Stop renewing: the pool frees what this owner still holds one lease period later."""
        if self._renewer is not None:
            self._renewer.cancel()

    async def acquire_batch(self, request: BatchRequest) -> list[Token]:
        request = msgspec.structs.replace(request, owner=self.owner)
        wait_s = NO_BOUND_S if request.timeout_s is None else request.timeout_s
        self._keep_renewing()
        request_id = uuid.uuid4().hex
        try:
            answer = await self._call("acquire_batch", self._wire(request), request_id,
                                      timeout_s=wait_s + self.call_timeout_s)
            return unpack_tokens(answer, "acquire_batch")
        except (TimeoutError, asyncio.CancelledError):
            # The pool may have granted it meanwhile, or may still be waiting: nobody takes it now.
            task = asyncio.get_running_loop().create_task(self._cancel(request_id, request.label))
            self._cancels.add(task)
            task.add_done_callback(self._cancels.discard)
            raise

    async def _cancel(self, request_id: str, label: str) -> None:
        try:
            what = await self._call("cancel", request_id)
            log.info("pool: acquire %s (%s) abandoned: %s", label, request_id, what)
        except Exception as e:  # the owner's lease frees the grant in the end
            log.warning("pool: cancelling abandoned acquire %s (%s) failed: %s", label, request_id, e)

    async def release_batch(self, tokens: list[Token]) -> None:
        await self._release("release_batch", tokens)

    async def release_tokens(self, tokens: list[Token]) -> None:
        """Early release of some of a batch's tokens (the batch's ``release_batch`` frees them anyway
        if this one is lost)."""
        await self._release("release_tokens", tokens)

    async def _release(self, method: str, tokens: list[Token]) -> None:
        payload = self._wire(tokens)
        if not self.background_release:
            return await self._release_tries(method, payload, len(tokens))
        sent = getattr(self.handle, method).remote(payload)  # sent now, ahead of this client's next call
        task = asyncio.get_running_loop().create_task(self._settle(method, payload, len(tokens), sent))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _settle(self, method: str, payload: Any, n: int, sent: Any) -> None:
        """A background release's answer; retried as an awaited one would be, logged, never raised.
        Only its answer is abandoned if the loop ends first: the call itself is not cancelled."""
        try:
            await self._release_tries(method, payload, n, sent)
        except Exception as e:
            log.error("pool: background %s of %d tokens failed: %s: %s", method, n, type(e).__name__, e)

    async def drain(self) -> None:
        """Wait for the background releases in flight (their failures are logged, not raised)."""
        while self._releases:
            await asyncio.wait(set(self._releases))

    async def _release_tries(self, method: str, payload: Any, n: int, sent: Any = None) -> None:
        """Retried with backoff while the pool gives no answer; the pool tolerates a release that
        already landed (a batch freed already is ignored), so a retry after a lost answer is safe.
        ``payload``: the ``n`` tokens as sent (packed or not); ``sent``: the first try's call, already
        sent and not to be cancelled (a background release)."""
        delay = RELEASE_BACKOFF_S
        for attempt in range(1, RELEASE_TRIES + 1):
            try:
                if sent is not None:
                    first, sent = asyncio.ensure_future(sent), None
                    await asyncio.wait_for(asyncio.shield(first), self.call_timeout_s)
                else:
                    await self._call(method, payload)
                return
            except PoolError:
                raise  # refused: the same call would be refused again
            except Exception as e:
                if not (isinstance(e, TimeoutError) or is_lost(e)) or attempt == RELEASE_TRIES:
                    log.error("pool: %s of %d tokens failed for good (try %d): %s; the owner's lease frees "
                              "them", method, n, attempt, e)
                    raise
                log.warning("pool: %s of %d tokens failed (try %d of %d), retrying in %.1fs: %s", method,
                            n, attempt, RELEASE_TRIES, delay, e)
            await asyncio.sleep(delay)
            delay *= 2

    async def max_tokens_for(self, per_sample: Resource) -> int:
        return await self._call("max_tokens_for", per_sample)

    async def release_owner(self) -> int:
        return await self._call("release_owner", self.owner)

    async def placement(self) -> dict[str, Any]:
        return await self._call("placement")

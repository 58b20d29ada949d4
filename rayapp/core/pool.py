"""The placement pool (docs/scheduler.md §3): admission of batches of placement tokens, first come first served.

``PlacementPool`` is the ``Ledger`` (exact, all-or-nothing, best-fit placement) plus admission:
``acquire_batch`` waits for releases in FIFO order, has the granted tokens realised by an optional
reservation hook (the Ray shell makes placement), and tracks each batch and its owner until
``release_batch`` or ``release_owner``; ``release_tokens`` gives tokens back early. Invariants
(checked by tests after every step): a failed acquire, release or reservation leaves the ledger as
it was; every token goes back exactly once; releasing every batch restores the initial
``snapshot()`` (docs/architecture.md, "Contracts kept between the parts"). One event loop and its
clock only, so a virtual-time loop drives it; never imports ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable
from typing import Protocol

import msgspec

from rayapp.core.ledger import Ledger
from rayapp.core.units import PoolError, budget_tokens
from rayapp.types import BatchRequest, NodeSpec, Resource, Token

__all__ = ["HeldBatch", "PlacementPool", "PoolError", "Reservations", "budget_tokens"]

log = logging.getLogger(__name__)


class Reservations(Protocol):
    """Realises what the ledger granted outside it (the Ray shell: each token mapped to a bundle of
    its node's long-lived placement group).

    ``reserve(name, tokens)`` gets one batch's tokens as the ledger issued them (``name`` is unique
    per call and starts with the request's label) and returns them realised: same order, same ledger
    fields, with ``placement_group``/``bundle_index`` set as the hook likes; or None when it cannot
    realise them now (the pool retries). A reserve that returns None, raises or is cancelled must
    hold nothing. ``release(tokens)`` gets back realised tokens: a whole batch today, but a hook must
    not assume so (single tokens may go back early, and a hook may sub-allocate long-lived groups)."""

    async def reserve(self, name: str, tokens: list[Token]) -> list[Token] | None: ...

    async def release(self, tokens: list[Token]) -> None: ...


class HeldBatch(msgspec.Struct, frozen=True):
    """One admitted batch: its unique name, its owner and the tokens it still holds, as the caller got
    them (all it was granted, less those given back early with ``release_tokens``)."""

    name: str
    owner: str
    tokens: tuple[Token, ...]


class _Waiter:
    """One parked ``acquire_batch`` call; ``event`` is set when it should retry, or when ``error``
    says it never can (a node it needed was cordoned)."""

    __slots__ = ("error", "event", "n", "owner", "request", "task")

    def __init__(self, request: BatchRequest, n: int) -> None:
        self.event = asyncio.Event()
        self.owner, self.request, self.n = request.owner, request, n
        self.error: PoolError | None = None
        self.task = asyncio.current_task()


_REFUSED = object()  # the hook could not realise a grant now


class PlacementPool(Ledger):
    """The global placement pool built from a cluster layout ``{node: NodeSpec}`` (see ``Ledger``).
    ``reservations`` realises each admitted batch (None: the ledger alone decides); a batch it
    refuses retries after ``retry_s`` seconds at the latest."""

    def __init__(self, layout: dict[str, NodeSpec], reservations: Reservations | None = None, *,
                 retry_s: float = 1.0) -> None:
        super().__init__(layout)
        self._queue: deque[_Waiter] = deque()
        self._reservations = reservations
        self.retry_s = retry_s
        self._batches: dict[str, HeldBatch] = {}
        self._batch_of: dict[int, str] = {}  # token_id -> name of the batch it was granted to
        self._granted: dict[str, frozenset[Token]] = {}  # batch name -> every token it was granted
        self._holding: dict[str, dict[Token, None]] = {}  # batch name -> the tokens it still holds, in order
        self._grants = 0  # names every grant (and every reservation attempt) uniquely

    def release(self, tokens: Iterable[Token]) -> None:
        """``Ledger.release``, refusing tokens of a tracked batch (those go back with ``release_batch``);
        wakes the first waiter."""
        tokens = list(tokens)
        for t in tokens:
            name = self._batch_of.get(getattr(t, "token_id", None))
            if name is not None:
                raise PoolError(f"release: token {t.token_id!r} belongs to batch {name!r}; give it back with "
                                f"release_batch")
        super().release(tokens)
        if tokens:
            self._wake_head()

    # ---- cordoned nodes ------------------------------------------------------------------------
    def cordon(self, node: str) -> bool:
        """``Ledger.cordon``; then every waiter whose batch can no longer fit on the nodes left fails at
        once with a PoolError (the rule ``acquire_batch`` applies up front), instead of waiting."""
        changed = super().cordon(node)
        if changed:
            for w in self._queue:
                if w.error is None and w.n > self.capacity_for(w.request.per_sample):
                    w.error = self._never_fits(w.request, w.n)
                    w.event.set()
        return changed

    def uncordon(self, node: str) -> bool:
        """``Ledger.uncordon``; wakes the first waiter, which may fit now."""
        changed = super().uncordon(node)
        if changed:
            self._wake_head()
        return changed

    def _never_fits(self, request: BatchRequest, n: int) -> PoolError:
        cap = self.capacity_for(request.per_sample)
        lost = f" ({len(self._cordoned)} nodes cordoned: {self.cordoned[:8]})" if self._cordoned else ""
        return PoolError(f"acquire_batch {request.label}: {n} tokens of {request.per_sample!r} can never fit; "
                         f"the whole pool holds {cap}{lost}")

    # ---- batches: waiting, reservations, owners ----------------------------------------------
    def _wake_head(self) -> None:
        """Tell the first waiter to retry. Only the head retries: a later small batch must not
        overtake an earlier big one forever."""
        if self._queue:
            self._queue[0].event.set()

    async def acquire_batch(self, request: BatchRequest) -> list[Token]:
        """Like ``try_acquire_batch`` but waits (FIFO, woken by releases) until the batch fits and the
        reservation hook realised it; the tokens are tracked as one batch of ``request.owner``.
        TimeoutError after ``request.timeout_s``; a timeout, a cancellation or an error (the hook's
        included) leaves nothing held."""
        n, demand = self._request(request.budget, request.per_sample, request.max_tokens)
        timeout = request.timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                    or not timeout >= 0):
            raise PoolError(f"timeout_s: expected seconds >= 0 or None, got {timeout!r}")
        if n > self.capacity_for(request.per_sample):  # would wait forever and block every later waiter
            raise self._never_fits(request, n)
        waiter = _Waiter(request, n)
        self._queue.append(waiter)
        refused = 0
        try:
            async with asyncio.timeout(timeout) as deadline:
                while True:
                    if waiter.error is not None:
                        raise waiter.error
                    # Clear before trying: a release that arrives during the try sets it again.
                    waiter.event.clear()
                    backoff = None
                    if self._queue[0] is waiter:
                        got = await self._admit(n, demand, request)
                        if got is _REFUSED:
                            refused += 1
                            backoff = self.retry_s
                        elif got is not None:
                            return got
                    await _park(waiter.event, backoff)
        except TimeoutError:
            if not deadline.expired():
                raise  # the hook's own, not ours
            refusals = f"; its reservation was refused {refused} times" if refused else ""
            raise TimeoutError(
                f"acquire_batch {request.label}: {n} tokens of {request.per_sample!r} not admitted within "
                f"{timeout}s ({len(self._held)} tokens held, {len(self._queue) - 1} other waiters{refusals})"
            ) from None
        finally:
            was_head = self._queue[0] is waiter
            self._queue.remove(waiter)
            if was_head:  # success leaves room, or the head gave up: let the next one try
                self._wake_head()

    async def _admit(self, n: int, demand: tuple, request: BatchRequest) -> list[Token] | object | None:
        """One try as head: the tokens (tracked), None (the ledger has no room) or _REFUSED."""
        tokens = self._try(n, demand, request.per_sample)
        if not tokens:
            return tokens  # no room, or an empty batch: nothing to reserve or track
        self._grants += 1
        name = f"{request.label}/{self._grants}"
        if self._reservations is None:
            return self._track(name, request.owner, tokens)
        try:
            got = await self._reservations.reserve(name, tokens)
        except BaseException:
            self._rollback(tokens)  # the hook's contract: it holds nothing now
            raise
        if got is None or any(self._index[t.node] in self._cordoned for t in tokens):
            if got is not None:  # a node was cordoned while the hook realised the grant: place it anew
                try:
                    await self._reservations.release(got)
                finally:
                    self._rollback(tokens)
                self._wake_head()
                return None
            self._rollback(tokens)
            return _REFUSED
        if not _realises(got, tokens):
            try:
                await self._reservations.release(got)
            finally:
                self._rollback(tokens)
            raise PoolError(f"reservations: reserve({name!r}) must return the {n} tokens it was given, in "
                            f"order, with only placement_group/bundle_index set; got {got!r}")
        return self._track(name, request.owner, got)

    def _rollback(self, tokens: list[Token]) -> None:
        # No wake-up: the ledger is as before the try, so nobody behind the head could gain from it.
        self._release_records([self._held[t.token_id] for t in tokens])

    def _track(self, name: str, owner: str, tokens: list[Token]) -> list[Token]:
        self._batches[name] = HeldBatch(name, owner, tuple(tokens))  # as granted; the rest in _holding
        self._granted[name] = frozenset(tokens)
        self._holding[name] = dict.fromkeys(tokens)
        for t in tokens:
            self._batch_of[t.token_id] = name
        return tokens

    async def release_tokens(self, tokens: list[Token]) -> None:
        """Give back some tokens of one batch early (its samples that need them are done), else
        PoolError and nothing changes: each must be held by the same batch (a batch ``release_owner``
        freed already is ignored with a warning, as in ``release_batch``). The batch stays tracked,
        holding the rest, until ``release_batch`` closes it. Wakes the first waiter."""
        tokens = list(tokens)
        if not tokens:
            return
        names = {self._batch_of.get(t.token_id) for t in tokens}
        if names == {None} and not any(t.token_id in self._held for t in tokens):
            # Freed already, as release_batch tolerates: by release_owner (its owner presumed dead).
            log.warning("release_tokens: tokens %s are not held (already freed)", [t.token_id for t in tokens])
            return
        batch = self._batches.get(next(iter(names))) if len(names) == 1 else None
        if batch is None:
            raise PoolError(f"release_tokens: {len(tokens)} tokens of {len(names)} batches (or of none held); "
                            f"give back tokens of one batch at a time")
        held = self._holding[batch.name]
        if len(set(tokens)) != len(tokens) or not all(t in held for t in tokens):
            raise PoolError(f"release_tokens: {batch.name}: every token must be held by it, once")
        for t in tokens:  # O(tokens given back), not O(batch): a batch may give back one at a time
            del held[t]
        await self._give_back(tokens)

    async def release_batch(self, tokens: list[Token]) -> None:
        """Give back one batch ``acquire_batch`` returned, whole, else PoolError and nothing changes. A
        batch already freed (by ``release_owner``, its owner presumed dead) is ignored with a warning.
        The ledger takes the tokens back even if the hook's release raises (its error propagates)."""
        tokens = list(tokens)
        if not tokens:
            return
        names = {self._batch_of.get(t.token_id) for t in tokens}
        if names == {None}:
            if any(t.token_id in self._held for t in tokens):
                raise PoolError("release_batch: these tokens came from try_acquire_batch; give them back with release")
            log.warning("release_batch: tokens %s are not held (already freed)", [t.token_id for t in tokens])
            return
        batch = self._batches.get(next(iter(names))) if len(names) == 1 else None
        if batch is None or len(tokens) != len(self._granted[batch.name]) or set(tokens) != self._granted[batch.name]:
            what = batch.name if batch is not None else f"{len(tokens)} tokens of {len(names)} batches"
            raise PoolError(f"release_batch: {what}: a batch is released whole, with every token it was granted")
        await self._free(batch)

    async def _free(self, batch: HeldBatch) -> None:
        """Close ``batch``: what it still holds goes back."""
        del self._batches[batch.name]
        for t in self._granted.pop(batch.name):
            del self._batch_of[t.token_id]
        await self._give_back(list(self._holding.pop(batch.name)))

    async def _give_back(self, tokens: list[Token]) -> None:
        if not tokens:
            return
        try:
            if self._reservations is not None:
                await self._reservations.release(tokens)
        finally:
            self._release_records([self._held[t.token_id] for t in tokens])
            self._wake_head()

    async def release_owner(self, owner: str) -> int:
        """Free every batch ``owner`` still holds (a restarted manager's predecessor) and cancel the
        tasks waiting in ``acquire_batch`` for it: a dead caller never cancels them, and a batch
        granted later would leak. Returns how many batches were freed."""
        waiting = [w for w in self._queue if w.owner == owner and w.task is not None]
        for w in waiting:
            w.task.cancel()
        if waiting:
            log.warning("release_owner %s: cancelled %d waiting acquires", owner, len(waiting))
        stale = [b for b in self._batches.values() if b.owner == owner]
        errors = []
        for batch in stale:
            try:
                await self._free(batch)
            except Exception as e:  # free the rest first: each batch's ledger part is back already
                errors.append(e)
        if errors:
            raise errors[0]
        return len(stale)

    async def max_tokens_for(self, per_sample: Resource) -> int:
        """``capacity_for``, as the scheduler's async Pool protocol asks for it."""
        return self.capacity_for(per_sample)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def batches(self) -> list[HeldBatch]:
        """Every admitted batch not yet released, oldest first: who holds which tokens where."""
        return [msgspec.structs.replace(b, tokens=tuple(self._holding[b.name])) for b in self._batches.values()]

    def __repr__(self) -> str:
        return f"PlacementPool({self._n} nodes, {len(self._held)} tokens held, {len(self._queue)} waiting)"


async def _park(event: asyncio.Event, backoff: float | None) -> None:
    """Wait for a wake-up; after a refused reservation, for ``backoff`` seconds at most."""
    if backoff is None:
        await event.wait()
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(backoff):
            await event.wait()


def _realises(got: object, tokens: list[Token]) -> bool:
    """Whether a hook's answer is ``tokens`` with at most their reservation fields set."""
    return isinstance(got, list) and len(got) == len(tokens) and all(
        isinstance(r, Token) and msgspec.structs.replace(r, placement_group="", bundle_index=-1) == t
        for r, t in zip(got, tokens, strict=True))

"""The placement-pool ledger (spec §3): all-or-nothing admission of batches of placement tokens.

A pool holds one ledger per node of a cluster layout: the free capacity of each GPU (1.0 each), the
free CPU and the free memory. ``try_acquire_batch`` takes tokens one ``per_sample`` at a time, each
from the node with the most free GPU (ties: most free CPU, most free memory, layout order) and, on
that node, from the best-fitting GPU; if any token cannot be placed, every token taken so far goes
back and the call returns None. ``acquire_batch`` waits for releases, first come first served.

Invariants kept (tests check them after every step):

* All arithmetic is in integer units (GPU 1.0 = 1_000_000, CPU in milli-cores, memory in MiB), so
  for every node and GPU ``0 <= free <= capacity`` holds exactly, and releasing every token restores
  the initial ``snapshot()`` exactly.
* ``free + sum(held tokens)`` equals capacity per GPU, per node CPU and per node memory.
* A failed call (bad request, bad release, unplaceable batch, timeout, cancellation) leaves the
  ledger as it was: releases are validated whole before any is applied; acquires roll back.
* ``_order`` holds exactly one key per node, and that key encodes the node's current free figures,
  so the top of ``_order`` is always the node the greedy rule picks first.

Pure Python + asyncio; never imports ray (the Ray actor wraps this ledger).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Iterable

from sortedcontainers import SortedList

from rayapp.core.units import (
    CPU_UNIT,
    GPU_UNIT,
    MEM_UNIT,
    UNBOUNDED,
    PoolError,
    budget_tokens,
    count_of,
    demand_of,
    units_of,
)
from rayapp.types import NodeSpec, Resource, Token

__all__ = ["PlacementPool", "PoolError", "budget_tokens"]


class _Waiter:
    """One parked ``acquire_batch`` call; ``event`` is set (in ``loop``) when it should retry."""

    __slots__ = ("event", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()


class PlacementPool:
    """The global placement pool built from a cluster layout ``{node: NodeSpec}``."""

    def __init__(self, layout: dict[str, NodeSpec]) -> None:
        if not isinstance(layout, dict) or not layout:
            raise PoolError("layout: expected a non-empty {node: NodeSpec} mapping")
        self._names: list[str] = []
        self._gpu_ids: list[tuple[int, ...]] = []
        self._gpus: list[list[int]] = []  # free units per GPU, per node
        self._gpu_free: list[int] = []  # sum of the above, per node (the greedy key)
        self._cpu: list[int] = []
        self._mem: list[int] = []
        for name, spec in layout.items():
            where = f"layout[{name!r}]"
            if not isinstance(name, str) or not isinstance(spec, NodeSpec):
                raise PoolError(f"{where}: expected a str node name and a NodeSpec")
            ids = tuple(spec.gpus)
            if any(isinstance(g, bool) or not isinstance(g, int) for g in ids) or len(set(ids)) != len(ids):
                raise PoolError(f"{where}.gpus: expected distinct integer GPU ids, got {spec.gpus!r}")
            self._names.append(name)
            self._gpu_ids.append(ids)
            self._gpus.append([GPU_UNIT] * len(ids))
            self._gpu_free.append(GPU_UNIT * len(ids))
            self._cpu.append(units_of(spec.cpu, CPU_UNIT, f"{where}.cpu"))
            self._mem.append(units_of(spec.memory_gb, MEM_UNIT, f"{where}.memory_gb"))
        self._capacity = (list(self._gpu_free), list(self._cpu), list(self._mem))
        self._held_on: list[int] = [0] * len(self._names)
        # One integer per node encodes (-free gpu, -free cpu, -free mem, layout index) in mixed radix:
        # ints compare faster than tuples, and the index digit makes every key unique.
        self._n = len(self._names)
        self._gmax, self._cmax, self._mmax = max(self._gpu_free), max(self._cpu), max(self._mem)
        self._keys = [self._key(i) for i in range(self._n)]
        self._order = SortedList(self._keys)
        # token_id -> (token, node index, GPU positions, units per GPU, cpu units, memory units)
        self._held: dict[int, tuple[Token, int, tuple[int, ...], int, int, int]] = {}
        self._next_id = 0
        self._lock = threading.Lock()  # the Ray actor may call in from several threads
        self._queue: deque[_Waiter] = deque()
        self._releases = 0  # bumped by every release that returned something
        self._max_cache: dict[Resource, int] = {}

    # ---- ordered structure -------------------------------------------------------------------
    def _key(self, i: int) -> int:
        g = self._gmax - self._gpu_free[i]
        c = self._cmax - self._cpu[i]
        m = self._mmax - self._mem[i]
        return ((g * (self._cmax + 1) + c) * (self._mmax + 1) + m) * self._n + i

    def _reorder(self, i: int) -> None:
        """Move node ``i`` to its new place in ``_order``: the only node a token touched."""
        new = self._key(i)
        old = self._keys[i]
        if new != old:
            self._order.remove(old)
            self._order.add(new)
            self._keys[i] = new

    # ---- placement ---------------------------------------------------------------------------
    def _place(self, u: int, k: int, cpu: int, mem: int) -> tuple[int, tuple[int, ...]] | None:
        """The node and GPU positions for one token, or None. Walks ``_order`` from the most-free
        node and stops as soon as no node further down can hold the GPU part."""
        need = u * k
        n = self._n
        for key in self._order:
            i = key % n
            if self._gpu_free[i] < need:
                return None  # sorted by free GPU: nothing below has enough either
            if self._cpu[i] < cpu or self._mem[i] < mem:
                continue
            if k == 0:
                return i, ()
            gpus = self._gpus[i]
            if k == 1:
                # Best fit: the GPU with the least free capacity that still fits, so shares pack onto
                # used GPUs and whole GPUs stay free for whole-GPU tokens.
                best, best_free = -1, GPU_UNIT + 1
                for p, f in enumerate(gpus):
                    if u <= f < best_free:
                        best, best_free = p, f
                if best >= 0:
                    return i, (best,)
            else:
                whole = [p for p, f in enumerate(gpus) if f == GPU_UNIT]
                if len(whole) >= k:
                    return i, tuple(whole[:k])
        return None

    def _apply(self, i: int, pos: tuple[int, ...], u: int, cpu: int, mem: int, sign: int) -> None:
        gpus = self._gpus[i]
        for p in pos:
            gpus[p] -= sign * u
        self._gpu_free[i] -= sign * u * len(pos)
        self._cpu[i] -= sign * cpu
        self._mem[i] -= sign * mem
        self._held_on[i] += sign
        self._reorder(i)

    def _release_records(self, recs: list) -> None:
        for tok, i, pos, u, cpu, mem in recs:
            del self._held[tok.token_id]
            self._apply(i, pos, u, cpu, mem, -1)

    def try_acquire_batch(
        self, budget: Resource, per_sample: Resource, max_tokens: int
    ) -> list[Token] | None:
        """``min(budget_tokens(budget, per_sample), max_tokens)`` tokens, all or none (None)."""
        n, demand = self._request(budget, per_sample, max_tokens)
        return self._try(n, demand, per_sample)

    @staticmethod
    def _request(budget: Resource, per_sample: Resource, max_tokens: int) -> tuple[int, tuple]:
        """Validate a request (PoolError naming the field) and size it."""
        n = min(budget_tokens(budget, per_sample), count_of(max_tokens, "max_tokens"))
        if n == UNBOUNDED:
            raise PoolError("max_tokens: must bound a batch whose budget does not (per_sample needs nothing)")
        return n, demand_of(per_sample)

    def _try(self, n: int, demand: tuple, per_sample: Resource) -> list[Token] | None:
        if n > self.capacity_for(per_sample):
            return None  # cannot fit even in the empty pool: fail fast instead of placing and rolling back
        u, k, cpu, mem, tok_gpu = demand
        tok_cpu, tok_mem = float(per_sample.cpu), float(per_sample.memory_gb)
        out: list[Token] = []
        recs = []
        with self._lock:
            for _ in range(n):
                where = self._place(u, k, cpu, mem)
                if where is None:
                    self._release_records(recs)  # all or nothing: a half batch would block others
                    return None
                i, pos = where
                self._apply(i, pos, u, cpu, mem, +1)
                ids = self._gpu_ids[i]
                tok = Token(
                    self._next_id, self._names[i], tuple(ids[p] for p in pos), tok_gpu, tok_cpu, tok_mem
                )
                self._next_id += 1
                self._held[tok.token_id] = rec = (tok, i, pos, u, cpu, mem)
                recs.append(rec)
                out.append(tok)
        return out

    def release(self, tokens: Iterable[Token]) -> None:
        """Return ``tokens``. Every one must be held exactly as issued, else PoolError and nothing
        changes. Wakes the first waiter."""
        tokens = list(tokens)
        with self._lock:
            recs, seen = [], set()
            for t in tokens:
                tid = getattr(t, "token_id", None)
                rec = self._held.get(tid) if isinstance(tid, int) else None
                if rec is None or tid in seen:
                    why = "listed twice" if tid in seen else "never issued or already released"
                    raise PoolError(
                        f"release: token {tid!r} on node {getattr(t, 'node', '?')!r} is not held ({why})"
                    )
                if rec[0] != t:
                    raise PoolError(
                        f"release: token {tid!r} differs from the one issued: {t!r} vs {rec[0]!r}"
                    )
                seen.add(tid)
                recs.append(rec)
            self._release_records(recs)
            if recs:
                self._releases += 1
                self._wake_head()

    async def release_batch(self, tokens: list[Token]) -> None:
        self.release(tokens)

    # ---- waiting -----------------------------------------------------------------------------
    def _wake_head(self) -> None:
        """Tell the first waiter to retry (call under the lock). Only the head retries: a later
        small batch must not overtake an earlier big one forever."""
        if not self._queue:
            return
        w = self._queue[0]
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is w.loop:
            w.event.set()
        else:  # released from another thread (or no loop): hand the wake-up to the waiter's loop
            with contextlib.suppress(RuntimeError):  # a closed loop: its waiter is gone with it
                w.loop.call_soon_threadsafe(w.event.set)

    async def acquire_batch(
        self, budget: Resource, per_sample: Resource, max_tokens: int, *, timeout: float | None = None,
        label: str = "batch",
    ) -> list[Token]:
        """Like ``try_acquire_batch`` but waits (FIFO, woken by releases) until the batch fits.
        TimeoutError after ``timeout`` seconds; timeout or cancellation leaves nothing held.
        ``label`` names the batch in errors (the Ray shell also names its placement group after it)."""
        n, demand = self._request(budget, per_sample, max_tokens)
        if timeout is not None and not (isinstance(timeout, int | float) and timeout >= 0):
            raise PoolError(f"timeout: expected seconds >= 0 or None, got {timeout!r}")
        seen = self._releases
        tried = not self._queue  # nobody ahead: try at once
        if tried:
            tokens = self._try(n, demand, per_sample)
            if tokens is not None:
                return tokens
        cap = self.capacity_for(per_sample)
        if n > cap:  # would wait forever and block every later waiter behind it
            raise PoolError(
                f"acquire_batch: {n} tokens of {per_sample!r} can never fit; the whole pool holds {cap}"
            )
        waiter = _Waiter(asyncio.get_running_loop())
        with self._lock:
            self._queue.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    # Clear before trying: a release that lands after the try sets it again.
                    waiter.event.clear()
                    # Retry only as head, and skip the first retry if nothing was released since
                    # the fast-path try (a release from another thread in between bumps the count).
                    if self._queue[0] is waiter and not (tried and self._releases == seen):
                        tokens = self._try(n, demand, per_sample)
                        if tokens is not None:
                            return tokens
                    tried = False
                    await waiter.event.wait()
        except TimeoutError:
            raise TimeoutError(
                f"acquire_batch {label}: {n} tokens of {per_sample!r} not admitted within {timeout}s "
                f"({len(self._held)} tokens held, {len(self._queue) - 1} other waiters)"
            ) from None
        finally:
            with self._lock:
                was_head = self._queue[0] is waiter
                self._queue.remove(waiter)
                if was_head:  # success leaves room, or the head gave up: let the next one try
                    self._wake_head()

    # ---- capacity and views ------------------------------------------------------------------
    async def max_tokens_for(self, per_sample: Resource) -> int:
        """``capacity_for`` as the scheduler's Pool protocol asks for it (awaited: the Ray shell's
        answer crosses a process)."""
        return self.capacity_for(per_sample)

    def capacity_for(self, per_sample: Resource) -> int:
        """The most ``per_sample`` tokens the empty pool holds at once (the deadlock check's figure)."""
        cached = self._max_cache.get(per_sample)
        if cached is not None:
            return cached
        u, k, cpu, mem, _ = demand_of(per_sample)
        total = 0
        _, cpu_cap, mem_cap = self._capacity
        for i in range(self._n):
            n_gpus = len(self._gpu_ids[i])
            slots = UNBOUNDED
            if k == 1:
                slots = n_gpus * (GPU_UNIT // u)
            elif k > 1:
                slots = n_gpus // k
            if cpu:
                slots = min(slots, cpu_cap[i] // cpu)
            if mem:
                slots = min(slots, mem_cap[i] // mem)
            if slots == UNBOUNDED:
                total = UNBOUNDED
                break
            total += slots
        total = min(total, UNBOUNDED)
        if len(self._max_cache) > 1024:
            self._max_cache.clear()
        self._max_cache[per_sample] = total
        return total

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def snapshot(self) -> dict:
        """Exact state in integer units, per node: free units per GPU id, free milli-cores, free MiB,
        tokens held. Equal snapshots mean equal ledgers."""
        with self._lock:
            return {
                name: {
                    "gpu_units": dict(zip(self._gpu_ids[i], self._gpus[i], strict=True)),
                    "cpu_milli": self._cpu[i],
                    "memory_mib": self._mem[i],
                    "held": self._held_on[i],
                }
                for i, name in enumerate(self._names)
            }

    def free(self) -> dict[str, Resource]:
        """Free GPU (summed over the node's GPUs), CPU and memory per node, for logs."""
        with self._lock:
            return self._view(self._gpu_free, self._cpu, self._mem)

    def capacity(self) -> dict[str, Resource]:
        """Total GPU, CPU and memory per node (``free()`` of the empty pool)."""
        return self._view(*self._capacity)

    def _view(self, gpu: list[int], cpu: list[int], mem: list[int]) -> dict[str, Resource]:
        # concurrency is not a pool resource; 0 marks it as unused here
        return {
            name: Resource(gpu[i] / GPU_UNIT, 0, cpu[i] / CPU_UNIT, mem[i] / MEM_UNIT)
            for i, name in enumerate(self._names)
        }

    def __repr__(self) -> str:
        return f"PlacementPool({self._n} nodes, {len(self._held)} tokens held, {len(self._queue)} waiting)"

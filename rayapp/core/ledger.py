"""The placement-pool ledger (docs/scheduler.md §3): exact, all-or-nothing placement of batches of tokens.

A ledger holds, per node of a cluster layout, the free capacity of each GPU (1.0 each), the free CPU
and the free memory. ``try_acquire_batch`` takes tokens one ``per_sample`` at a time, each from the
node with the most free GPU (ties: most free CPU, most free memory, layout order) and, on that node,
from the best-fitting GPU; if any token cannot be placed, every token taken so far goes back and the
call returns None. ``rayapp.core.pool.PlacementPool`` adds waiting, reservations and owners.

Invariants kept (tests check them after every step):

* All arithmetic is in integer units (GPU 1.0 = 1_000_000, CPU in milli-cores, memory in MiB), so
  for every node and GPU ``0 <= free <= capacity`` holds exactly, and releasing every token restores
  the initial ``snapshot()`` exactly.
* ``free + sum(held tokens)`` equals capacity per GPU, per node CPU and per node memory.
* A failed call (bad request, bad release, unplaceable batch) leaves the ledger as it was: releases
  are validated whole before any is applied; acquires roll back.
* ``_order`` holds exactly one key per node that is not cordoned, and that key encodes the node's
  current free figures, so the top of ``_order`` is always the node the greedy rule picks first.
* A cordoned node (``cordon``: its Ray group was lost) gets no new tokens and counts for nothing in
  ``capacity_for`` and ``free``; tokens it already holds go back as usual, so its figures stay exact
  and ``uncordon`` puts it back as it is.

Pure Python; never imports ray.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable

from rayapp.core.units import (
    CPU_UNIT,
    GPU_UNIT,
    MEM_UNIT,
    UNBOUNDED,
    PoolError,
    budget_tokens,
    count_of,
    demand_of,
    to_units,
)
from rayapp.types import NodeSpec, Resource, Token

__all__ = ["Ledger", "PoolError", "budget_tokens"]


class Ledger:
    """The ledger of a cluster layout ``{node: NodeSpec}`` as the layout parser returns it (checked
    there: non-empty, distinct GPU ids, finite amounts >= 0)."""

    def __init__(self, layout: dict[str, NodeSpec]) -> None:
        self._names = list(layout)
        self._gpu_ids = [tuple(spec.gpus) for spec in layout.values()]
        self._gpus = [[GPU_UNIT] * len(ids) for ids in self._gpu_ids]  # free units per GPU, per node
        self._gpu_free = [sum(g) for g in self._gpus]  # per node (the greedy key)
        self._cpu = [to_units(spec.cpu, CPU_UNIT) for spec in layout.values()]
        self._mem = [to_units(spec.memory_gb, MEM_UNIT) for spec in layout.values()]
        self._capacity = (list(self._gpu_free), list(self._cpu), list(self._mem))
        self._held_on: list[int] = [0] * len(self._names)
        # One integer per node encodes (-free gpu, -free cpu, -free mem, layout index) in mixed radix:
        # ints compare faster than tuples, and the index digit makes every key unique.
        self._n = len(self._names)
        self._gmax, self._cmax, self._mmax = max(self._gpu_free), max(self._cpu), max(self._mem)
        self._keys = [self._key(i) for i in range(self._n)]
        # A plain sorted list: a token moves one node's key, mostly not past its neighbours, so the
        # key is replaced in place; a move is a C memmove, cheaper than a tree's bookkeeping up to
        # thousands of nodes (bench/pool.py).
        self._order = sorted(self._keys)
        # token_id -> (token, node index, GPU positions, units per GPU, cpu units, memory units)
        self._held: dict[int, tuple[Token, int, tuple[int, ...], int, int, int]] = {}
        self._next_id = 0
        self._max_cache: dict[Resource, int] = {}
        self._index = {name: i for i, name in enumerate(self._names)}
        self._cordoned: set[int] = set()  # node indices left out of _order (their group is lost)

    # ---- ordered structure -------------------------------------------------------------------
    def _key(self, i: int) -> int:
        g = self._gmax - self._gpu_free[i]
        c = self._cmax - self._cpu[i]
        m = self._mmax - self._mem[i]
        return ((g * (self._cmax + 1) + c) * (self._mmax + 1) + m) * self._n + i

    def _reorder(self, i: int) -> None:
        """Move node ``i`` to its new place in ``_order``: the only node a token touched."""
        new, old = self._key(i), self._keys[i]
        self._keys[i] = new  # a cordoned node is not in _order: uncordon puts this key back
        if new == old or i in self._cordoned:
            return
        order = self._order
        pos = bisect_left(order, old)
        if (pos == 0 or order[pos - 1] < new) and (pos + 1 == len(order) or new < order[pos + 1]):
            order[pos] = new  # still between its neighbours
        else:
            del order[pos]
            insort(order, new)

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

    def _take(self, i: int, pos: tuple[int, ...], u: int, cpu: int, mem: int) -> None:
        gpus = self._gpus[i]
        for p in pos:
            gpus[p] -= u
        self._gpu_free[i] -= u * len(pos)
        self._cpu[i] -= cpu
        self._mem[i] -= mem
        self._held_on[i] += 1
        self._reorder(i)

    def _release_records(self, recs: list) -> None:
        """Give back what ``recs`` hold; each node they touch moves in ``_order`` once, at the end."""
        touched: dict[int, None] = {}
        for tok, i, pos, u, cpu, mem in recs:
            del self._held[tok.token_id]
            gpus = self._gpus[i]
            for p in pos:
                gpus[p] += u
            self._gpu_free[i] += u * len(pos)
            self._cpu[i] += cpu
            self._mem[i] += mem
            self._held_on[i] -= 1
            touched[i] = None
        for i in touched:
            self._reorder(i)

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
        for _ in range(n):
            where = self._place(u, k, cpu, mem)
            if where is None:
                self._release_records(recs)  # all or nothing: a half batch would block others
                return None
            i, pos = where
            self._take(i, pos, u, cpu, mem)
            ids = self._gpu_ids[i]
            tok = Token(self._next_id, self._names[i], tuple(ids[p] for p in pos), tok_gpu, tok_cpu, tok_mem)
            self._next_id += 1
            self._held[tok.token_id] = rec = (tok, i, pos, u, cpu, mem)
            recs.append(rec)
            out.append(tok)
        return out

    def release(self, tokens: Iterable[Token]) -> None:
        """Return tokens that ``try_acquire_batch`` issued. Every one must be held exactly as issued,
        else PoolError and nothing changes."""
        recs, seen = [], set()
        for t in tokens:
            tid = getattr(t, "token_id", None)
            rec = self._held.get(tid) if isinstance(tid, int) else None
            if rec is None or tid in seen:
                why = "listed twice" if tid in seen else "never issued or already released"
                raise PoolError(f"release: token {tid!r} on node {getattr(t, 'node', '?')!r} is not held ({why})")
            if rec[0] != t:
                raise PoolError(f"release: token {tid!r} differs from the one issued: {t!r} vs {rec[0]!r}")
            seen.add(tid)
            recs.append(rec)
        self._release_records(recs)

    # ---- cordoned nodes ------------------------------------------------------------------------
    def _node(self, node: str, what: str) -> int:
        i = self._index.get(node) if isinstance(node, str) else None
        if i is None:
            raise PoolError(f"{what}: no node {str(node)[:80]!r} in the layout (nodes: {self._names[:8]})")
        return i

    def cordon(self, node: str) -> bool:
        """Place no new token on ``node`` (its reservation is lost) and leave it out of ``capacity_for``
        and ``free``; what it holds still goes back as usual. Whether it was not cordoned already."""
        i = self._node(node, "cordon")
        if i in self._cordoned:
            return False
        self._cordoned.add(i)
        del self._order[bisect_left(self._order, self._keys[i])]
        self._max_cache.clear()
        return True

    def uncordon(self, node: str) -> bool:
        """Undo ``cordon`` (the node's reservation is back). Whether it was cordoned."""
        i = self._node(node, "uncordon")
        if i not in self._cordoned:
            return False
        self._cordoned.discard(i)
        insort(self._order, self._keys[i])
        self._max_cache.clear()
        return True

    @property
    def cordoned(self) -> list[str]:
        """The cordoned nodes, in layout order."""
        return [name for i, name in enumerate(self._names) if i in self._cordoned]

    # ---- capacity and views ------------------------------------------------------------------
    def capacity_for(self, per_sample: Resource) -> int:
        """The most ``per_sample`` tokens the empty pool holds at once on the nodes not cordoned (the
        deadlock check's figure)."""
        cached = self._max_cache.get(per_sample)
        if cached is not None:
            return cached
        u, k, cpu, mem, _ = demand_of(per_sample)
        total = 0
        _, cpu_cap, mem_cap = self._capacity
        for i in range(self._n):
            if i in self._cordoned:
                continue
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

    def snapshot(self) -> dict:
        """Exact state in integer units, per node: free units per GPU id, free milli-cores, free MiB,
        tokens held, whether it is cordoned. Equal snapshots mean equal ledgers."""
        return {
            name: {
                "gpu_units": dict(zip(self._gpu_ids[i], self._gpus[i], strict=True)),
                "cpu_milli": self._cpu[i],
                "memory_mib": self._mem[i],
                "held": self._held_on[i],
                "cordoned": i in self._cordoned,
            }
            for i, name in enumerate(self._names)
        }

    def free(self) -> dict[str, Resource]:
        """Free GPU (summed over the node's GPUs), CPU and memory per node that is not cordoned: what
        new tokens can still get."""
        view = self._view(self._gpu_free, self._cpu, self._mem)
        for i in self._cordoned:
            del view[self._names[i]]
        return view

    def capacity(self) -> dict[str, Resource]:
        """Total GPU, CPU and memory per node (``free()`` of the empty pool)."""
        return self._view(*self._capacity)

    def _view(self, gpu: list[int], cpu: list[int], mem: list[int]) -> dict[str, Resource]:
        # concurrency is not a pool resource; 0 marks it as unused here
        return {
            name: Resource(gpu[i] / GPU_UNIT, 0, cpu[i] / CPU_UNIT, mem[i] / MEM_UNIT)
            for i, name in enumerate(self._names)
        }

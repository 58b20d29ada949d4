"""Helpers shared by the placement-pool tests: small layouts, requests, and a scripted reservation
hook that records what it holds."""

from __future__ import annotations

import asyncio
import math

import msgspec

from rayapp.core.pool import PlacementPool
from rayapp.types import BatchRequest, NodeSpec, Resource, Token

BIG = Resource(gpu=math.inf, concurrency=1000, cpu=math.inf, memory_gb=math.inf)


def pool_of(**nodes: NodeSpec) -> PlacementPool:
    return PlacementPool(dict(nodes))


def node(n_gpus: int = 0, cpu: float = 64, memory_gb: float = 256) -> NodeSpec:
    return NodeSpec(gpus=tuple(range(n_gpus)), cpu=cpu, memory_gb=memory_gb)


def take(pool: PlacementPool, per_sample: Resource, n: int = 1) -> list[Token]:
    tokens = pool.try_acquire_batch(BIG, per_sample, n)
    assert tokens is not None and len(tokens) == n
    return tokens


def placed(tokens: list[Token]) -> list[tuple[str, tuple[int, ...]]]:
    return [(t.node, t.gpu_ids) for t in tokens]


def req(per_sample: Resource, n: int, *, budget: Resource = BIG, **kw) -> BatchRequest:
    return BatchRequest(budget, per_sample, n, **kw)


class HookError(RuntimeError):
    pass


class ScriptedHook:
    """A reservation hook answering each reserve from ``script`` in turn (then "ok"): "ok" realises
    the tokens (the group is the reservation's name), "none" refuses, "raise" fails, "hang" never
    answers (until cancelled). ``held`` is what it holds, by token id."""

    def __init__(self, script: list[str] = ()) -> None:
        self.script = list(script)
        self.calls: list[str] = []
        self.held: dict[int, Token] = {}
        self.pending = 0  # reserves in flight

    async def reserve(self, name: str, tokens: list[Token]) -> list[Token] | None:
        self.calls.append(name)
        step = self.script.pop(0) if self.script else "ok"
        if step == "none":
            return None
        if step == "raise":
            raise HookError(f"reserve {name} failed")
        if step == "hang":
            self.pending += 1
            try:
                await asyncio.Event().wait()
            finally:
                self.pending -= 1
        got = [msgspec.structs.replace(t, placement_group=name, bundle_index=i) for i, t in enumerate(tokens)]
        self.held |= {t.token_id: t for t in got}
        return got

    async def release(self, tokens: list[Token]) -> None:
        for t in tokens:
            assert self.held.pop(t.token_id) == t, "released a token the hook never realised"

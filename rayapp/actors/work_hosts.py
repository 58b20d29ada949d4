"""Warm processes in a sample's bundle for its function calls (verifiers, tools): ``WorkHosts``.

Why not a Ray task per call (``run_in_bundle``): a task runs in one of Ray's pooled workers, and Ray
keeps idle workers only up to the node's CPU count, actors counted, for seconds. Between two steps
(the trainer's update) those workers are gone, and each call of the next burst starts a Python
process (and the math verifier its own child, importing sympy). Measured on the GRPO demo through
the gateway: 344 of 352 verify tasks ran in a worker of their own, the machine's two cores went to
starting them, and a 128-sample rollout took 250-300 s against 10-20 s natively; ``bench/verify_cost.py``
times a burst after such a pause both ways.

A host is a small Ray actor scheduled into the token's bundle (its node; in a GPU bundle a token
share of the GPU, so Ray makes that GPU visible to it), running one call at a time. A call takes the
bundle's most recently used idle host; with none idle it waits ``grow_after_s`` for one to come free
(cheap calls share a few warm hosts), then starts one of its own (slow calls run side by side). A
host idle for ``idle_s`` is stopped at its bundle's next call; every host dies with its owner (the
manager replica).

Guarantees, as ``run_in_bundle``'s: a call is bounded by ``timeout_s`` (``AgentTimeout``); a call that
times out or is cancelled kills its host, so nothing of it runs on; a lost host, node or bundle is a
``SandboxError``, also while the call waits for the bundle (``bundle_watch``); the function's own error
comes back as itself and its host stays warm. What Ray no longer does: hold each call to the token's
share of the bundle (the ledger still admits by it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import ray
from ray import exceptions as rex

from rayapp.actors.bundle_watch import watched
from rayapp.actors.pool_service import bundle_strategy
from rayapp.actors.remote import bounded
from rayapp.core.termination import AgentTimeout, SandboxError
from rayapp.types import Token

__all__ = ["WorkHost", "WorkHosts"]

log = logging.getLogger(__name__)

# A call waits this long for a busy host before it starts one: longer than a burst of cheap calls takes to
# drain on the warm hosts (a new host's first call pays its cold start: the math verifier's child
# imports sympy, seconds; at 0.25 s every burst of 128 math verifications started two and waited for them)
GROW_AFTER_S = 1.0
MAX_STARTING = 2  # hosts of one bundle starting at once: a burst grows the bundle's hosts at this pace
IDLE_S = 600.0  # longer than a training step's pause between two rollouts
GPU_SHARE = 1e-4  # Ray's smallest GPU fraction: enough for Ray to make the bundle's GPU visible


@ray.remote(num_cpus=0, max_restarts=0)
class WorkHost:
    """Runs a sample's plain function calls in its bundle, one at a time. The dashboard shows it by
    its repr: the bundle it serves."""

    def __init__(self, where: str):
        self.where = where

    def __repr__(self) -> str:
        return f"WorkHost({self.where})"

    def call(self, fn: Any, *args: Any) -> Any:
        return fn(*args)


@dataclass
class _Host:
    actor: Any
    group_id: str  # the placement group's id, for bundle_watch
    idle_since: float = 0.0


class _Bundle:
    """One bundle's idle hosts (the warmest last) and the calls waiting for one."""

    def __init__(self) -> None:
        self.idle: deque[_Host] = deque()
        self.waiters: deque[asyncio.Future] = deque()
        self.starting = 0

    def put(self, host: _Host) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(host)
                return
        host.idle_since = time.monotonic()
        self.idle.append(host)

    def drop_idle(self) -> list[_Host]:
        """Take out every idle host."""
        out = list(self.idle)
        self.idle.clear()
        return out

    def stale(self, idle_s: float) -> list[_Host]:
        """Take out the hosts idle longer than ``idle_s`` (the oldest are first)."""
        out, now = [], time.monotonic()
        while self.idle and now - self.idle[0].idle_since > idle_s:
            out.append(self.idle.popleft())
        return out

    async def take(self, wait_s: float) -> _Host | None:
        if self.idle:
            return self.idle.pop()
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), wait_s)
        except TimeoutError:
            if waiter.done():  # handed over just as the wait ended
                return waiter.result()
            waiter.cancel()
            return None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.put(waiter.result())  # handed to a call that is gone: on to the next
            waiter.cancel()
            raise


def _kill(host: _Host) -> None:
    with contextlib.suppress(Exception):  # already dead, or its owner gone: nothing left to stop
        ray.kill(host.actor, no_restart=True)


class WorkHosts:
    """The manager's executor (``executor(token, fn, *args)``): ``run`` (module docstring)."""

    def __init__(self, *, idle_s: float = IDLE_S, grow_after_s: float = GROW_AFTER_S,
                 max_starting: int = MAX_STARTING):
        self.idle_s, self.grow_after_s, self.max_starting = idle_s, grow_after_s, max_starting
        self._bundles: dict[tuple[str, int], _Bundle] = {}
        self.started = 0  # hosts started so far (a figure for benchmarks and tests)

    async def run(self, token: Token | None, fn: Any, *args: Any, timeout_s: float = 300.0) -> Any:
        """``fn(*args)`` in a warm host in the token's bundle; without a placement group, in a worker
        thread of this process (as ``run_in_bundle``)."""
        if token is None or not token.placement_group:
            return await asyncio.to_thread(fn, *args)
        bundle = self._bundles.setdefault((token.placement_group, token.bundle_index), _Bundle())
        for old in bundle.stale(self.idle_s):
            _kill(old)
        where = f"bundle {token.placement_group}[{token.bundle_index}] on {token.node}"
        host = await self._host(bundle, token, where, timeout_s)
        keep = False
        try:
            ref = host.actor.call.remote(fn, *args)
            work = bounded(ref, timeout_s, late=lambda: AgentTimeout(f"work in {where} ran past {timeout_s}s"),
                           lost=lambda e: SandboxError(f"work in {where} was lost: {e}"))
            try:
                result = await watched(work, host.group_id, where)
            except rex.RayTaskError:  # the function's own error (``bounded`` raises it as its cause)
                keep = True  # it ended, and its host is fine
                raise
            except SandboxError:  # the host, its node or its bundle is gone: so are the idle ones there
                for idle in bundle.drop_idle():
                    _kill(idle)
                raise
            keep = True
            return result
        finally:
            if keep:
                bundle.put(host)
            else:
                _kill(host)

    async def _host(self, bundle: _Bundle, token: Token, where: str, timeout_s: float) -> _Host:
        """An idle host of the bundle, else the first to come free or to start. Starts are paced
        (``max_starting``): in a burst of cheap calls the warm hosts drain the queue before many start
        (a cold start, with the math verifier's child importing sympy, takes seconds)."""
        while True:
            host = await bundle.take(self.grow_after_s)
            if host is not None:
                return host
            if bundle.starting < self.max_starting:
                bundle.starting += 1
                try:
                    return await self._start(token, where, timeout_s)
                finally:
                    bundle.starting -= 1

    async def _start(self, token: Token, where: str, timeout_s: float) -> _Host:
        # reads the group (two GCS round trips): off the replica's event loop; SandboxError if it is lost
        strategy = await asyncio.to_thread(bundle_strategy, token)
        share = {"num_gpus": GPU_SHARE} if token.gpu_ids else {}
        host = _Host(WorkHost.options(scheduling_strategy=strategy, **share).remote(where),
                     strategy.placement_group.id.hex())
        self.started += 1
        try:
            ready = bounded(host.actor.__ray_ready__.remote(), timeout_s,
                            late=lambda: AgentTimeout(f"a work host in {where} did not start in {timeout_s}s"),
                            lost=lambda e: SandboxError(f"a work host in {where} was lost as it started: {e}"))
            await watched(ready, host.group_id, where)
        except BaseException:
            _kill(host)
            raise
        log.debug("work host %d started in %s", self.started, where)
        return host

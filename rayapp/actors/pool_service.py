"""The PlacementPool on Ray: the core pool over long-lived placement groups, one per layout node.

The core pool decides (all-or-nothing, best-fit, FIFO, docs/scheduler.md §3); this module exists
because Ray cannot grow or shrink a placement group and one per batch is slow, so the service
reserves the whole layout once, at start-up, and the ledger sub-allocates it. Each node's group has
one bundle per GPU and a last one with its CPU and memory, mirroring the ledger, so any set of tokens
the ledger holds at once fits Ray's bundles at once. Invariant: a token resolves only to its own
service's groups (a predecessor's fails as a lost bundle), and two live pools never share a cluster.
Bundles, lost nodes, cordoning and restarts: docs/cluster.md, "Placement groups: one per node".
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from typing import Any

import msgspec
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayapp.actors.bundle_watch import watched
from rayapp.actors.nodes import layout_from_cluster, resolve_nodes
from rayapp.actors.pool_owners import GROUP_PREFIX, free_per_node, owner_tag, remove_leftovers
from rayapp.actors.pool_wire import pack, unpack_request, unpack_tokens
from rayapp.actors.remote import bounded
from rayapp.core.layout import parse_cluster_layout
from rayapp.core.leases import LEASE_S, LeasedPool
from rayapp.core.termination import AgentTimeout, SandboxError
from rayapp.core.units import CPU_UNIT, MEM_UNIT, to_units
from rayapp.types import BatchRequest, NodeSpec, Resource, Token

log = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it; bundles are pinned with it
MIN_BUNDLE_CPU = 0.001  # Ray refuses an empty bundle; a node offering no CPU or memory still gets one
RAY_STEP = 10_000  # Ray counts resources in steps of 1e-4
STATE_POLL_S = 2.0  # how often the service reads its groups' states (a lost node is cordoned within this)
STALE_POLLS = 2  # a caller reads the states itself only when the last reading is this many periods old
STATE_READ_TIMEOUT_S = 10.0  # one reading of the placement group table from the GCS


class PlacementError(RuntimeError):
    """The layout's reservations could not be made in Ray at start-up."""


def node_bundles(spec: NodeSpec) -> list[dict[str, float]]:
    """A node's group: one ``{"GPU": 1}`` bundle per layout GPU, then the node's CPU and memory, in
    the ledger's own units (milli-cores, MiB), so that whatever the ledger holds at once fits."""
    rest = {"CPU": _cpu(spec.cpu), "memory": _memory(spec.memory_gb)}
    rest = {k: v for k, v in rest.items() if v > 0} or {"CPU": MIN_BUNDLE_CPU}
    return [{"GPU": 1.0} for _ in spec.gpus] + [rest]


def _cpu(cores: float) -> float:
    return to_units(cores, CPU_UNIT) / CPU_UNIT


def _memory(gb: float) -> int:
    return to_units(gb, MEM_UNIT) * 2**20


def _gpu(share: float) -> float:
    """A GPU share as Ray counts it: rounded down to its step (never more than the ledger granted),
    but never 0, which would hide the GPU from the task."""
    return max(1, math.floor(min(share, 1.0) * RAY_STEP)) / RAY_STEP


class NodeGroups:
    """The core pool's reservation hook on Ray: one long-lived group per layout node, made all or
    nothing by ``start``; ``reserve`` maps each token to its bundle (its first GPU's, or the node's
    CPU/memory bundle) and ``release`` has nothing to give back to Ray."""

    def __init__(self, layout: dict[str, NodeSpec], node_ids: dict[str, str]):
        self.layout, self.node_ids = layout, node_ids
        incarnation = f"{uuid.uuid4().hex[:8]}_{owner_tag()}"
        self.names = {node: f"{GROUP_PREFIX}node/{node}@{incarnation}" for node in layout}
        self._gpu_pos = {node: {g: p for p, g in enumerate(spec.gpus)} for node, spec in layout.items()}
        self.groups: dict[str, PlacementGroup] = {}

    def start(self, timeout_s: float) -> None:
        """Remove what services that are gone left (PoolInUse while a live one holds groups after
        ``timeout_s``), then reserve every node's group; unless all are ready within ``timeout_s``,
        remove them and raise PlacementError naming the nodes Ray could not place."""
        remove_leftovers(timeout_s)
        for node, spec in self.layout.items():
            bundles = node_bundles(spec)
            self.groups[node] = placement_group(
                bundles, strategy="PACK", name=self.names[node],
                bundle_label_selector=[{NODE_ID_LABEL: self.node_ids[node]}] * len(bundles))
        pending = {pg.ready(): node for node, pg in self.groups.items()}
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
        missing = sorted(set(pending.values()) - {pending[r] for r in ready})
        if missing:
            self.close()
            shapes = {n: node_bundles(self.layout[n]) for n in missing[:3]}
            raise PlacementError(f"Ray could not reserve the layout of {len(missing)} nodes within {timeout_s}s "
                                 f"(Ray has less than the layout says, or another tenant holds it): {shapes}")

    def bundle_of(self, token: Token) -> int:
        return self._gpu_pos[token.node][token.gpu_ids[0]] if token.gpu_ids else len(self._gpu_pos[token.node])

    async def reserve(self, name: str, tokens: list[Token]) -> list[Token]:
        return [msgspec.structs.replace(t, placement_group=self.names[t.node], bundle_index=self.bundle_of(t))
                for t in tokens]

    async def release(self, tokens: list[Token]) -> None:
        """The bundles stay reserved for the next tokens; the ledger alone frees capacity."""

    def states(self) -> dict[str, str]:
        """Each node's group state as Ray reports it (CREATED; RESCHEDULING once its node died)."""
        table = ray.util.placement_group_table()
        return {node: table.get(pg.id.hex(), {}).get("state", "REMOVED") for node, pg in self.groups.items()}

    def close(self) -> None:
        for pg in self.groups.values():
            remove_placement_group(pg)
        self.groups = {}


def bundle_strategy(token: Token) -> PlacementGroupSchedulingStrategy:
    """Schedule work (a sandbox, a verifier) into the sample's own bundle. SandboxError when the
    bundle is gone (its node died, or the pool service restarted): work sent there would wait forever."""
    if not token.placement_group:
        raise ValueError(f"token {token.token_id} holds no placement group")
    where = f"bundle {token.placement_group}[{token.bundle_index}] on {token.node}"
    try:
        pg = ray.util.get_placement_group(token.placement_group)
        state = ray.util.placement_group_table(pg).get("state")
    except ValueError as e:  # no group by that name any more
        raise SandboxError(f"{where} is gone: {e}") from e
    if state != "CREATED":
        raise SandboxError(f"{where} is lost: its placement group is {state} (its node died?)")
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=token.bundle_index,
                                            placement_group_capture_child_tasks=True)


def token_share(token: Token) -> dict[str, Any]:
    """What one piece of a token's work asks of its bundle: its GPU share in a GPU bundle; its CPU
    and memory in the CPU/memory bundle."""
    if token.gpu_ids:
        return {"num_cpus": 0, "num_gpus": _gpu(token.gpu)}
    share: dict[str, Any] = {"num_cpus": _cpu(token.cpu)}
    if token.memory_gb > 0:
        share["memory"] = _memory(token.memory_gb)
    return share


def work_options(token: Token) -> dict[str, Any]:
    """Ray options for one piece of a sample's work: its bundle, and the token's share there."""
    return {"scheduling_strategy": bundle_strategy(token), **token_share(token)}


@ray.remote(max_retries=0)
def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


def work_name(fn: Any) -> str:
    """The dashboard's name for ``fn``'s task: the function's name (``verify``), never the episode's. Ray
    counts every task by its name (``ray_tasks{Name=...}``, nine states each) in the caller's core worker,
    the node's metrics agent and every scrape, and keeps each name's series for good: a name per episode
    grew the manager by ~0.2 MB a step (issue 19 point 8). The sandbox host carries the episode (its repr
    is no metric label)."""
    return getattr(fn, "__name__", type(fn).__name__)


async def run_in_bundle(token: Token | None, fn: Any, *args: Any, timeout_s: float = 300.0) -> Any:
    """Run ``fn(*args)`` as a Ray task inside the token's bundle, asking for the token's share, so Ray
    holds it to what the ledger granted. A lost worker, node or bundle is a sandbox fault, also while
    the task still waits for its bundle (``bundle_watch``); a timeout kills the task."""
    if token is None or not token.placement_group:
        return await asyncio.to_thread(fn, *args)
    # two GCS round trips (the group by name, its state): off the replica's event loop, which runs every
    # episode of the step
    options = await asyncio.to_thread(work_options, token)
    ref = _call.options(**options, name=work_name(fn)).remote(fn, *args)
    where = f"bundle {token.placement_group}[{token.bundle_index}] on {token.node}"
    work = bounded(ref, timeout_s, force=True, late=lambda: AgentTimeout(f"work in {where} ran past {timeout_s}s"),
                   lost=lambda e: SandboxError(f"work in {where} was lost: {e}"))
    return await watched(work, options["scheduling_strategy"].placement_group.id.hex(), where)


class PlacementPoolService:
    """Hosted as one Serve replica (or a plain Ray actor in tests): the core pool (``LeasedPool``:
    cancellable request ids, owner leases of ``lease_s`` seconds) over one placement group per layout
    node, reserved when it starts (``pg_ready_timeout_s`` bounds that; a layout Ray cannot hold is a
    PlacementError then). Every method is ``async``: Serve runs a plain ``def`` in a
    worker thread, and the pool and its waiting acquires belong to the replica's event loop."""

    def __init__(self, cluster_layout: Any = None, num_cpus: float | None = None, memory_gb: float | None = None,
                 pg_ready_timeout_s: float = 10.0, state_poll_s: float = STATE_POLL_S, lease_s: float | None = LEASE_S):
        nodes = ray.nodes()
        layout = parse_cluster_layout(cluster_layout, num_cpus or 0.0, memory_gb or 0.0)
        if layout is None:  # only what the engine replicas started before the pool leave free
            layout = layout_from_cluster(nodes, num_cpus, memory_gb, free_per_node(wait_s=pg_ready_timeout_s))
        self.layout = layout
        self.node_ids = resolve_nodes(list(layout), nodes)
        self.groups = NodeGroups(layout, self.node_ids)
        self.groups.start(pg_ready_timeout_s)
        self.pool = LeasedPool(layout, self.groups, lease_s=lease_s)
        self.state_poll_s = state_poll_s
        self._polled = -math.inf  # loop time of the last reading of the groups' states
        self._watch: asyncio.Task | None = None
        self._reading: asyncio.Task | None = None  # the read of the groups' states in flight
        log.info("placement pool over %d nodes: %s", len(layout), layout)

    async def _refresh(self, max_age_s: float) -> dict[str, str] | None:
        """Read the groups' states unless the last reading is younger than ``max_age_s``, and cordon
        (or uncordon) each node by its group's state. The states read, or None when fresh enough.
        Callers that find the reading stale at once share one read."""
        if asyncio.get_running_loop().time() - self._polled < max_age_s:
            return None
        if self._reading is None or self._reading.done():
            self._reading = asyncio.get_running_loop().create_task(self._read_states())
        return await asyncio.shield(self._reading)

    async def _read_states(self) -> dict[str, str]:
        states = await asyncio.wait_for(asyncio.to_thread(self.groups.states), STATE_READ_TIMEOUT_S)
        self._polled = asyncio.get_running_loop().time()
        for node, state in states.items():
            if state == "CREATED" and self.pool.uncordon(node):
                log.warning("node %s: its placement group is CREATED again; uncordoned", node)
            elif state != "CREATED" and self.pool.cordon(node):
                log.warning("node %s: its placement group is %s (node lost?); cordoned, no new tokens go there",
                            node, state)
        return states

    async def _watch_groups(self) -> None:
        while True:
            try:
                await self._refresh(0.0)
            except Exception as e:  # GCS slow or restarting: keep the last reading, try again
                log.warning("reading the pool's placement group states failed: %s", e)
            try:
                await self.pool.expire_leases()
            except Exception as e:  # the expired batches' ledger part is back already; log the rest
                log.warning("freeing the batches of expired leases failed: %s", e)
            await asyncio.sleep(self.state_poll_s)

    async def _ready(self) -> None:
        """Before admitting: the watcher runs (started on the replica's loop at its first call), and
        the states are no older than twice ``state_poll_s``. The watcher alone reads every period (a
        reading is just past one period old when it reads again); a caller reads only when the
        watcher is behind by a whole period (a slow GCS), so the states are read once per period."""
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_groups())
        await self._refresh(STALE_POLLS * self.state_poll_s)

    def __del__(self) -> None:
        # A replica stopped in order (Serve calls __del__) gives its groups back now, not when Ray
        # reaps the dead actor's; what any other creator left is removed by the next service's start.
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.cancel()
        groups = getattr(self, "groups", None)
        if groups is not None:
            try:
                groups.close()
            except Exception as e:  # Ray already gone (interpreter shutdown): nothing left to free
                log.debug("removing the pool's placement groups failed: %s", e)

    async def acquire_batch(self, request: BatchRequest | bytes, request_id: str | None = None) -> list[Token] | bytes:
        """A request sent packed (``pool_wire``) is answered packed."""
        plain = unpack_request(request)
        await self._ready()
        tokens = await self.pool.acquire_batch(plain, request_id)
        return pack(tokens) if isinstance(request, bytes) else tokens

    async def cancel(self, request_id: str) -> str:
        """The caller of ``request_id`` is gone: withdraw its acquire or free what it was granted."""
        return await self.pool.cancel(request_id)

    async def renew(self, owner: str) -> None:
        """``owner`` is alive: its batches are kept another lease period."""
        self.pool.renew(owner)

    async def release_tokens(self, tokens: list[Token] | bytes) -> None:
        await self.pool.release_tokens(unpack_tokens(tokens, "release_tokens"))

    async def release_batch(self, tokens: list[Token] | bytes) -> None:
        await self.pool.release_batch(unpack_tokens(tokens, "release_batch"))

    async def release_owner(self, owner: str) -> int:
        """Free what a restarted manager's predecessor held, and cancel its waiting acquires."""
        return await self.pool.release_owner(owner)

    async def max_tokens_for(self, per_sample: Resource) -> int:
        await self._ready()
        return self.pool.capacity_for(per_sample)

    async def placement(self) -> dict[str, Any]:
        """Who holds what: each held batch's tokens (node, GPU ids, fraction, placement group and
        bundle), each node's group and its state, the nodes whose group Ray lost, those cordoned, and
        the ledger's free view (cordoned nodes left out)."""
        await self._ready()
        states = await self._refresh(0.0)
        return {
            "batches": {b.name: {"owner": b.owner, "tokens": [
                {"node": t.node, "node_id": self.node_ids[t.node], "gpu_ids": list(t.gpu_ids), "gpu": t.gpu,
                 "cpu": t.cpu, "memory_gb": t.memory_gb, "placement_group": t.placement_group,
                 "bundle_index": t.bundle_index} for t in b.tokens]} for b in self.pool.batches()},
            "groups": {n: {"placement_group": self.groups.names[n], "node_id": self.node_ids[n], "state": states[n],
                           "bundles": node_bundles(spec)} for n, spec in self.layout.items()},
            "lost_nodes": sorted(n for n, state in states.items() if state != "CREATED"),
            "cordoned": self.pool.cordoned,
            "free": {n: msgspec.structs.asdict(r) for n, r in self.pool.free().items()},
            "held_tokens": self.pool.held,
            "waiting": self.pool.waiting,
        }

    async def snapshot(self) -> dict:
        return self.pool.snapshot()

"""The PlacementPool on Ray: the core pool, with one real placement group per admitted batch.

The core pool decides (all-or-nothing, best-fit, FIFO, spec §3); its reservation hook here makes Ray
reserve exactly what it decided: one bundle per token, ``{"CPU", "memory", "GPU": fraction}``,
pinned to the ledger's node with a ``ray.io/node-id`` bundle label selector. If Ray cannot make the
group ready within a bound (its view differs from the ledger's: another tenant, a dead node), the
group is removed and the reservation refused: the core rolls the ledger back and the batch retries
at the head of the queue. The group is named after the rollout, batch and task type, so
``ray list placement-groups`` and the dashboard show who holds what.

Layout node names resolve to Ray nodes by the ``rayapp.io/node`` label, the node id, or the node's
IP, in that order; a name that matches no live node, or several, is an error at start-up.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayapp.actors.remote import bounded
from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool
from rayapp.core.termination import AgentTimeout, SandboxError
from rayapp.types import BatchRequest, NodeSpec, Resource, Token

log = logging.getLogger(__name__)

NODE_LABEL = "rayapp.io/node"  # optional node label naming a node in the cluster layout
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it; bundles are pinned with it
GROUP_PREFIX = "rayapp/"  # every group the pool makes is named rayapp/<batch label>/<grant number>
MIN_BUNDLE_CPU = 0.001  # Ray refuses an empty bundle; a token that needs nothing still gets one


class NodeResolutionError(ValueError):
    pass


def _alive(ray_nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [n for n in ray_nodes if n.get("Alive", n.get("alive", False))]


def _node_name(node: dict[str, Any], ip_count: dict[str, int]) -> str:
    label = (node.get("Labels") or {}).get(NODE_LABEL)
    ip = node["NodeManagerAddress"]
    return label or (ip if ip_count[ip] == 1 else node["NodeID"])


def layout_from_cluster(ray_nodes: list[dict[str, Any]], num_cpus: float | None = None,
                        memory_gb: float | None = None) -> dict[str, NodeSpec]:
    """A cluster layout read off the live cluster (``ray.nodes()``): each node's whole GPUs, its CPUs
    and memory, unless ``num_cpus``/``memory_gb`` (the --env-num-cpus / --env-memory-gb flags) say
    otherwise. Nodes are named by their rayapp.io/node label, else their IP, else their id."""
    alive = _alive(ray_nodes)
    ip_count: dict[str, int] = {}
    for n in alive:
        ip_count[n["NodeManagerAddress"]] = ip_count.get(n["NodeManagerAddress"], 0) + 1
    layout = {}
    for n in alive:
        res = n.get("Resources", {})
        if not any(res.get(k, 0) > 0 for k in ("GPU", "CPU", "memory")):
            continue
        layout[_node_name(n, ip_count)] = NodeSpec(
            gpus=tuple(range(int(res.get("GPU", 0)))),
            cpu=float(num_cpus if num_cpus is not None else res.get("CPU", 0)),
            memory_gb=float(memory_gb if memory_gb is not None else res.get("memory", 0) / 2**30),
        )
    if not layout:
        raise NodeResolutionError("the live Ray cluster has no node with GPUs, CPUs or memory")
    return layout


def resolve_nodes(names: list[str], ray_nodes: list[dict[str, Any]]) -> dict[str, str]:
    """Layout node name -> Ray node id, by label, then node id, then IP; exactly one match each."""
    alive = _alive(ray_nodes)
    out = {}
    for name in names:
        for key in (lambda n: (n.get("Labels") or {}).get(NODE_LABEL), lambda n: n["NodeID"],
                    lambda n: n["NodeManagerAddress"]):
            matches = [n["NodeID"] for n in alive if key(n) == name]
            if matches:
                break
        if len(matches) != 1:
            why = "no live Ray node" if not matches else f"{len(matches)} Ray nodes"
            raise NodeResolutionError(
                f"cluster layout node {name!r} matches {why}; name nodes by IP or node id, or start them "
                f"with the label {NODE_LABEL}={name}")
        out[name] = matches[0]
    return out


def bundle_for(token: Token) -> dict[str, float]:
    bundle = {"CPU": token.cpu, "memory": int(token.memory_gb * 2**30),
              "GPU": token.gpu * len(token.gpu_ids)}
    bundle = {k: v for k, v in bundle.items() if v > 0}
    return bundle or {"CPU": MIN_BUNDLE_CPU}


def bundle_strategy(token: Token) -> PlacementGroupSchedulingStrategy:
    """Schedule work (a sandbox, a verifier) into the sample's own bundle."""
    if not token.placement_group:
        raise ValueError(f"token {token.token_id} holds no placement group")
    pg = ray.util.get_placement_group(token.placement_group)
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=token.bundle_index,
                                            placement_group_capture_child_tasks=True)


@ray.remote(max_retries=0)
def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


async def run_in_bundle(token: Token | None, fn: Any, *args: Any, timeout_s: float = 300.0) -> Any:
    """Run ``fn(*args)`` as a Ray task inside the token's bundle, so Ray really holds what the ledger
    granted. A lost worker or node is a sandbox fault; a timeout kills the task."""
    if token is None or not token.placement_group:
        return await asyncio.to_thread(fn, *args)
    ref = _call.options(scheduling_strategy=bundle_strategy(token), num_cpus=token.cpu).remote(fn, *args)
    where = f"bundle {token.placement_group}[{token.bundle_index}] on {token.node}"
    return await bounded(ref, timeout_s, force=True,
                         late=lambda: AgentTimeout(f"work in {where} ran past {timeout_s}s"),
                         lost=lambda e: SandboxError(f"work in {where} was lost: {e}"))


class PlacementGroups:
    """The core pool's reservation hook on Ray: one placement group per reservation, one bundle per
    token, each pinned to the token's node; a group goes when the last of its tokens is released. A
    group Ray cannot make ready within ``ready_timeout_s`` is removed and the reservation refused."""

    def __init__(self, node_ids: dict[str, str], ready_timeout_s: float):
        self.node_ids, self.ready_timeout_s = node_ids, ready_timeout_s
        self._groups: dict[str, tuple[PlacementGroup, set[int]]] = {}  # name -> (group, its tokens held)

    async def reserve(self, name: str, tokens: list[Token]) -> list[Token] | None:
        group = f"{GROUP_PREFIX}{name}"
        pg = placement_group([bundle_for(t) for t in tokens], strategy="PACK", name=group,
                             bundle_label_selector=[{NODE_ID_LABEL: self.node_ids[t.node]} for t in tokens])
        try:
            await bounded(pg.ready(), self.ready_timeout_s)
        except BaseException as e:  # not ready in time, cancelled, a Ray error: hold nothing
            remove_placement_group(pg)
            if isinstance(e, TimeoutError):
                log.warning("placement group %s not ready within %.1fs; removed", group, self.ready_timeout_s)
                return None
            raise
        self._groups[group] = (pg, {t.token_id for t in tokens})
        return [msgspec.structs.replace(t, placement_group=group, bundle_index=i) for i, t in enumerate(tokens)]

    async def release(self, tokens: list[Token]) -> None:
        for t in tokens:
            pg, held = self._groups[t.placement_group]
            held.discard(t.token_id)
            if not held:
                del self._groups[t.placement_group]
                remove_placement_group(pg)


class PlacementPoolService:
    """Hosted as one Serve replica (or a plain Ray actor in tests): the core pool with Ray placement
    groups as its reservations. Every method is ``async``: Serve runs a plain ``def`` in a worker
    thread, and the pool and its waiting acquires belong to the replica's event loop."""

    def __init__(self, cluster_layout: Any = None, num_cpus: float | None = None, memory_gb: float | None = None,
                 pg_ready_timeout_s: float = 10.0):
        nodes = ray.nodes()
        layout = parse_cluster_layout(cluster_layout, num_cpus or 0.0, memory_gb or 0.0)
        if layout is None:
            layout = layout_from_cluster(nodes, num_cpus, memory_gb)
        self.layout = layout
        self.node_ids = resolve_nodes(list(layout), nodes)
        self.pool = PlacementPool(layout, PlacementGroups(self.node_ids, pg_ready_timeout_s))
        log.info("placement pool over %d nodes: %s", len(layout), layout)

    async def acquire_batch(self, request: BatchRequest) -> list[Token]:
        return await self.pool.acquire_batch(request)

    async def release_batch(self, tokens: list[Token]) -> None:
        await self.pool.release_batch(tokens)

    async def release_tokens(self, tokens: list[Token]) -> None:
        await self.pool.release_tokens(tokens)

    async def release_owner(self, owner: str) -> int:
        """Free what a restarted manager's predecessor held, and cancel its waiting acquires."""
        return await self.pool.release_owner(owner)

    async def max_tokens_for(self, per_sample: Resource) -> int:
        return self.pool.capacity_for(per_sample)

    async def placement(self) -> dict[str, Any]:
        """Who holds what: each held batch's tokens (node, GPU ids, fraction, placement group and
        bundle), and the ledger's free view."""
        return {
            "batches": {b.name: {"owner": b.owner, "tokens": [
                {"node": t.node, "node_id": self.node_ids[t.node], "gpu_ids": list(t.gpu_ids), "gpu": t.gpu,
                 "cpu": t.cpu, "memory_gb": t.memory_gb, "placement_group": t.placement_group,
                 "bundle_index": t.bundle_index} for t in b.tokens]} for b in self.pool.batches()},
            "free": {n: msgspec.structs.asdict(r) for n, r in self.pool.free().items()},
            "held_tokens": self.pool.held,
            "waiting": self.pool.waiting,
        }

    async def snapshot(self) -> dict:
        return self.pool.snapshot()

"""The PlacementPool on Ray: the core ledger plus one real placement group per admitted batch.

The ledger decides (all-or-nothing, best-fit, spec §3); Ray then reserves exactly what it decided:
one bundle per token, ``{"CPU", "memory", "GPU": fraction}``, pinned to the ledger's node with a
``ray.io/node-id`` bundle label selector. If Ray cannot make the group ready within a bound (its
view differs from the ledger's: another tenant, a dead node), the group is removed and the ledger
rolls back, so the acquire returns None and nothing is held. The group is named after the rollout,
batch and task type, so ``ray list placement-groups`` and the dashboard show who holds what.

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

from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool
from rayapp.core.termination import AgentTimeout, SandboxError
from rayapp.types import NodeSpec, Resource, Token

log = logging.getLogger(__name__)

NODE_LABEL = "rayapp.io/node"  # optional node label naming a node in the cluster layout
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it; bundles are pinned with it
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
    granted. A lost worker or node is a sandbox fault; a timeout cancels the task."""
    if token is None or not token.placement_group:
        return await asyncio.to_thread(fn, *args)
    ref = _call.options(scheduling_strategy=bundle_strategy(token), num_cpus=token.cpu).remote(fn, *args)
    where = f"bundle {token.placement_group}[{token.bundle_index}] on {token.node}"
    try:
        return await asyncio.wait_for(ref, timeout_s)
    except TimeoutError:
        ray.cancel(ref, force=True)
        raise AgentTimeout(f"work in {where} ran past {timeout_s}s") from None
    except ray.exceptions.RayTaskError as e:
        raise e.as_instanceof_cause() from None
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
            ray.exceptions.TaskPlacementGroupRemoved) as e:
        raise SandboxError(f"work in {where} was lost: {e}") from e


class _Hold(msgspec.Struct):
    pg: Any
    owner: str
    tokens: list[Token]  # as the ledger issued them


class PlacementPoolService:
    """Hosted as one Serve replica (or a plain Ray actor in tests). Every method is ``async``: Serve
    runs a plain ``def`` in a worker thread, and the ledger and the waiting acquires belong to the
    replica's event loop."""

    def __init__(self, cluster_layout: Any = None, num_cpus: float | None = None, memory_gb: float | None = None,
                 pg_ready_timeout_s: float = 10.0):
        nodes = ray.nodes()
        layout = parse_cluster_layout(cluster_layout, num_cpus or 0.0, memory_gb or 0.0)
        if layout is None:
            layout = layout_from_cluster(nodes, num_cpus, memory_gb)
        self.layout = layout
        self.node_ids = resolve_nodes(list(layout), nodes)
        self.ledger = PlacementPool(layout)
        self.pg_ready_timeout_s = pg_ready_timeout_s
        self._holds: dict[str, _Hold] = {}
        self._pending: dict[str, set[asyncio.Task]] = {}  # owner -> its acquires still in flight
        self._seq = 0
        log.info("placement pool over %d nodes: %s", len(layout), layout)

    async def acquire_batch(self, budget: Resource, per_sample: Resource, max_tokens: int, *,
                            timeout: float | None = None, label: str = "batch", owner: str = "") -> list[Token] | None:
        pending = self._pending.setdefault(owner, set())
        task = asyncio.current_task()
        pending.add(task)
        try:
            return await self._acquire(budget, per_sample, max_tokens, timeout, label, owner)
        finally:
            pending.discard(task)

    async def _acquire(self, budget: Resource, per_sample: Resource, max_tokens: int, timeout: float | None,
                       label: str, owner: str) -> list[Token] | None:
        tokens = await self.ledger.acquire_batch(budget, per_sample, max_tokens, timeout=timeout)
        if not tokens:
            return tokens
        self._seq += 1
        name = f"rayapp/{label}/{self._seq}"
        pg: PlacementGroup | None = None
        try:
            pg = placement_group([bundle_for(t) for t in tokens], strategy="PACK", name=name,
                                 bundle_label_selector=[{NODE_ID_LABEL: self.node_ids[t.node]} for t in tokens])
            await asyncio.wait_for(pg.ready(), self.pg_ready_timeout_s)
        except BaseException as e:  # timeout, cancellation, a Ray error: hold nothing
            if pg is not None:
                remove_placement_group(pg)
            self.ledger.release(tokens)
            if isinstance(e, TimeoutError):
                log.warning("placement group %s not ready within %.1fs; ledger rolled back", name,
                            self.pg_ready_timeout_s)
                return None
            raise
        self._holds[name] = _Hold(pg, owner, tokens)
        return [msgspec.structs.replace(t, placement_group=name, bundle_index=i) for i, t in enumerate(tokens)]

    async def release_batch(self, tokens: list[Token]) -> None:
        names = {t.placement_group for t in tokens}
        if len(names) != 1:
            raise ValueError(f"release_batch: tokens name {len(names)} placement groups, not one: {sorted(names)}")
        name = names.pop()
        if name not in self._holds:
            # Freed already: by release_owner after a manager restart, or lost with a pool restart.
            log.warning("release_batch: %s is not held (already freed)", name)
            return
        hold = self._holds[name]
        if sorted(t.token_id for t in tokens) != sorted(t.token_id for t in hold.tokens):
            raise ValueError(f"release_batch: {name} is released whole, with every token it was granted")
        self._release(name)

    def _release(self, name: str) -> None:
        hold = self._holds.pop(name)
        remove_placement_group(hold.pg)
        self.ledger.release(hold.tokens)

    async def release_owner(self, owner: str) -> int:
        """Free every batch an owner still holds (a restarted manager's predecessor) and cancel its
        acquires still waiting: a dead caller never cancels them, and one granted later would leak.
        Returns how many batches were freed."""
        waiting = list(self._pending.pop(owner, ()))
        for task in waiting:
            task.cancel()
        stale = [n for n, h in self._holds.items() if h.owner == owner]
        for name in stale:
            self._release(name)
        if waiting:
            log.warning("release_owner %s: cancelled %d waiting acquires", owner, len(waiting))
        return len(stale)

    async def max_tokens_for(self, per_sample: Resource) -> int:
        return self.ledger.capacity_for(per_sample)

    async def placement(self) -> dict[str, Any]:
        """Who holds what: each held group's tokens (node, GPU ids, fraction), and the ledger's free view."""
        return {
            "batches": {name: {"owner": h.owner, "tokens": [
                {"node": t.node, "node_id": self.node_ids[t.node], "gpu_ids": list(t.gpu_ids), "gpu": t.gpu,
                 "cpu": t.cpu, "memory_gb": t.memory_gb} for t in h.tokens]} for name, h in self._holds.items()},
            "free": {n: msgspec.structs.asdict(r) for n, r in self.ledger.free().items()},
            "held_tokens": self.ledger.held,
            "waiting": self.ledger.waiting,
        }

    async def snapshot(self) -> dict:
        return self.ledger.snapshot()

"""Layout nodes and Ray nodes: a layout read off the live cluster, and layout node names resolved
to Ray node ids.

A layout node name resolves by the ``rayapp.io/node`` label, the node id, or the node's IP, in that
order; a name that matches no live node, or several, is an error at start-up. With no layout, each
live node's free GPUs, CPUs and memory make one (``layout_from_cluster``).
"""

from __future__ import annotations

import math
from typing import Any

from rayapp.core.units import CPU_UNIT, MEM_UNIT
from rayapp.types import NodeSpec

NODE_LABEL = "rayapp.io/node"  # optional node label naming a node in the cluster layout


class NodeResolutionError(ValueError):
    pass


def _alive(ray_nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [n for n in ray_nodes if n.get("Alive", n.get("alive", False))]


def _node_name(node: dict[str, Any], ip_count: dict[str, int]) -> str:
    label = (node.get("Labels") or {}).get(NODE_LABEL)
    ip = node["NodeManagerAddress"]
    return label or (ip if ip_count[ip] == 1 else node["NodeID"])


def layout_from_cluster(ray_nodes: list[dict[str, Any]], num_cpus: float | None = None,
                        memory_gb: float | None = None,
                        available: dict[str, dict[str, float]] | None = None) -> dict[str, NodeSpec]:
    """A cluster layout read off the live cluster (``ray.nodes()``): each node's whole GPUs, its CPUs
    and memory, unless ``num_cpus``/``memory_gb`` (the --env-num-cpus / --env-memory-gb flags) say
    otherwise. With ``available`` (node id -> Ray's available resources), only what is free now
    counts: what the engine replicas already hold is not the pool's to hand out, or its groups
    could never be made and the deadlock check would pass on GPUs nobody can get. The flags cap
    what is free, never raise it. Nodes are named by their rayapp.io/node label, else their IP,
    else their id."""
    alive = _alive(ray_nodes)
    ip_count: dict[str, int] = {}
    for n in alive:
        ip_count[n["NodeManagerAddress"]] = ip_count.get(n["NodeManagerAddress"], 0) + 1
    layout = {}
    for n in alive:
        res = n.get("Resources", {})
        if available is not None:
            res = {k: min(res.get(k, 0), v) for k, v in available.get(n["NodeID"], {}).items()}
        if not any(res.get(k, 0) > 0 for k in ("GPU", "CPU", "memory")):
            continue
        cpu = _down(res.get("CPU", 0), CPU_UNIT)
        mem = _down(res.get("memory", 0) / 2**30, MEM_UNIT)
        if available is not None:
            cpu, mem = (min(x, flag) if flag is not None else x for x, flag in ((cpu, num_cpus), (mem, memory_gb)))
        else:
            cpu, mem = (flag if flag is not None else x for x, flag in ((cpu, num_cpus), (mem, memory_gb)))
        layout[_node_name(n, ip_count)] = NodeSpec(gpus=tuple(range(int(res.get("GPU", 0)))), cpu=float(cpu),
                                                   memory_gb=float(mem))
    if not layout:
        raise NodeResolutionError("the live Ray cluster has no node with GPUs, CPUs or memory free")
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


def _down(value: float, scale: int) -> float:
    """A live node's amount rounded DOWN to the ledger's unit: its node group (in those units) must
    never ask Ray for more than the node has, whatever odd byte count Ray detected."""
    return math.floor(value * scale) / scale

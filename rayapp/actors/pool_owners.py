"""Whose placement groups these are: every group a pool service makes is named
``rayapp/node/<layout node>@<incarnation>_<owner>``, the owner being the process that made it
(``a<actor id>``, or ``j<job id>`` for a service held by a driver). Ray ties a group to its creator's
job unless the creator is a detached actor (a Serve replica), so a killed plain actor's groups outlive
it: a service starting removes the rayapp groups whose owner is gone (and those of older designs,
which name no owner), and refuses to start while another live service holds any, naming it.

No public API tells whether an actor or a job is alive without the dashboard (``ray.util.state``
asks the dashboard, which a cluster may run without): ``ray._private.state`` reads the GCS's tables,
as the pool reads Ray's free resources per node from there already.
"""

from __future__ import annotations

import logging
import time

import ray
from ray._private import state as ray_state
from ray._private.state import available_resources_per_node
from ray.util.placement_group import PlacementGroup, remove_placement_group

log = logging.getLogger(__name__)

GROUP_PREFIX = "rayapp/"  # every group the pool makes is named rayapp/node/<layout node>@<incarnation>_<owner>
OWNER_POLL_S = 0.2  # how often a starting service looks again whether a live owner has gone


class PoolInUse(RuntimeError):
    """Another live pool service holds placement groups on this Ray cluster."""


def owner_tag() -> str:
    """This process, as group names carry it: its actor id, or its job's id outside an actor."""
    context = ray.get_runtime_context()
    actor = context.get_actor_id()
    return f"a{actor}" if actor else f"j{context.get_job_id()}"


def live_owner(name: str) -> str | None:
    """Who made the group named ``name`` while they are alive, in words; None once they are gone,
    or when the name carries no owner (an older design's group)."""
    _, _, incarnation = name.rpartition("@")
    _, sep, owner = incarnation.partition("_")
    kind, ident = owner[:1], owner[1:]
    if not sep or not ident:
        return None
    if kind == "a":
        try:
            info = ray_state.actors(actor_id=ident)
        except ValueError:  # not an actor id: no owner of ours
            return None
        if info and info.get("State") != "DEAD":
            return f"actor {info.get('Name') or info.get('ActorClassName')} (id {ident}, {info.get('State')})"
    elif kind == "j":
        for job in ray_state.jobs():
            if job.get("JobID") == ident and not job.get("IsDead"):
                return f"the driver of job {ident} (pid {job.get('DriverPid')})"
    return None


def _groups() -> dict[str, dict]:
    """The rayapp groups Ray has not removed, by id."""
    return {i: info for i, info in ray.util.placement_group_table().items()
            if info.get("name", "").startswith(GROUP_PREFIX) and info.get("state") != "REMOVED"}


def _live(groups: dict[str, dict]) -> dict[str, list[str]]:
    """The groups' live owners: the names of each one's groups."""
    owners: dict[str, list[str]] = {}
    for info in groups.values():
        owner = live_owner(info["name"])
        if owner is not None:
            owners.setdefault(owner, []).append(info["name"])
    return owners


def remove_leftovers(wait_s: float = 0.0) -> list[str]:
    """Remove every rayapp group whose owner is gone; their names. PoolInUse, with nothing removed,
    while another service that holds groups is still alive after ``wait_s`` (a replaced replica may
    take a moment to go)."""
    deadline = time.monotonic() + wait_s
    while True:
        groups = _groups()
        owners = _live(groups)
        if not owners:
            break
        if time.monotonic() >= deadline:
            held = "; ".join(f"{owner} holds {sorted(names)}" for owner, names in owners.items())
            raise PoolInUse(f"another pool service is running on this Ray cluster: {held}. Pools cannot be "
                            "shared yet: stop that application (its `rayapp run`, or `serve delete` of it) or "
                            "start this one on another Ray cluster")
        time.sleep(OWNER_POLL_S)
    for pg_id in groups:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
    gone = sorted(info["name"] for info in groups.values())
    if gone:
        log.warning("removed %d placement groups a pool service that is gone left: %s", len(gone), gone)
    return gone


def free_per_node(settle_s: float = 5.0, wait_s: float = 0.0) -> dict[str, dict[str, float]]:
    """Ray's available resources per node id once the groups of services that are gone are removed
    (``remove_leftovers``, which refuses while a live one holds groups): Ray's view is read again
    until it shows their bundles back (``settle_s`` at most), so they count as free and nothing
    else does."""
    owed: dict[str, dict[str, float]] = {}
    for info in _groups().values():
        if info.get("state") == "CREATED":
            for index, bundle in info.get("bundles", {}).items():
                node = owed.setdefault(info.get("bundles_to_node_id", {}).get(index, ""), {})
                for k, v in bundle.items():
                    node[k] = node.get(k, 0) + v
    before = available_resources_per_node()
    remove_leftovers(wait_s)
    deadline = time.monotonic() + settle_s
    while True:
        now = available_resources_per_node()
        if all(now.get(n, {}).get(k, 0) >= before.get(n, {}).get(k, 0) + v - 1e-6
               for n, need in owed.items() if n for k, v in need.items()) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)

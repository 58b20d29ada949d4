"""Admission through Ray: acquire + release of one batch through the PlacementPoolService actor.

The manager's path: ``PoolClient`` over an actor handle, one 8-token batch (gpu 0.125, cpu 0.1,
memory 0.01 GB each) acquired and released whole, sequentially and from 8 concurrent callers. Prints
p50 and p99 per batch (ms) and batches/s, on one node (``ray.init`` with 8 logical GPUs) and on a
4-node ``ray.cluster_utils.Cluster``, for the pool's design (one long-lived placement group per node,
the ledger sub-allocating it, with the app's client: ``PoolClient``, its calls packed) and, unless
``--smoke``, for the same with its calls not packed (Ray pickles each token: ``PlainClient``, the
bench's own copy of the wire format the product dropped) and with the client's
background release (``background_release=True``: the caller waits for the acquire's round trip only),
for the former design kept here as a bench-only mode (one placement group made and removed per batch)
and for Ray's floor (the same calls to an async actor that does nothing: what any design through one
actor pays), with and without the background release. The designs over one actor take turns in
rounds, so the load of a shared machine hits them alike. Figures only; nothing here asserts on time.
Ray listens on 127.0.0.1 only, with Ray's token authentication on (a throwaway token).

Run from the repo root: ``.venv/bin/python bench/ray_pool.py [--smoke] [--batches N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from rayapp.actors.pool_client import PoolClient
from rayapp.actors.pool_service import NODE_ID_LABEL, PlacementPoolService, remove_leftovers, resolve_nodes
from rayapp.actors.remote import bounded
from rayapp.cli.local_cluster import process_auth_token
from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool
from rayapp.types import BatchRequest, Resource, Token

BATCH = 8
PER_SAMPLE = Resource(gpu=0.125, cpu=0.1, memory_gb=0.01)
REQUEST = BatchRequest(Resource(gpu=BATCH * 0.125, concurrency=BATCH, cpu=BATCH * 0.1, memory_gb=BATCH * 0.01),
                       PER_SAMPLE, BATCH, label="bench", timeout_s=120)
CONCURRENCY = 8
# Room for all 8 concurrent batches on one node: latency is admission, not waiting for capacity.
NODE = {"gpus": list(range(8)), "cpu": 8, "memory_gb": 1}


class PerBatchGroups:
    """The former reservation hook, for comparison: one placement group per batch, one bundle per
    token pinned to its node, removed when the batch is released whole."""

    def __init__(self, node_ids: dict[str, str]):
        self.node_ids, self.groups = node_ids, {}

    async def reserve(self, name: str, tokens: list[Token]) -> list[Token] | None:
        bundles = [{k: v for k, v in {"CPU": t.cpu, "memory": int(t.memory_gb * 2**30), "GPU": t.gpu}.items() if v}
                   for t in tokens]
        pg = placement_group(bundles, strategy="PACK", name=f"rayapp/{name}",
                             bundle_label_selector=[{NODE_ID_LABEL: self.node_ids[t.node]} for t in tokens])
        try:
            await bounded(pg.ready(), 30.0)
        except BaseException:
            remove_placement_group(pg)
            raise
        self.groups[name] = pg
        return [msgspec.structs.replace(t, placement_group=name, bundle_index=i) for i, t in enumerate(tokens)]

    async def release(self, tokens: list[Token]) -> None:
        remove_placement_group(self.groups.pop(tokens[0].placement_group))


class PerBatchService:
    """The pool service as it was: the core pool with one placement group per batch."""

    def __init__(self, layout: str):
        parsed = parse_cluster_layout(layout)
        self.pool = PlacementPool(parsed, PerBatchGroups(resolve_nodes(list(parsed), ray.nodes())))

    async def acquire_batch(self, request: BatchRequest, request_id: str | None = None) -> list[Token]:
        return await self.pool.acquire_batch(request)

    async def renew(self, owner: str) -> None:
        """The former design had no leases: nothing to renew."""

    async def release_batch(self, tokens: list[Token]) -> None:
        await self.pool.release_batch(tokens)


class RayFloor:
    """Ray's own floor for the same two calls: an async actor that decides nothing and holds nothing
    (``acquire_batch`` hands back no tokens, ``release_batch`` returns at once)."""

    def __init__(self, layout: str):
        pass

    async def acquire_batch(self, request: BatchRequest, request_id: str | None = None) -> list[Token]:
        return []

    async def renew(self, owner: str) -> None:
        pass

    async def release_batch(self, tokens: list[Token]) -> None:
        pass


class PlainClient(PoolClient):
    """The bench's own copy of the plain wire format, gone from the product: the request and the
    tokens sent as the Structs themselves, which Ray pickles one by one (the service still takes them)."""

    def _wire(self, value: Any) -> Any:
        return value


# design -> (the actor's class, the client's class, its options); "group per node" is the app's client
BG = {"background_release": True}
DESIGNS = {"group per node": (PlacementPoolService, PoolClient, {}),
           "node, not packed": (PlacementPoolService, PlainClient, {}),
           "node, bg release": (PlacementPoolService, PoolClient, BG), "no-op (Ray floor)": (RayFloor, PlainClient, {}),
           "no-op, bg release": (RayFloor, PlainClient, BG), "group per batch": (PerBatchService, PlainClient, {})}
ROUNDS = 5  # the designs sharing a setup take turns, so that the load of a shared machine hits them alike


async def one_batch(client: PoolClient) -> float:
    """What the caller waits for one batch: with a background release, the acquire's round trip and
    the release's sending (the pool applies it before this client's next call)."""
    start = time.perf_counter()
    tokens = await client.acquire_batch(REQUEST)
    await client.release_batch(tokens)
    return time.perf_counter() - start


async def run(client: PoolClient, batches: int, concurrency: int) -> tuple[list[float], float]:
    """Per-batch seconds and the wall time of ``batches`` batches from ``concurrency`` callers."""
    times: list[float] = []

    async def caller(n: int) -> None:
        for _ in range(n):
            times.append(await one_batch(client))

    start = time.perf_counter()
    share = [batches // concurrency + (i < batches % concurrency) for i in range(concurrency)]
    await asyncio.gather(*(caller(n) for n in share))
    await client.drain()  # the background releases' answers are in: the pool has freed every batch
    return times, time.perf_counter() - start


def row(setup: str, design: str, mode: str, times: list[float], wall: float) -> str:
    ms = sorted(t * 1000 for t in times)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    return (f"{setup:<8} {design:<18} {mode:<12} {len(ms):>7} {statistics.median(ms):>8.2f} {p99:>8.2f} "
            f"{len(ms) / wall:>10.1f}")


def measure(setup: str, layout: dict[str, Any], batches: int, designs: list[str]) -> list[str]:
    """Sequential, then concurrent: the designs over one actor class each take turns in ``ROUNDS``
    rounds; the per-batch design (its groups would clash with the pool's) runs alone, after."""
    rows = []
    actors: dict[type, Any] = {}
    for cls in dict.fromkeys(DESIGNS[d][0] for d in designs if d != "group per batch"):
        actors[cls] = ray.remote(cls).options(num_cpus=0).remote(json.dumps(layout))
    shared = [d for d in designs if d != "group per batch"]
    rows += rounds(setup, shared, actors, batches)
    for actor in actors.values():
        ray.kill(actor)
    remove_leftovers()  # whatever of the killed services' groups Ray has not reaped yet
    if "group per batch" in designs:
        actor = ray.remote(PerBatchService).options(num_cpus=0).remote(json.dumps(layout))
        rows += rounds(setup, ["group per batch"], {PerBatchService: actor}, max(8, batches // 20))  # it is slow
        ray.kill(actor)
        remove_leftovers()
    return rows


def rounds(setup: str, designs: list[str], actors: dict[type, Any], batches: int) -> list[str]:
    clients = {d: DESIGNS[d][1](actors[DESIGNS[d][0]], "bench", **DESIGNS[d][2]) for d in designs}
    for client in clients.values():
        asyncio.run(run(client, 4, 1))  # warm up the actor and the client's path
    rows = []
    for mode, concurrency in (("sequential", 1), (f"concurrent {CONCURRENCY}", CONCURRENCY)):
        times: dict[str, list[float]] = {d: [] for d in designs}
        walls = dict.fromkeys(designs, 0.0)
        for _ in range(ROUNDS):
            for d in designs:
                t, wall = asyncio.run(run(clients[d], max(1, batches // ROUNDS), concurrency))
                times[d] += t
                walls[d] += wall
        for d in designs:
            rows.append(row(setup, d, mode, times[d], walls[d]))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="few batches, the pool's design only")
    ap.add_argument("--batches", type=int, default=1000, help="batches per measurement (default 1000)")
    ap.add_argument("--design", action="append", choices=list(DESIGNS), help="only these designs (repeatable)")
    ap.add_argument("--setup", action="append", choices=["1", "4"], help="only 1 node or only 4 nodes")
    args = ap.parse_args()
    batches = 40 if args.smoke else args.batches
    designs = args.design or (["group per node"] if args.smoke else list(DESIGNS))
    setups = args.setup or ["1", "4"]
    print(f"acquire+release of one {BATCH}-token batch through PlacementPoolService (PoolClient over an actor)")
    print(f"{'setup':<8} {'design':<18} {'mode':<12} {'batches':>7} {'p50 ms':>8} {'p99 ms':>8} {'batches/s':>10}")

    if "1" in setups:
        ray.init(address="local", num_cpus=10, num_gpus=8, include_dashboard=False, logging_level="warning",
                 log_to_driver=False)
        try:
            measure("1 node", {"127.0.0.1": NODE}, batches, designs)
        finally:
            ray.shutdown()
    if "4" not in setups:
        return

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    try:
        for i in range(4):
            cluster.add_node(num_cpus=8, num_gpus=8, labels={"rayapp.io/node": f"node-{i}"},
                             node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        measure("4 nodes", {f"node-{i}": NODE for i in range(4)}, batches, designs)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    process_auth_token()  # Ray's token auth on, with a throwaway token (never ~/.ray's)
    main()

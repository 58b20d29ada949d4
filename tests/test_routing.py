"""Sticky routing: the engine deployments' request router (``rayapp.actors.app.STICKY_ROUTER``, Serve's
own consistent-hash router) inside Serve's routing loop (the one a deployment handle runs), over
in-process replicas that report their queue length as Serve's replica actors do. No cluster: the
deployment-level behaviour is ``tests/isolated/test_sticky_serve.py``."""

import asyncio
import collections
import itertools

import pytest
from conftest import run
from ray._common.utils import import_attr
from ray.exceptions import ActorDiedError
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter

from rayapp.actors.app import STICKY_ROUTER
from rayapp.core.convert import InputError
from rayapp.inference.client import MAX_SESSION_ID, GenerateRequest, session_key, validate_request

DEPLOYMENT = DeploymentID("engine-student", "rayapp")
SESSIONS = [f"rollout0/math-{i}#{j}" for i in range(100) for j in range(4)]
ROUTER = import_attr(STICKY_ROUTER["request_router_class"])


def test_a_session_keeps_one_replica_whatever_the_order_the_replicas_are_listed_in():
    async def main():
        names = ["a1", "b2", "c3", "d4"]
        homes = {}
        for order in (names, names[::-1], names[1:] + names[:1]):
            r = router([Replica(n) for n in order])
            for s in SESSIONS[:50]:
                chosen = {await route(r, s) for _ in range(3)}
                assert len(chosen) == 1, (s, chosen)
                homes.setdefault(s, set()).update(chosen)
        return homes

    assert all(len(h) == 1 for h in run(main()).values())


def test_sessions_spread_over_replicas_and_a_lost_replica_moves_only_its_own_sessions():
    async def main():
        before = {s: await route(router([Replica(n) for n in ["a1", "b2", "c3", "d4"]]), s) for s in SESSIONS}
        r = router([Replica(n) for n in ["a1", "c3", "d4"]])
        after = {s: await route(r, s) for s in SESSIONS}
        return before, after

    before, after = run(main())
    counts = collections.Counter(before.values())
    assert set(counts) == {"a1", "b2", "c3", "d4"}
    assert all(50 <= n <= 150 for n in counts.values()), counts  # 100 each expected, of 400
    moved = {s for s in SESSIONS if after[s] != before[s]}
    assert moved == {s for s in SESSIONS if before[s] == "b2"}


def test_a_session_id_is_bounded_and_a_long_name_keeps_one_bounded_key():
    long = "rollout3/" + "x" * 1000 + "#0"
    key = session_key(long)
    assert len(key) <= MAX_SESSION_ID and key == session_key(long) and key != session_key(long + "1")
    assert session_key("rollout3/t#0") == "rollout3/t#0"
    validate_request(GenerateRequest([1], session_id=key))
    with pytest.raises(InputError, match=r"\$\.session_id"):
        validate_request(GenerateRequest([1], session_id=long))


class Replica:
    """A replica as Serve's router sees one: its id, its capacity, and its queue length on request
    (``dead``: its actor is gone, as Serve's probe reports a killed replica)."""

    def __init__(self, uid: str, capacity: int = 4):
        self.replica_id = ReplicaID(uid, DEPLOYMENT)
        self.max_ongoing_requests, self.queue, self.dead = capacity, 0, False
        self.node_id, self.availability_zone, self.multiplexed_model_ids = "node-1", None, set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        if self.dead:
            raise ActorDiedError()
        return self.queue


def router(replicas: list[Replica] | None, cache: bool = False) -> RequestRouter:
    """The app's router as a handle builds it (its class and kwargs from ``STICKY_ROUTER``)."""
    r = ROUTER(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
               use_replica_queue_len_cache=cache, initial_backoff_s=0.001, max_backoff_s=0.01)
    r.initialize_state(**STICKY_ROUTER["request_router_kwargs"])
    if replicas is not None:
        r.update_replicas(replicas)
    return r


_ids = itertools.count()


async def route(r: RequestRouter, session: str = "") -> str:
    """The replica Serve's loop picks for one request (the handle's router awaits the same call)."""
    n = next(_ids)
    pr = PendingRequest(args=[], kwargs={},
                        metadata=RequestMetadata(f"req-{n}", f"internal-{n}", call_method="generate",
                                                 session_id=session))
    async with asyncio.timeout(10):
        replica = await r._choose_replica_for_request(pr)
    return replica.replica_id.unique_id


def test_a_saturated_home_sends_the_call_elsewhere_until_it_has_room_again():
    async def main():
        a, b = Replica("a1"), Replica("b2")
        r = router([a, b])
        on_a = [s for s in SESSIONS[:20] if await home(s, ["a1", "b2"]) == "a1"]
        session = on_a[0]
        assert await route(r, session) == "a1"
        a.queue = a.max_ongoing_requests  # full: Serve's probe says it takes no more
        spilled = await route(r, session)
        a.queue = 1
        return spilled, await route(r, session)

    assert run(main()) == ("b2", "a1")


async def home(session: str, names: list[str]) -> str:
    """The replica a fresh router over idle replicas ``names`` sends ``session`` to."""
    return await route(router([Replica(n) for n in names]), session)


def test_a_dead_home_sends_the_call_to_a_live_replica_and_leaves_the_others_sessions_alone():
    async def main():
        homes = {s: await home(s, ["a1", "b2", "c3"]) for s in SESSIONS[:60]}
        on_a = [s for s in homes if homes[s] == "a1"][:10]
        elsewhere = [s for s in homes if homes[s] != "a1"][:10]
        a, b, c = Replica("a1"), Replica("b2"), Replica("c3")
        r = router([a, b, c])
        a.dead = True
        moved = {await route(r, s) for s in on_a}
        kept = [await route(r, s) == homes[s] for s in elsewhere]
        return on_a, moved, kept, set(x.unique_id for x in r.curr_replicas)

    on_a, moved, kept, live = run(main())
    assert on_a and "a1" not in moved and moved <= {"b2", "c3"}
    assert all(kept)
    assert live == {"b2", "c3"}  # Serve dropped the dead replica


def test_calls_without_a_session_spread_over_the_replicas():
    async def main():
        r = router([Replica("a1"), Replica("b2")])
        return collections.Counter([await route(r) for _ in range(200)])

    counts = run(main())
    assert set(counts) == {"a1", "b2"} and min(counts.values()) >= 60, counts


def test_a_same_session_burst_on_full_replicas_is_routed_in_full_once_they_have_room():
    """Many calls of a few sessions while every replica is full (the routing loop backs off), then
    room: every call gets a replica, none is left without its routing task."""
    async def main():
        a, b = Replica("a1", capacity=2), Replica("b2", capacity=2)
        a.queue = b.queue = 2
        r = router([a, b])
        calls = [asyncio.create_task(route(r, SESSIONS[n % 3])) for n in range(30)]
        await asyncio.sleep(0.2)
        stuck = sum(c.done() for c in calls)
        a.queue = b.queue = 0
        done, pending = await asyncio.wait(calls, timeout=8)
        return stuck, len(done), len(pending)

    assert run(main()) == (0, 30, 0)


def test_a_burst_that_arrives_before_the_replicas_are_known_is_routed_in_full():
    """As in a manager replica at start-up: calls wait for the controller's replica list, then every
    one is routed."""
    async def main():
        r = router(None, cache=True)
        sessions = ["", *SESSIONS[:3]]
        calls = []
        for n in range(40):
            meta = RequestMetadata(f"burst-{n}", f"burst-internal-{n}", session_id=sessions[n % len(sessions)])
            calls.append(asyncio.create_task(r._choose_replica_for_request(PendingRequest([], {}, meta))))
        await asyncio.sleep(0.1)
        r.update_replicas([Replica("a1", capacity=64), Replica("b2", capacity=64)])
        done, pending = await asyncio.wait(calls, timeout=10)
        for c in pending:
            c.cancel()
        return len(done), len(pending)

    assert run(main()) == (40, 0)

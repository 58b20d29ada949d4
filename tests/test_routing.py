"""Sticky routing (``rayapp.actors.routing``): the choice of a session's home replica, and the
``SessionRouter`` inside Serve's own routing loop (the one a deployment handle runs) over
in-process replicas that report their queue length as Serve's replica actors do. No cluster: the
deployment-level behaviour is ``tests/isolated/test_sticky_serve.py``."""

import asyncio
import collections
import itertools

import pytest
from conftest import run
from ray.exceptions import ActorDiedError
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from rayapp.actors.routing import SessionRouter, home
from rayapp.core.convert import InputError
from rayapp.inference.client import MAX_SESSION_ID, GenerateRequest, session_key, validate_request

DEPLOYMENT = DeploymentID("engine-student", "rayapp")
SESSIONS = [f"rollout0/math-{i}#{j}" for i in range(100) for j in range(4)]


def test_a_session_has_one_home_whatever_the_order_of_the_replicas():
    replicas = ["a1", "b2", "c3", "d4"]
    for s in SESSIONS[:50]:
        homes = {home(s, list(p)) for p in itertools.permutations(replicas)}
        assert len(homes) == 1


def test_sessions_spread_evenly_and_a_lost_replica_moves_only_its_own_sessions():
    replicas = ["a1", "b2", "c3", "d4"]
    before = {s: home(s, replicas) for s in SESSIONS}
    counts = collections.Counter(before.values())
    assert set(counts) == set(replicas)
    assert all(60 <= n <= 140 for n in counts.values()), counts  # 100 each expected, of 400
    after = {s: home(s, ["a1", "c3", "d4"]) for s in SESSIONS}
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


def router(replicas: list[Replica]) -> SessionRouter:
    r = SessionRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                      use_replica_queue_len_cache=False, initial_backoff_s=0.001, max_backoff_s=0.01)
    r.update_replicas(replicas)
    return r


_ids = itertools.count()


async def route(r: SessionRouter, session: str = "") -> str:
    """The replica Serve's loop picks for one request (the handle's router awaits the same call)."""
    n = next(_ids)
    pr = PendingRequest(args=[], kwargs={},
                        metadata=RequestMetadata(f"req-{n}", f"internal-{n}", call_method="generate",
                                                 session_id=session))
    async with asyncio.timeout(10):
        replica = await r._choose_replica_for_request(pr)
    return replica.replica_id.unique_id


def test_every_call_of_a_session_goes_to_its_home_and_sessions_spread_over_replicas():
    async def main():
        replicas = [Replica("a1"), Replica("b2")]
        r = router(replicas)
        for s in SESSIONS[:40]:
            chosen = {await route(r, s) for _ in range(5)}
            assert chosen == {home(s, ["a1", "b2"])}
        return collections.Counter([await route(r, s) for s in SESSIONS[:40]])

    counts = run(main())
    assert set(counts) == {"a1", "b2"} and min(counts.values()) >= 10, counts


def test_a_saturated_home_sends_the_call_elsewhere_until_it_has_room_again():
    async def main():
        a, b = Replica("a1"), Replica("b2")
        r = router([a, b])
        session = next(s for s in SESSIONS if home(s, ["a1", "b2"]) == "a1")
        assert await route(r, session) == "a1"
        a.queue = a.max_ongoing_requests  # full: Serve's probe says it takes no more
        spilled = await route(r, session)
        a.queue = 1
        return spilled, await route(r, session)

    assert run(main()) == ("b2", "a1")


def test_a_dead_home_sends_the_call_to_a_live_replica_and_leaves_the_others_sessions_alone():
    async def main():
        a, b, c = Replica("a1"), Replica("b2"), Replica("c3")
        r = router([a, b, c])
        ids = ["a1", "b2", "c3"]
        on_a = [s for s in SESSIONS if home(s, ids) == "a1"][:10]
        elsewhere = [s for s in SESSIONS if home(s, ids) != "a1"][:10]
        a.dead = True
        moved = {await route(r, s) for s in on_a}
        kept = [await route(r, s) == home(s, ids) for s in elsewhere]
        return moved, kept, set(x.unique_id for x in r.curr_replicas)

    moved, kept, live = run(main())
    assert "a1" not in moved and moved <= {"b2", "c3"}
    assert all(kept)
    assert live == {"b2", "c3"}  # Serve dropped the dead replica


def test_a_call_without_a_session_goes_to_the_less_loaded_replica():
    async def main():
        a, b = Replica("a1"), Replica("b2")
        a.queue, b.queue = 3, 0
        r = router([a, b])
        return {await route(r) for _ in range(10)}

    assert run(main()) == {"b2"}


def test_a_burst_that_arrives_before_the_replicas_are_known_is_routed_in_full():
    """As in a manager replica at start-up: calls wait for the controller's replica list, then every
    one is routed (Serve's FIFO hand-over is not used, so no request may be left without its task)."""
    async def main():
        r = SessionRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA,
                          use_replica_queue_len_cache=True, initial_backoff_s=0.001, max_backoff_s=0.01)
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

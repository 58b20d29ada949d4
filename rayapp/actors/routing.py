"""Sticky routing of an episode's engine calls, through Serve's own request-router API.

A multi-turn episode sends each turn as the whole conversation so far. The engine replica that
served the previous turn still holds that conversation's KV cache (SGLang's radix cache on GPUs,
``rayapp.inference.prefix_cache`` in the hf engine), so the next turn prefills only what is new,
if it lands on the same replica. ``SessionRouter`` is the engine deployments' request router
(``RequestRouterConfig``, set in ``rayapp.actors.app``): a call that carries a session id (Serve's
``handle.options(session_id=...)``, which ``EngineClient`` sets from ``GenerateRequest.session_id``)
goes to the session's home replica, and only when that replica is saturated (its queue at
``max_ongoing_requests``) or gone does it go where Serve's default policy sends it (the less loaded of
two random replicas). A call without a session routes by that default policy alone.

- The home replica is the rendezvous (highest-random-weight) choice over the live replicas: a pure
  function of the session and the replica ids, so every process holding a handle (the manager, a
  gateway) picks the same one without sharing state, sessions spread evenly over replicas, and a
  replica that joins or leaves moves only the sessions it wins or held.
- Serve's loop does the rest: it probes the ranked candidates' queue lengths, takes the first rank
  with room, drops a replica whose actor died, and backs off when every rank is full.
- Serve's ``FIFOMixin`` is left out on purpose: it hands a replica found for one request to the
  oldest waiting one, which would send a session's call to another session's home.
"""

from __future__ import annotations

import hashlib
import random

from ray.serve.request_router import LocalityMixin, PendingRequest, RequestRouter, RunningReplica


def affinity(session: str, replica: str) -> int:
    """The rendezvous weight of ``replica`` (a replica's unique id) for ``session``: a stable hash
    (Python's ``hash`` is salted per process, and every handle's process must agree)."""
    digest = hashlib.blake2b(f"{session}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def home(session: str, replicas: list[str]) -> str:
    """The replica (of ``replicas``' unique ids, not empty) that ``session``'s calls go to."""
    return max(replicas, key=lambda r: affinity(session, r))


class SessionRouter(LocalityMixin, RequestRouter):
    """Serve's request router for the engine deployments (module docstring)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        session = pending_request.metadata.session_id if pending_request is not None else ""
        if not session or not candidate_replicas:
            return self._two_choices(pending_request)
        # the loop sleeps between rounds where every rank was full, as it does for Serve's default
        pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        first = by_id.pop(home(session, list(by_id)))
        others = list(by_id.values())
        return [[first], random.sample(others, min(2, len(others)))] if others else [[first]]

    def _two_choices(self, pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        """Serve's default choice: two random replicas (those on this node first, when the handle
        prefers local routing), of which Serve takes the one with the shorter queue."""
        replicas = self.curr_replicas
        ids = [i for i in self.apply_locality_routing(pending_request) if i in replicas]
        return [[replicas[i] for i in random.sample(ids, min(2, len(ids)))]] if ids else []

"""The Serve application builder that one rollout YAML points at:

    applications:
      - name: rayapp
        import_path: rayapp.actors.app:build_app
        args: {engines: ..., evaluators: ..., pool: ..., scheduler: ..., data: ..., eval: ...}

``serve run rayapp.actors.app:build_app recipe=recipes/local/rollout.yaml`` runs the same recipe with
the builder in the ``serve run`` process itself: a broken recipe then ends ``serve run`` at once (exit
1, the error naming the file), where with a config file Serve marks the application DEPLOY_FAILED and
``serve run`` keeps waiting.

It wires the three parts of the design: one inference deployment per engine (student, teacher,
...), the PlacementPoolService (one replica hosting the core PlacementPool and owning the placement
groups), and the SchedulerRolloutManager (the ingress, hosting the TaskScheduler). The whole recipe is validated
before anything is deployed, so a bad one fails the build and no replica starts.
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve
from ray.serve import Application

from rayapp.actors.engine import InferenceEngine
from rayapp.actors.manager import SchedulerRolloutManager
from rayapp.actors.pool_service import PlacementPoolService
from rayapp.connection import MANAGER
from rayapp.recipe import ARGS_SOURCE, check_live_gpus, load_recipe, parse_recipe
from rayapp.recipe.config import EngineConfig

# Waiting acquires are long-lived requests: the pool must take many at once.
POOL_MAX_ONGOING = 100_000
# Serve's controller notices a dead replica at its next health check (10 s by default): the pool and
# the manager are single replicas every step needs, so they are checked every 2 s.
CONTROL_HEALTH_CHECK_S = 2.0
# The pool and the manager live on the head node: losing a worker node must not take the ledger along.
HEAD = "node:__internal_head__"
# An episode's turns go to one engine replica, which keeps its conversation's KV cache (SGLang's radix
# cache; the hf engine's prefix cache): Serve's own consistent-hash router over the call's session id
# (``EngineClient`` sends the episode's as Serve's ``session_id`` option). A session's replica is a
# pure function of the session and the live replicas, the same in every process holding a handle;
# sessions spread over replicas by hashing; a replica that joins or leaves moves only its share; a
# saturated or dead home sends the call to the next replicas on the ring (2 of them), and a call
# without a session (info, health) hashes its own request id: spread evenly.
STICKY_ROUTER = {
    "request_router_class": "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
    "request_router_kwargs": {"num_virtual_nodes": 100, "num_fallback_replicas": 2},
}


def engine_app(name: str, e: EngineConfig, checkpoint_dir: str | None = None) -> Application:
    """The inference deployment of engine ``name`` (``engine-<name>``), as the recipe sets it, its
    calls routed by session (``STICKY_ROUTER``)."""
    options: dict[str, Any] = {
        "name": f"engine-{name}", "num_replicas": e.num_replicas,
        "max_ongoing_requests": e.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": e.num_cpus, "num_gpus": e.num_gpus},
        "request_router_config": STICKY_ROUTER,
    }
    if e.placement_group_bundles:  # a multi-GPU engine reserves its GPUs as one group
        options |= {"placement_group_bundles": e.placement_group_bundles,
                    "placement_group_strategy": e.placement_group_strategy}
    return serve.deployment(InferenceEngine, **options).bind(
        e.backend, weight_roots=e.weight_roots, checkpoint_dir=checkpoint_dir, **e.options)


def build_app(args: dict[str, Any]) -> Application:
    """The application of a recipe: a Serve config's ``args``, or ``{"recipe": <file>}`` (the
    import-path form of ``serve run``)."""
    if set(args) == {"recipe"}:
        source = args["recipe"]
        args, cfg = load_recipe(source)
    else:
        source, cfg = ARGS_SOURCE, parse_recipe(args)
    check_live_gpus(cfg, ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else None, source)
    engines = {name: engine_app(name, e, cfg.scheduler.checkpoint_dir) for name, e in cfg.engines.items()}
    pool = None
    if cfg.pool.gate:
        p = cfg.pool
        pool = serve.deployment(PlacementPoolService, name="PlacementPoolService", num_replicas=1,
                                max_ongoing_requests=POOL_MAX_ONGOING, health_check_period_s=CONTROL_HEALTH_CHECK_S,
                                ray_actor_options={"num_cpus": 0, "resources": {HEAD: 0.001}}).bind(
            p.cluster_layout, p.num_cpus, p.memory_gb, p.pg_ready_timeout_s)
    manager = serve.deployment(SchedulerRolloutManager, name=MANAGER, num_replicas=1,
                               max_ongoing_requests=1_000, health_check_period_s=CONTROL_HEALTH_CHECK_S,
                               ray_actor_options={"num_cpus": 0, "resources": {HEAD: 0.001}})
    return manager.bind(args, engines, pool)

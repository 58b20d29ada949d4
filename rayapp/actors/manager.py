"""The SchedulerRolloutManager: the Serve ingress hosting the TaskScheduler (spec §1).

The trainer calls ``generate(rollout_id)`` / ``evaluate(rollout_id)`` through a handle; the same
replica answers a small HTTP control surface under the app's route. This file only translates:
the recipe is parsed and wired by ``rayapp.recipe``, and each step runs through the pure
``StepRunner`` (``rayapp.training.step``: one step at a time, its order and artifacts); here the
Ray handles become clients with bounded calls, and results become HTTP answers.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, HTTPException, Path
from ray import serve

from rayapp.actors.engine import EngineClient
from rayapp.actors.pool import run_in_bundle
from rayapp.actors.pool_client import PoolClient
from rayapp.actors.sandbox import open_sandbox
from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.recipe import apply_env, build_step_runner, parse_recipe
from rayapp.training.step_results import MAX_STEP_ID

# A step id in the path: out of range is a 422 before anything runs (the handle's ValueError, over HTTP).
# A default, not an Annotated type: Serve ships the endpoints to the replica by value, where a name
# that only a (string) annotation refers to is not defined.
STEP_ID = Path(ge=0, le=MAX_STEP_ID, description="the rollout or eval step's id")

api = FastAPI(title="rayapp rollout manager")


@serve.ingress(api)
class SchedulerRolloutManager:
    def __init__(self, recipe: dict[str, Any], engines: dict[str, Any], pool: Any | None = None,
                 owner: str = "rayapp-manager"):
        self.cfg = apply_env(parse_recipe(recipe), os.environ)
        self.pool_client = PoolClient(pool, owner, packed=True) if pool is not None else None
        self.engines = {name: EngineClient(h, name, self.cfg.engines[name].request_timeout_s)
                        for name, h in engines.items()}
        # A replica that replaced a crashed one first frees what its predecessor still held.
        release = self.pool_client.release_owner if self.pool_client is not None else None
        self.steps = build_step_runner(self.cfg, self.engines, self.pool_client, executor=run_in_bundle,
                                       open_sandbox=open_sandbox, release_previous=release)

    async def generate(self, rollout_id: int) -> RolloutResult:
        """Rollout step ``rollout_id``: run once; a repeated or concurrent call gets the same result
        (``rayapp.training.step_results``)."""
        return await self.steps.rollout(rollout_id)

    async def evaluate(self, rollout_id: int) -> EvalResult:
        return await self.steps.evaluate(rollout_id)

    async def update_weights_from_disk(self, engine: str, path: str) -> list[dict]:
        """The trainer's new weights, loaded by every replica of one engine (between steps)."""
        if engine not in self.engines:
            raise ValueError(f"unknown engine {engine!r}; this app has {sorted(self.engines)}")
        async with self.steps.between_steps():
            return await self.engines[engine].update_weights_from_disk(path)

    @api.get("/status")
    def status(self) -> dict[str, Any]:
        return self.steps.status()

    @api.get("/placement")
    async def placement(self) -> dict[str, Any]:
        if self.pool_client is None:
            return {"gated": False, "batches": {}}
        return {"gated": True, **await self.pool_client.placement()}

    @api.get("/healthz")
    def healthz(self) -> dict[str, bool]:
        return {"ok": True}

    @api.post("/rollout/{rollout_id}")
    async def http_rollout(self, rollout_id: int = STEP_ID) -> dict[str, Any]:
        result = await self.generate(rollout_id)
        samples = [s for g in result.groups for s in g]
        return {"rollout_id": rollout_id, "samples": len(samples), "metrics": result.metrics,
                "mean_score": sum(s.reward.get("score", 0.0) for s in samples) / max(1, len(samples))}

    @api.post("/eval/{rollout_id}")
    async def http_eval(self, rollout_id: int = STEP_ID) -> dict[str, Any]:
        if not self.cfg.eval:
            raise HTTPException(404, "this recipe has no eval datasets")
        result = await self.evaluate(rollout_id)
        return {"rollout_id": rollout_id, "metrics": result.metrics}

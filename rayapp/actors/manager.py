"""The SchedulerRolloutManager: the Serve ingress hosting the TaskScheduler (spec §1).

The trainer calls ``generate(rollout_id)`` / ``evaluate(rollout_id)`` through a handle; the same
replica answers a small HTTP control surface under the app's route. One step runs at a time (a
second call waits its turn), and every call into the pool crosses a process boundary with a bound.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from typing import Any

import msgspec
import ray
from fastapi import FastAPI, HTTPException
from ray import serve

from rayapp.actors.engine import EngineClient
from rayapp.actors.pool import run_in_bundle
from rayapp.actors.recipe import FiltersConfig, RecipeConfig, apply_env, parse_recipe
from rayapp.actors.sandbox import open_sandbox
from rayapp.core.batching import load_strategy
from rayapp.core.scheduler import EvalResult, RolloutResult, SchedulerConfig, TaskScheduler
from rayapp.envs.datasets.source import MultiDataSource, eval_tasks
from rayapp.envs.registry import AgentDeps, get_env, make_dataset
from rayapp.envs.sandboxes import limits_from_resource
from rayapp.training.artifacts import EvalDetailsWriter
from rayapp.training.checkpoint import ResumableRollouts, RolloutCheckpoint
from rayapp.training.dagger import DAggerIterations, roll_in_metrics
from rayapp.training.filters import apply_filters
from rayapp.training.reuse import rollout_or_reuse
from rayapp.types import EvaluatorSpec, Resource, Sample, Token

log = logging.getLogger(__name__)
api = FastAPI(title="rayapp rollout manager")


class PoolClient:
    """The core's Pool protocol over the PlacementPool deployment's handle."""

    def __init__(self, handle: Any, owner: str, call_timeout_s: float = 60.0, retry_s: float = 1.0):
        self.handle, self.owner, self.call_timeout_s, self.retry_s = handle, owner, call_timeout_s, retry_s

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        response = getattr(self.handle, method).remote(*args, **kwargs)
        try:
            return await asyncio.wait_for(_await(response), timeout_s or self.call_timeout_s)
        except BaseException:
            # The pool must not grant a batch nobody waits for. A Serve response cancels itself;
            # a plain actor call (tests, notebooks) is an ObjectRef.
            response.cancel() if hasattr(response, "cancel") else ray.cancel(response)
            raise

    async def acquire_batch(self, budget: Resource, per_sample: Resource, max_tokens: int, *,
                            timeout: float | None = None, label: str = "batch") -> list[Token]:
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            tokens = await self._call("acquire_batch", budget, per_sample, max_tokens, timeout=left, label=label,
                                      owner=self.owner,
                                      timeout_s=(left or 86400.0) + self.call_timeout_s)
            if tokens is not None:
                return tokens
            # Ray could not make the group ready (its view differs from the ledger's): try again soon.
            if deadline is not None and loop.time() + self.retry_s > deadline:
                raise TimeoutError(f"acquire_batch {label}: Ray could not place the batch within {timeout}s")
            await asyncio.sleep(self.retry_s)

    async def release_batch(self, tokens: list[Token]) -> None:
        await self._call("release_batch", tokens)

    async def max_tokens_for(self, per_sample: Resource) -> int:
        return await self._call("max_tokens_for", per_sample)

    async def release_owner(self) -> int:
        return await self._call("release_owner", self.owner)

    async def placement(self) -> dict[str, Any]:
        return await self._call("placement")


async def _await(response: Any) -> Any:
    return await response


def build_data_source(cfg: RecipeConfig) -> MultiDataSource:
    """The rollout datasets in name order: Serve hands a config's args over with their keys sorted,
    so any other order would make the stream depend on how the recipe reached the process."""
    return MultiDataSource([make_dataset(d, name) for name, d in sorted(cfg.data.items())], seed=cfg.scheduler.seed)


def build_scheduler(cfg: RecipeConfig, engines: dict[str, EngineClient], pool: PoolClient | None) -> TaskScheduler:
    specs = []
    for ev in cfg.evaluators:
        sb = ev.sandbox
        limits = limits_from_resource(ev.run_resource, wall_seconds=sb.wall_seconds, cpu_seconds=sb.cpu_seconds,
                                      network=sb.network)
        image = {"image": sb.image} if sb.image else {}
        opener = functools.partial(open_sandbox, kind=sb.kind, limits=limits, **image)
        env = get_env(ev.env)
        deps = AgentDeps(engines[ev.engine], run_in_bundle, opener,
                         teacher=engines[ev.teacher] if ev.teacher else None)
        agent = (env.make_dagger_agent if ev.teacher else env.make_agent)(deps)
        specs.append(EvaluatorSpec(ev.evaluator_id, agent, ev.resource, ev.run_resource, ev.eval_resource,
                                   ev.batch_size, ev.default_stopping, ev.default_sampling, ev.eval_timeout_s))
    s = cfg.scheduler
    eval_sets = {name: eval_tasks(make_dataset(d, name), d.n_prompts) for name, d in sorted(cfg.eval.items())}
    config = SchedulerConfig(rollout_batch_size=s.rollout_batch_size,
                             n_samples_per_eval_prompt=s.n_samples_per_eval_prompt,
                             global_stopping=s.global_stopping, global_sampling=s.global_sampling,
                             acquire_timeout_s=s.acquire_timeout_s, progress=s.progress)
    return TaskScheduler(specs, build_data_source(cfg), pool, config, batching_strategy=load_strategy(s.batching),
                         eval_datasets=eval_sets, iteration=DAggerIterations(cfg.dagger) if cfg.dagger else None)


def filter_step(result: RolloutResult, cfg: FiltersConfig) -> RolloutResult:
    """Apply the recipe's survivorship filters to a rollout step: the trainer gets the surviving
    groups; every drop is counted by filter and reason in the step's metrics."""
    filters = [f for f in (cfg.rejection, cfg.finish_only) if f is not None]
    if not filters and cfg.abort_cap is None:
        return result
    report = apply_filters(result.groups, filters, abort_cap=cfg.abort_cap, rollout_id=result.rollout_id)
    metrics = dict(result.metrics)
    for kind, counts in (("dropped", report.dropped), ("dropped_groups", report.dropped_groups)):
        for name, reasons in counts.items():
            metrics |= {f"filter/{name}/{kind}/{reason}": float(n) for reason, n in reasons.items()}
    metrics |= {"filter/input_groups": float(len(result.groups)),
                "filter/input_samples": float(sum(len(g) for g in result.groups)),
                "filter/kept_groups": float(len(report.groups)), "filter/kept_samples": float(report.kept_samples),
                "filter/abort_share": float(report.abort_share),
                "filter/abort_share_exceeded": float(report.abort_share_exceeded)}
    return msgspec.structs.replace(result, groups=report.groups, metrics=metrics)


@serve.ingress(api)
class SchedulerRolloutManager:
    def __init__(self, recipe: dict[str, Any], engines: dict[str, Any], pool: Any | None = None,
                 owner: str = "rayapp-manager"):
        self.cfg = apply_env(parse_recipe(recipe), os.environ)
        self.pool_client = PoolClient(pool, owner) if pool is not None else None
        self.engines = {name: EngineClient(h, name, self.cfg.engines[name].request_timeout_s)
                        for name, h in engines.items()}
        folder = self.cfg.scheduler.checkpoint_dir
        self.checkpoint = RolloutCheckpoint(folder) if folder else None
        self.scheduler = build_scheduler(self.cfg, self.engines, self.pool_client)
        self.rollouts = ResumableRollouts(self.scheduler, self.checkpoint) if self.checkpoint else self.scheduler
        details = self.cfg.scheduler.save_eval_details
        self.details = EvalDetailsWriter(details) if details else None
        self._step = asyncio.Lock()
        self._fresh = True

    async def _begin(self) -> None:
        if self._fresh and self.pool_client is not None:
            # A replica that replaced a crashed one frees what its predecessor still held.
            freed = await self.pool_client.release_owner()
            if freed:
                log.warning("freed %d batches left by a previous manager replica", freed)
        self._fresh = False

    async def generate(self, rollout_id: int) -> RolloutResult:
        async with self._step:
            await self._begin()
            result = await self._rollout(rollout_id)
            result.metrics.update(roll_in_metrics(result.groups))  # before the filters: every roll-in counts
            result = filter_step(result, self.cfg.filters)
            artifacts = dict(result.artifacts)
            folder = self.checkpoint.folder(rollout_id) if self.checkpoint is not None else None
            if folder is not None and folder.exists():  # not when the step was reused
                artifacts["checkpoint"] = str(folder)
            if self.details is not None:
                path = await asyncio.to_thread(self.details.write_rollout_summary, rollout_id, result)
                artifacts["train_summary"] = str(path)
            return msgspec.structs.replace(result, artifacts=artifacts)

    async def _rollout(self, rollout_id: int) -> RolloutResult:
        """A fresh rollout, or the saved one the reuse policy (spec §5) points at."""
        folder = self.cfg.scheduler.trajectory_dir
        if folder is None:
            return await self.rollouts.execute_rollout(rollout_id)
        ran: list[RolloutResult] = []

        async def run() -> list[list[Sample]]:
            ran.append(await self.rollouts.execute_rollout(rollout_id))
            return ran[0].groups

        groups, decision = await rollout_or_reuse(rollout_id, folder, run)
        if ran:
            saved = {"trajectory_iter" if "_iter_" in p.name else "trajectory": str(p) for p in decision.save_paths}
            return msgspec.structs.replace(ran[0], artifacts=saved)
        log.info("rollout %d reuses %s (%s)", rollout_id, decision.load_path, decision.mode)
        return RolloutResult(rollout_id, groups, {"rollout/reused": 1.0}, artifacts={"reused": str(decision.load_path)})

    async def evaluate(self, rollout_id: int) -> EvalResult:
        async with self._step:
            await self._begin()
            if self.details is None:
                return await self.scheduler.execute_eval(rollout_id)
            # samples stream into eval_details/{id}.jsonl as they finish; the complete files and
            # the summary replace them at the end
            result = await self.scheduler.execute_eval(rollout_id, self.details.on_task_done(rollout_id))
            paths = await asyncio.to_thread(self.details.write_eval, rollout_id, result)
            return msgspec.structs.replace(result, artifacts={k: str(p) for k, p in paths.items()})

    async def update_weights_from_disk(self, engine: str, path: str) -> list[dict]:
        """The trainer's new weights, loaded by every replica of one engine (between steps)."""
        if engine not in self.engines:
            raise ValueError(f"unknown engine {engine!r}; this app has {sorted(self.engines)}")
        async with self._step:
            return await self.engines[engine].update_weights_from_disk(path)

    @api.get("/status")
    def status(self) -> dict[str, Any]:
        return {**self.scheduler.status().as_dict(), "busy": self._step.locked()}

    @api.get("/placement")
    async def placement(self) -> dict[str, Any]:
        if self.pool_client is None:
            return {"gated": False, "batches": {}}
        return {"gated": True, **await self.pool_client.placement()}

    @api.get("/healthz")
    def healthz(self) -> dict[str, bool]:
        return {"ok": True}

    @api.post("/rollout/{rollout_id}")
    async def http_rollout(self, rollout_id: int) -> dict[str, Any]:
        result = await self.generate(rollout_id)
        samples = [s for g in result.groups for s in g]
        return {"rollout_id": rollout_id, "samples": len(samples), "metrics": result.metrics,
                "mean_score": sum(s.reward.get("score", 0.0) for s in samples) / max(1, len(samples))}

    @api.post("/eval/{rollout_id}")
    async def http_eval(self, rollout_id: int) -> dict[str, Any]:
        if not self.cfg.eval:
            raise HTTPException(404, "this recipe has no eval datasets")
        result = await self.evaluate(rollout_id)
        return {"rollout_id": rollout_id, "metrics": result.metrics}

"""The SchedulerRolloutManager: the Serve ingress hosting the TaskScheduler (docs/scheduler.md §1).

The trainer calls ``generate(rollout_id[, tasks])`` / ``evaluate(rollout_id)`` through a handle; the same
replica answers a small HTTP control surface under the app's route. This file only translates:
the recipe is parsed and wired by ``rayapp.recipe``, and each step runs through the pure
``StepRunner`` (``rayapp.steps.runner``: one step at a time, its order and artifacts); here the
Ray handles become clients with bounded calls, and results become HTTP answers. It also serves the
agent gateway's routes (``/gateway/<episode>/v1/...``, ``rayapp.gateway``): an agent written against
the OpenAI API reaches its episode here, in the replica that records it.

No ``from __future__ import annotations`` here: Serve ships the endpoints to the replica by value,
where FastAPI must see ``Request`` itself, not a string naming it.
"""

import asyncio
import os
from typing import Any

import ray
from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse
from ray import serve

from rayapp.actors.engine import EngineClient
from rayapp.actors.gateway_ingress import GatewayRoutes
from rayapp.actors.gateway_ingress import router as gateway_router
from rayapp.actors.heap import trim_soon
from rayapp.actors.http_auth import HttpGuard, load_token, ray_cluster_token
from rayapp.actors.http_errors import (
    ERRORS,
    error_response,
    exception_response,
    gateway_base_url,
    parse_step_id,
    summary,
)
from rayapp.actors.logs import follow_serve_logging
from rayapp.actors.pool_client import PoolClient
from rayapp.actors.prometheus import RayappMetrics, poll
from rayapp.actors.sandbox import open_sandbox
from rayapp.actors.work_hosts import WorkHosts
from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.gateway.service import Gateway
from rayapp.inference.weight_sync import WeightSync
from rayapp.recipe import apply_env, build_step_runner, parse_recipe
from rayapp.steps.jobs import StepConflict, StepJobs
from rayapp.types import StepKind

# A step id in the path, read as text: FastAPI's int would take "+5", " 1" and "1.0" (parse_step_id
# answers 422 for anything but the canonical spelling, before anything runs). A default, not an
# Annotated type: Serve ships the endpoints to the replica by value, where a name that only a
# (string) annotation refers to is not defined.
STEP_ID = Path(description="the rollout or eval step's id: a decimal integer in 0 .. 2**31-1",
               examples=["0", "7"])
# Serve's controller, asked where the HTTP proxy listens (its actor name and namespace are Serve's).
SERVE_CONTROLLER = ("SERVE_CONTROLLER_ACTOR", "serve")
CONTROLLER_TIMEOUT_S = 30.0

api = FastAPI(title="rayapp rollout manager")
api.include_router(gateway_router)


# Registered before the class: @serve.ingress takes the app (and the names the class uses) as they are then.
# The endpoints answer their own errors; this is the net for anything else.
@api.exception_handler(Exception)
async def _unhandled(request: Request, error: Exception) -> JSONResponse:
    return exception_response(error)


@serve.ingress(api)
class SchedulerRolloutManager(GatewayRoutes):
    def __init__(self, recipe: dict[str, Any], engines: dict[str, Any], pool: Any | None = None,
                 owner: str = "rayapp-manager"):
        follow_serve_logging()
        self.cfg = apply_env(parse_recipe(recipe), os.environ)
        self.metrics = RayappMetrics()
        self.metrics.zero({StepKind.ROLLOUT: self.cfg.data, StepKind.EVAL: self.cfg.eval}, engines,
                          EngineClient.METHODS)
        self.pool_client = PoolClient(pool, owner) if pool is not None else None
        self.engines = {name: EngineClient(h, name, self.cfg.engines[name].request_timeout_s,
                                           observe=self.metrics.engine_call)
                        for name, h in engines.items()}
        # A replica that replaced a crashed one first frees what its predecessor still held.
        release = self.pool_client.release_owner if self.pool_client is not None else None
        # The agent gateway lives here, beside the evaluators whose episodes it records (docs/agents.md);
        # where agents reach it (Serve's proxy, this app's prefix) is asked before the first step.
        self.gateway = Gateway("http://gateway-url-not-asked-yet")
        self._gateway_pointed = all(ev.gateway is None for ev in self.cfg.evaluators)
        executor = WorkHosts().run  # a sample's function calls run on warm hosts in its bundle
        self.steps = build_step_runner(self.cfg, self.engines, self.pool_client, executor=executor,
                                       open_sandbox=open_sandbox, release_previous=release, gateway=self.gateway)
        self.steps.observers.append(self.metrics)
        self.weights = WeightSync(self.engines)  # what every replica must serve (a replacement too)
        for client in self.engines.values():
            client.weights = self.weights
        self.jobs = StepJobs()
        self._gauges: asyncio.Task | None = None
        # A configured token that cannot be used stops the replica here, naming the variable.
        self.http_guard = HttpGuard(load_token(os.environ), ray_cluster_token(os.environ))
        self._proxy_host: str | None = None

    def _watch(self) -> None:
        """Start refreshing the gauges (in the replica's loop, which the constructor may not run in)."""
        if self._gauges is None or self._gauges.done():
            placement = self.pool_client.placement if self.pool_client is not None else None
            self._gauges = asyncio.ensure_future(poll(self.metrics, self.steps.status, placement))

    async def generate(self, rollout_id: int, tasks: list[Any] | None = None) -> RolloutResult:
        """Rollout step ``rollout_id``: run once; a repeated or concurrent call gets the same result
        (``rayapp.steps.results``). ``tasks`` (Tasks, or dicts of a Task's fields): the
        trainer's, run as the step's groups instead of the data source's (``StepRunner.rollout``)."""
        self._watch()
        try:
            await self._restore_weights()
            await self._point_gateway()
            return await self.steps.rollout(rollout_id, tasks)
        finally:
            trim_soon()  # what the step freed, back to the OS (rayapp.actors.heap)

    async def evaluate(self, rollout_id: int) -> EvalResult:
        self._watch()
        try:
            await self._restore_weights()
            await self._point_gateway()
            return await self.steps.evaluate(rollout_id)
        finally:
            trim_soon()

    async def _restore_weights(self) -> None:
        """Every replica on the weights applied last, before a step (a replacement comes back on them)."""
        async with self.steps.between_steps():
            await self.weights.restore()

    async def _point_gateway(self) -> None:
        """The gateway's base URL, for a recipe with a gateway agent: asked of Serve's controller once
        (where its proxy listens, this app's route prefix), before the first step."""
        async def ask() -> str:
            controller = await asyncio.to_thread(ray.get_actor, *SERVE_CONTROLLER)
            http = await controller.get_http_config.remote()
            apps = (await controller.get_serve_instance_details.remote()).get("applications", {})
            return gateway_base_url(http.host, http.port, apps.get(app, {}).get("route_prefix"))

        if not self._gateway_pointed:
            app = serve.get_replica_context().app_name
            self.gateway.base_url = await asyncio.wait_for(ask(), CONTROLLER_TIMEOUT_S)
            self._gateway_pointed = True

    async def update_weights_from_disk(self, engine: str, path: str) -> list[dict]:
        """The trainer's new weights, loaded by every replica of one engine (between steps)."""
        if not isinstance(path, str) or not path:
            raise ValueError(f"update_weights_from_disk: path must be a non-empty str, got {path!r}")
        if engine not in self.engines:
            raise ValueError(f"unknown engine {engine!r}; this app has {sorted(self.engines)}")
        async with self.steps.between_steps():
            return await self.weights.update(engine, path)

    async def _where_proxy_listens(self) -> str | None:
        """The host of Serve's HTTP proxy (``http_options.host``), asked once; None while unknown."""
        async def ask() -> str:
            controller = await asyncio.to_thread(ray.get_actor, *SERVE_CONTROLLER)
            return (await controller.get_http_config.remote()).host

        if self._proxy_host is None and not self.http_guard.has_token:
            self._proxy_host = await asyncio.wait_for(ask(), CONTROLLER_TIMEOUT_S)
        return self._proxy_host

    async def _refusal(self, request: Request) -> JSONResponse | None:
        """The answer refusing this request (a missing or wrong token: docs/security.md), or None."""
        if not isinstance(request, Request):  # an HTTP route called through a handle
            raise ValueError(f"this is an HTTP route, called with {type(request).__name__} for its request: "
                             "through a handle call generate(rollout_id) or evaluate(rollout_id)")
        try:
            host = await self._where_proxy_listens()
        except Exception as e:  # unknown: refused as if not loopback, saying why
            host = f"an unknown host ({type(e).__name__}: {e})"
        return self.http_guard.refusal(request.headers.get("authorization"), host)

    def status(self) -> dict[str, Any]:
        """The step in flight and the steps run, and whether Serve can route to each engine (a step
        waits for one that it cannot): through a handle; over HTTP, GET /status."""
        return {**self.steps.status(), "engines": {name: c.state() for name, c in self.engines.items()}}

    async def placement(self) -> Any:
        """Which node and GPU each held token sits on (through a handle; over HTTP, GET /placement)."""
        if self.pool_client is None:
            return {"gated": False, "batches": {}}
        try:
            return {"gated": True, **await self.pool_client.placement()}
        except Exception as e:  # the pool lost or slow: a 503 that says so, not a bare 500
            return exception_response(e)

    @api.get("/status", responses=ERRORS)
    async def http_status(self, request: Request) -> Any:
        if (refused := await self._refusal(request)) is not None:
            return refused
        return self.status()

    @api.get("/placement", responses=ERRORS)
    async def http_placement(self, request: Request) -> Any:
        if (refused := await self._refusal(request)) is not None:
            return refused
        return await self.placement()

    @api.get("/healthz")
    def healthz(self) -> dict[str, bool]:
        """Open to all (probes carry no token); it says nothing but that the replica answers."""
        return {"ok": True}

    @api.post("/rollout/{rollout_id}", status_code=202, responses=ERRORS)
    async def http_rollout(self, request: Request, rollout_id: str = STEP_ID) -> JSONResponse:
        """Start rollout step ``rollout_id`` (or join it); poll this URL with GET for its summary."""
        return await self._start(StepKind.ROLLOUT, rollout_id, request, self.generate)

    @api.get("/rollout/{rollout_id}", responses=ERRORS)
    async def http_rollout_status(self, request: Request, rollout_id: str = STEP_ID) -> JSONResponse:
        """Rollout step ``rollout_id``: running (with the step's progress), done (its summary) or its error."""
        return await self._poll(StepKind.ROLLOUT, rollout_id, request)

    @api.post("/eval/{rollout_id}", status_code=202, responses=ERRORS)
    async def http_eval(self, request: Request, rollout_id: str = STEP_ID) -> JSONResponse:
        """Start eval step ``rollout_id`` (or join it); poll this URL with GET for its metrics."""
        return await self._start(StepKind.EVAL, rollout_id, request, self.evaluate)

    @api.get("/eval/{rollout_id}", responses=ERRORS)
    async def http_eval_status(self, request: Request, rollout_id: str = STEP_ID) -> JSONResponse:
        """Eval step ``rollout_id``: running, done (its metrics) or its error."""
        return await self._poll(StepKind.EVAL, rollout_id, request)

    async def _start(self, kind: StepKind, raw_id: str, request: Request, run: Any) -> JSONResponse:
        if (refused := await self._refusal(request)) is not None:
            return refused
        try:
            rollout_id = parse_step_id(raw_id)
        except ValueError as e:
            return exception_response(e)
        if kind is StepKind.EVAL and not self.cfg.eval:
            return error_response(404, "NotFound", "this recipe has no eval datasets")
        try:
            job = self.jobs.start(kind, rollout_id, lambda: run(rollout_id))
        except StepConflict as e:
            return error_response(409, "Conflict", str(e))
        url = str(request.url)
        return JSONResponse({"kind": kind.value, "rollout_id": rollout_id, "state": job.state, "poll": url},
                            status_code=202, headers={"Location": url})

    async def _poll(self, kind: StepKind, raw_id: str, request: Request) -> JSONResponse:
        if (refused := await self._refusal(request)) is not None:
            return refused
        try:
            rollout_id = parse_step_id(raw_id)
        except ValueError as e:
            return exception_response(e)
        job = self.jobs.get(kind, rollout_id)
        if job is None:
            return error_response(404, "NotFound", f"no {kind} {rollout_id} was asked for here: POST it first")
        if job.state == "running":
            return JSONResponse({"kind": kind.value, "rollout_id": rollout_id, "state": "running",
                                 "progress": self.steps.status()})
        if job.state == "cancelled":
            return error_response(503, "Cancelled", f"{kind} {rollout_id} was cancelled: POST it again")
        if job.error is not None:
            return exception_response(job.error)
        return JSONResponse({"kind": kind.value, "rollout_id": rollout_id, "state": "done", **summary(job.result)})

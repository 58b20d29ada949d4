"""Inference deployments: one Serve deployment per engine (student, teacher, ...), and the client
agents use to call one.

A replica hosts one backend (``hf`` on CPU, ``sglang`` on GPUs). The client gives every call a
timeout, cancels a request it stops waiting for (Serve routes the cancellation to the replica
that runs it), and turns transport failures into ``EngineConnectionError`` so an episode that
loses its engine aborts as ``infra_conn``. Aborts and weight updates are broadcast to every
replica, not sent through the router to one of them. A generation that names a session goes out
with Serve's ``session_id`` option, which the deployment's router (``rayapp.actors.app.STICKY_ROUTER``)
keeps on one replica; each output names the replica that made it (``hf@engine-student#<replica>``), so
an episode's turn records say where every turn ran.

A weight update is checked here, for every backend, before the backend sees the path: it must lie
inside the engine's ``weight_roots`` and name only regular files (``rayapp.inference.weight_paths``).
Each replica remembers the path and version it last loaded; asked for them again it loads nothing,
so the manager can send its record to every replica before each step and only a replacement loads
(``rayapp.inference.weight_sync``). A model turn on other weights than that record makes the client
restore the engine and ask once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgspec
from ray import serve
from ray.serve import context as serve_context
from ray.serve.exceptions import DeploymentUnavailableError, RayServeException
from ray.serve.handle import DeploymentHandle

from rayapp.actors.remote import bounded, is_lost
from rayapp.connection import UNAVAILABLE_PAUSES_S, next_pause
from rayapp.core.termination import AgentTimeout, EngineConnectionError
from rayapp.inference.backends import make_backend
from rayapp.inference.client import GenerateOutput, GenerateRequest
from rayapp.inference.tiny_model import default_cache_dir
from rayapp.inference.tokenizer_files import cache_tokenizer_files, read_tokenizer_files
from rayapp.inference.weight_paths import checkpoint_files, default_weight_roots
from rayapp.inference.weight_sync import Applied, StaleWeights, WeightSync
from rayapp.record import WeightVersion

log = logging.getLogger(__name__)


@contextlib.contextmanager
def own_request_id() -> Iterator[None]:
    """Handle calls made inside, from a replica's request, each get a request id of their own for
    Serve's router. By default a call inherits the internal id of the request the replica is
    serving, so the manager's step (one request) fans out hundreds of engine calls under one id; a
    router that hands each replica to the request of that id (every router without Serve's FIFO
    hand-over: the consistent-hash router the engines use) then answers one of them and leaves the
    others waiting for ever (Ray 2.60; measured: 1 of 32 concurrent calls came back). The log's
    request id is kept."""
    current = serve_context._serve_request_context.get()
    if current is None or not current._internal_request_id:
        yield
        return
    token = serve_context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=""))
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


class InferenceEngine:
    """A Serve deployment class: ``serve.deployment(InferenceEngine)`` in the app builder."""

    def __init__(self, backend: str = "hf", weight_roots: list[str] | None = None, checkpoint_dir: str | None = None,
                 **backend_kwargs: Any):
        self.kind = backend
        self.backend = make_backend(backend, **backend_kwargs)
        self.weight_roots = list(weight_roots) if weight_roots is not None else default_weight_roots(
            self.backend.info().get("model_path"), checkpoint_dir)
        self._applied: Applied | None = None  # what this replica last loaded
        self._loading = asyncio.Lock()
        self.replica = _replica_name()

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        out = await self.backend.generate(req)
        return msgspec.structs.replace(out, engine=f"{out.engine}@{self.replica}") if self.replica else out

    async def abort(self, request_id: str | None = None) -> int:
        return await self.backend.abort(request_id)

    async def health(self) -> dict:
        return await self.backend.health()

    async def check_health(self) -> None:
        """Serve's liveness probe: an unhealthy engine replica is replaced."""
        status = await self.backend.health()
        if not status.get("ok", False):
            raise RuntimeError(f"{self.kind} engine unhealthy: {status}")

    async def update_weights_from_disk(self, path: str, version: WeightVersion | None = None) -> dict:
        """Load the checkpoint at ``path`` as ``version`` (None: the backend's next), unless this replica
        serves exactly that already. A path outside ``weight_roots``, or naming anything but regular
        files, raises WeightPathError before anything is read: the replica keeps its weights."""
        async with self._loading:
            if version is not None and self._applied == Applied(path, version):
                return {"ok": True, "path": path, "version": version, "loaded": False}
            await asyncio.to_thread(checkpoint_files, path, self.weight_roots)
            reply = await (self.backend.update_weights_from_disk(path) if version is None
                           else self.backend.update_weights_from_disk(path, version))
            self._applied = Applied(path, reply["version"])
            return reply

    def applied_weights(self) -> Applied | None:
        """The path and version this replica last loaded (None: the model it started from)."""
        return self._applied

    def info(self) -> dict:
        return self.backend.info()

    def tokenizer_files(self) -> dict[str, bytes]:
        """The files next to the tokenizer this replica loaded, for agents on nodes without the model."""
        return read_tokenizer_files(self.backend.info()["tokenizer_path"])

    def __del__(self) -> None:
        # Serve calls this when the replica stops: sglang's scheduler processes must go with it.
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.shutdown()


def _replica_name() -> str:
    """``<deployment>#<replica id>`` inside a Serve replica; empty elsewhere (a plain actor, a test)."""
    try:
        context = serve.get_replica_context()
    except RayServeException:
        return ""
    return f"{context.deployment}#{context.replica_id.unique_id}"


# observe(engine, method, seconds, error or None): each call's latency and outcome (metrics)
Observe = Callable[[str, str, float, BaseException | None], None]


class EngineClient:
    """What an agent holds: calls one engine deployment through its handle, every call bounded.
    While Serve has no replica of the engine to route to (its only one died and is being replaced,
    or the app is still starting: ``DeploymentUnavailableError``), a call waits for it within its
    own bound, and ``state`` (in the manager's status) says since when; a call whose bound runs
    out so is one ``EngineConnectionError`` naming the engine and that state."""

    METHODS = ("generate", "info", "tokenizer_files", "health")  # the engine calls it makes (metrics tags)

    def __init__(self, handle: Any, name: str = "engine", timeout_s: float = 300.0, observe: Observe | None = None):
        self.handle, self.name, self.timeout_s, self.observe = handle, name, timeout_s, observe
        self._info: dict | None = None
        self.weights: WeightSync | None = None  # the manager's record: turns on other weights are retried
        self.unavailable_since: float | None = None  # monotonic time Serve first had no replica to route to

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None, session: str = "") -> Any:
        bound, started, error = timeout_s or self.timeout_s, time.monotonic(), None
        handle = self.handle
        if session and isinstance(handle, DeploymentHandle):  # a plain actor handle has one replica
            handle = handle.options(session_id=session)

        async def attempt(left: float) -> Any:
            with own_request_id():
                response = getattr(handle, method).remote(*args)
            return await bounded(
                response, left, lost=self._unreachable,
                late=lambda: AgentTimeout(f"engine {self.name}.{method} gave no answer within {bound:.0f}s"))

        try:
            return await self._when_available(attempt, bound)
        except Exception as e:  # a cancellation is no error of the engine's
            error = e
            raise
        finally:
            if self.observe is not None:
                self.observe(self.name, method, time.monotonic() - started, error)

    async def _when_available(self, attempt: Callable[[float], Awaitable[Any]], bound: float) -> Any:
        """``attempt(seconds left)``, asked again while Serve has no replica to route it to, until
        ``bound`` seconds have passed; then one ``EngineConnectionError`` naming the engine's state."""
        deadline, tries = time.monotonic() + bound, 0
        while True:
            try:
                result = await attempt(deadline - time.monotonic())
            except DeploymentUnavailableError as e:
                if self.unavailable_since is None:
                    self.unavailable_since = time.monotonic()
                    log.warning("engine %s: Serve has no replica of it to route to (one is being replaced, or "
                                "the app is starting): its calls wait for it", self.name)
                pause = next_pause(tries, deadline - time.monotonic(), UNAVAILABLE_PAUSES_S)
                if pause is None:
                    raise EngineConnectionError(
                        f"engine {self.name} unavailable for {time.monotonic() - self.unavailable_since:.0f}s: "
                        f"Serve has no running replica of it to route to (its deployment is still starting, "
                        f"replacing a replica that died, or failed: see `serve status`); Serve says: {e}") from e
                tries += 1
                await asyncio.sleep(pause)
            else:
                self.unavailable_since = None
                return result

    def state(self) -> dict[str, Any]:
        """For the manager's status: whether Serve can route to this engine, and how long it could not."""
        if self.unavailable_since is None:
            return {"available": True}
        return {"available": False, "unavailable_s": round(time.monotonic() - self.unavailable_since, 1)}

    def _unreachable(self, error: BaseException) -> EngineConnectionError:
        return EngineConnectionError(f"engine {self.name} unreachable: {error}")

    async def generate(self, req: GenerateRequest, timeout_s: float | None = None) -> GenerateOutput:
        out = await self._call("generate", req, timeout_s=timeout_s, session=req.session_id)
        if self.weights is not None and self.weights.lagging(self.name, out.weight_version):
            # a replica that replaced a lost one since the step began: onto the applied weights, then again
            await self.weights.restore(self.name)
            out = await self._call("generate", req, timeout_s=timeout_s, session=req.session_id)
            if self.weights.lagging(self.name, out.weight_version):
                raise StaleWeights(f"engine {self.name} answered on weights version {out.weight_version!r}, "
                                   f"not {self.weights.applied[self.name].version} (applied last), after a restore")
        return out

    async def info(self) -> dict:
        """The engine's info, its ``tokenizer_path`` a folder on this node holding the engine's own
        tokenizer files (the engine's node may be the only one with the model)."""
        if self._info is None:
            info = await self._call("info", timeout_s=60)
            files = await self._call("tokenizer_files", timeout_s=120)
            if files:
                folder = await asyncio.to_thread(cache_tokenizer_files, files,
                                                default_cache_dir() / "tokenizers")
                info = {**info, "tokenizer_path": str(folder), "engine_tokenizer_path": info.get("tokenizer_path")}
            self._info = info
        return self._info

    async def health(self) -> dict:
        return await self._call("health", timeout_s=30)

    async def broadcast(self, method: str, *args: Any, timeout_s: float = 120.0, wait: bool = True) -> list[Any]:
        """Call ``method`` on every replica (aborts, weight updates). ``wait`` False: no replica to
        route to is no replica to call, an empty list, not a wait."""
        async def attempt(left: float) -> list[Any]:
            try:
                return await self.handle.broadcast(method, *args).results_async(timeout_s=left)
            except DeploymentUnavailableError:
                raise
            except Exception as e:
                if is_lost(e):
                    raise self._unreachable(e) from e
                raise

        if not wait:
            try:
                return await attempt(timeout_s)
            except DeploymentUnavailableError:
                return []
        return await self._when_available(attempt, timeout_s)

    async def abort(self, request_id: str | None = None) -> int:
        """Abort on every replica; with none running there is nothing to abort."""
        return sum(await self.broadcast("abort", request_id, timeout_s=30, wait=False))

    async def update_weights_from_disk(self, path: str, version: WeightVersion | None = None) -> list[dict]:
        return await self.broadcast("update_weights_from_disk", path, version, timeout_s=600)

    async def applied_weights(self) -> list[Applied | None]:
        return await self.broadcast("applied_weights", timeout_s=30)


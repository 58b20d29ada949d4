"""Sandboxes placed in the sample's placement-group bundle.

A sample's sandbox lives in a small Ray actor scheduled into the bundle its token names (its GPU's
bundle, or its node's CPU/memory bundle: see ``rayapp.actors.pool_service``), so the sandbox's processes run
on the node, and under the reservation, that the ledger granted. The host asks for nothing itself:
the token's share is asked for by the sample's function calls (``run_in_bundle``), and a sandbox that
asked too would make an agent that keeps its sandbox open while it calls one wait on itself. The
agent talks to it through ``BundleSandbox``, which has the ``Sandbox`` interface: every call is
bounded, and a lost actor or bundle (killed, its node gone, also while the host still waits to
start there: ``rayapp.actors.bundle_watch``) is a ``SandboxError`` (``infra_sandbox``). Without a
placement group (an ungated recipe, a unit test) the sandbox runs in the calling process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from ray.exceptions import ActorUnschedulableError

from rayapp.actors.bundle_watch import watched
from rayapp.actors.pool_service import bundle_strategy
from rayapp.actors.remote import bounded
from rayapp.core.termination import SandboxError
from rayapp.envs.sandboxes import DEFAULT_LIMITS, ExecResult, Sandbox, SandboxLimits, make_sandbox
from rayapp.envs.sandboxes.bridge import exec_with_gateway
from rayapp.episode import EPISODE
from rayapp.types import Token

MARGIN_S = 30.0  # on top of a command's own wall clock, for the call across processes


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=16)
class SandboxHost:
    """Hosts one sandbox inside a bundle; the token's share is its function calls' to ask for. The
    dashboard shows it by its repr: the episode it serves (``SandboxHost(rollout3/swe-2#1)``)."""

    def __init__(self, episode: str | None = None):
        self.episode = episode or "-"

    def __repr__(self) -> str:
        return f"SandboxHost({self.episode})"

    async def start(self, kind: str, limits: SandboxLimits, kw: dict[str, Any]) -> dict[str, Any]:
        self.sandbox = await make_sandbox(kind, limits, **kw)
        return {"workdir": self.sandbox.workdir, "network_isolated": self.sandbox.network_isolated,
                "node_id": ray.get_runtime_context().get_node_id()}

    async def exec(self, command: Any, timeout_s: float | None, stdin: str | None, check_timeout: bool) -> ExecResult:
        return await self.sandbox.exec(command, timeout_s=timeout_s, stdin=stdin, check_timeout=check_timeout)

    async def exec_with_gateway(self, argv: list[str], base_url: str, key: str, timeout_s: float | None,
                                check_timeout: bool) -> ExecResult:
        # The bridge's host end runs here, on the sandbox's node; its forwarder dials base_url from here.
        return await exec_with_gateway(self.sandbox, argv, base_url, key, timeout_s=timeout_s,
                                       check_timeout=check_timeout)

    async def write_file(self, path: str, content: str | bytes) -> None:
        await self.sandbox.write_file(path, content)

    async def read_file(self, path: str) -> str:
        return await self.sandbox.read_file(path)

    async def close(self) -> None:
        await self.sandbox.close()


class BundleSandbox:
    def __init__(self, actor: Any, limits: SandboxLimits, where: str, group_id: str):
        self.actor, self.limits, self.where, self.group_id = actor, limits, where, group_id
        self.workdir, self.network_isolated, self.node_id = "", False, ""

    async def _call(self, method: str, *args: Any, timeout_s: float) -> Any:
        # The host's own errors (SandboxError, AgentTimeout, ValueError) come back as themselves. A host
        # still waiting for its bundle when the node died would wait for ever: the group is watched.
        call = bounded(
            getattr(self.actor, method).remote(*args), timeout_s,
            late=lambda: SandboxError(f"sandbox in {self.where}: {method} gave no answer within {timeout_s:.0f}s"),
            lost=lambda e: SandboxError(f"sandbox in {self.where} was lost: {e}"))
        try:
            return await watched(call, self.group_id, f"sandbox in {self.where}")
        except ActorUnschedulableError as e:  # its bundle's group was removed before the host started
            raise SandboxError(f"sandbox in {self.where} could not start: {e}") from e

    async def start(self, kind: str = "local", timeout_s: float = 120.0, **kw: Any) -> BundleSandbox:
        info = await self._call("start", kind, self.limits, kw, timeout_s=timeout_s)
        self.workdir, self.network_isolated, self.node_id = info["workdir"], info["network_isolated"], info["node_id"]
        return self

    async def exec(self, command: str | list[str], *, timeout_s: float | None = None, stdin: str | None = None,
                   check_timeout: bool = False) -> ExecResult:
        bound = min(timeout_s or self.limits.wall_seconds, self.limits.wall_seconds) + MARGIN_S
        return await self._call("exec", command, timeout_s, stdin, check_timeout, timeout_s=bound)

    async def exec_with_gateway(self, argv: list[str], base_url: str, key: str, *, timeout_s: float | None = None,
                                check_timeout: bool = False) -> ExecResult:
        """``argv`` behind a gateway bridge in the bundle (rayapp.envs.sandboxes.bridge)."""
        bound = min(timeout_s or self.limits.wall_seconds, self.limits.wall_seconds) + MARGIN_S
        return await self._call("exec_with_gateway", argv, base_url, key, timeout_s, check_timeout, timeout_s=bound)

    async def write_file(self, path: str, content: str | bytes) -> None:
        await self._call("write_file", path, content, timeout_s=MARGIN_S)

    async def read_file(self, path: str) -> str:
        return await self._call("read_file", path, timeout_s=MARGIN_S)

    async def close(self) -> None:
        try:
            await self._call("close", timeout_s=MARGIN_S)
        except SandboxError:
            pass  # already gone: nothing left to clean up there
        finally:
            ray.kill(self.actor)


async def open_sandbox(token: Token | None, kind: str = "local", limits: SandboxLimits = DEFAULT_LIMITS,
                       start_timeout_s: float = 120.0, **kw: Any) -> Sandbox:
    """An open sandbox for the sample holding ``token``: in its bundle, or here when ungated."""
    if token is None or not token.placement_group:
        return await make_sandbox(kind, limits, **kw)
    where = f"bundle {token.placement_group}[{token.bundle_index}] on {token.node}"
    strategy = await asyncio.to_thread(bundle_strategy, token)  # GCS calls: off the event loop
    actor = SandboxHost.options(scheduling_strategy=strategy).remote(EPISODE.get())
    try:
        return await BundleSandbox(actor, limits, where, strategy.placement_group.id.hex()).start(
            kind, start_timeout_s, **kw)
    except BaseException:
        ray.kill(actor)
        raise

"""Sandboxes agents and verifiers act in: a local process sandbox (every node) and a Docker one
(nodes with a Docker engine), both behind the ``Sandbox`` protocol of ``base.py``.

``make_sandbox`` builds an open sandbox of either kind; ``limits_from_resource`` turns the sample's
run ``Resource`` (cpu, memory_gb) into ``SandboxLimits``, so a sandbox never gets more than the
placement pool admitted for it.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from rayapp.envs.sandboxes.base import DEFAULT_LIMITS, ExecResult, Sandbox, SandboxLimits
from rayapp.envs.sandboxes.docker import DockerSandbox, docker_available
from rayapp.envs.sandboxes.local import LocalProcessSandbox
from rayapp.types import Resource

__all__ = ["DEFAULT_LIMITS", "DockerSandbox", "ExecResult", "LocalProcessSandbox", "Sandbox", "SandboxLimits",
           "docker_available", "limits_from_resource", "make_sandbox"]

SandboxKind = Literal["local", "docker"]


def limits_from_resource(resource: Resource, **overrides: Any) -> SandboxLimits:
    """SandboxLimits whose ``cpu``/``memory_gb`` are the resource's (0 there means "not gated", so
    the backend's default), then ``overrides`` by field name (a wrong name is a TypeError)."""
    base = SandboxLimits(cpu=resource.cpu or None, memory_gb=resource.memory_gb or None)
    return msgspec.structs.replace(base, **overrides) if overrides else base


async def make_sandbox(kind: SandboxKind, limits: SandboxLimits = DEFAULT_LIMITS, **kw: Any) -> Sandbox:
    """An open (started) sandbox; the caller closes it. ``kw`` goes to the backend's constructor
    (``root``, ``name``, ``env`` for local; ``image`` (required), ``docker``, ``name``, ``env`` for docker)."""
    if kind == "local":
        sandbox: LocalProcessSandbox | DockerSandbox = LocalProcessSandbox(limits, **kw)
    elif kind == "docker":
        if "image" not in kw:
            raise ValueError("make_sandbox('docker', ...) needs image=")
        sandbox = DockerSandbox(limits=limits, **kw)
    else:
        raise ValueError(f"unknown sandbox kind {kind!r}: expected 'local' or 'docker'")
    return await sandbox.start()

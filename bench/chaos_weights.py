"""The chaos run's engine and its "engine killed after a weight update" fault (``bench/chaos.py
--faults weights``), with the count of samples made on stale weights.

The engine replicas are fakes that answer token ids and name the weights they serve, as a real
engine's ``GenerateOutput.weight_version`` does; they load "weights" by remembering a path and a
version. A replica that Serve starts in place of a killed one comes back on version 0, the model it
started from, like a real one. What is real: the manager's ``WeightSync`` record, its restore before
every step, and the ``EngineClient`` that retries a turn made on other weights than the record.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable
from typing import Any

import ray

from rayapp.inference.client import FinishReason, GenerateOutput, GenerateRequest
from rayapp.inference.weight_sync import Applied
from rayapp.types import Status

VERSION = re.compile(r" w(\d+)$")  # the weights a sample's turn came from, at the end of its response


class FakeEngine:
    """An engine replica that answers after a short think: the kill, not the model, is under test."""

    def __init__(self) -> None:
        self._applied: Applied | None = None  # None: the weights it started with (version 0)

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        await asyncio.sleep(0.05)
        n = req.sampling.max_new_tokens
        version = self._applied.version if self._applied else 0
        return GenerateOutput(req.request_id, list(range(1, n + 1)), [-0.1] * n, FinishReason.STOP,
                              weight_version=version)

    async def update_weights_from_disk(self, path: str, version: int | None = None) -> dict:
        await asyncio.sleep(0.05)
        self._applied = Applied(path, version)
        return {"ok": True, "path": path, "version": version}

    def applied_weights(self) -> Applied | None:
        return self._applied


def response(output: GenerateOutput) -> str:
    """A sample's response: a nonce of its run (a step run twice is told apart from one served again)
    and the weights its turn came from."""
    return f"ok {random.getrandbits(32):08x} w{output.weight_version}"


def update_then_kill(manager: Any, engine_replica: Callable[[], Any], updates: list[tuple[float, int]]) -> float:
    """The fault, from the driver: the manager applies the next weights to every engine replica (its
    record names the version), then one replica is killed at once (Serve starts a new one, on version
    0). The update's time and version go to ``updates``; the kill's time is returned."""
    version = manager.update_weights.remote(f"/chaos/weights/v{len(updates) + 1}").result(timeout_s=60)
    updates.append((time.monotonic(), version))
    at = time.monotonic()
    ray.kill(engine_replica())
    return at


def stale_samples(results: dict[int, Any], began: dict[int, float], updates: list[tuple[float, int]]) -> int:
    """Samples of steps that began after a weight update whose turn came from other weights than the
    last update before the step (those of a step in flight during an update may be on either)."""
    stale = 0
    for rid, result in results.items():
        before = [v for at, v in updates if at < began[rid]]
        if before:
            stale += sum(_version(s.response) != str(before[-1])
                         for g in result.groups for s in g if s.status is Status.COMPLETED)
    return stale


def _version(text: str) -> str | None:
    found = VERSION.search(text)
    return found[1] if found else None

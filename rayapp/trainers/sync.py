"""Calling rayapp from a trainer's synchronous loop (TRL's ``rollout_func``, verl's ``fit()``,
slime's rollout function).

An in-process ``StepRunner`` is async, and its locks and engine must stay on one event loop across
steps and weight updates: so every awaitable runs on one loop per process, in a daemon thread, and
the trainer's thread waits for it with a timeout. A sync source (a Serve handle's ``.result``) is
called as it is; ``ServeManager`` is the Serve manager's handle as such a source.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


class _Loop:
    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def run(self, awaitable: Any, timeout_s: float, what: str) -> Any:
        with self._lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, name="rayapp-trainer-loop", daemon=True).start()

        async def wrapped() -> Any:
            return await awaitable
        future = asyncio.run_coroutine_threadsafe(wrapped(), self.loop)
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"{what} did not finish within {timeout_s}s") from None


_LOOP = _Loop()


def wait(out: Any, timeout_s: float, what: str) -> Any:
    """``out`` itself, or its result when it is awaitable (awaited on the process's one loop)."""
    return _LOOP.run(out, timeout_s, what) if inspect.isawaitable(out) else out


def call(fn: Callable[..., Any], args: tuple, timeout_s: float, what: str) -> Any:
    """``fn(*args)``, awaited on the process's one loop when it returns an awaitable."""
    return wait(fn(*args), timeout_s, what)


class ServeManager:
    """The Serve manager's handle as a source and a weight updater, with a timeout on every call."""

    def __init__(self, handle: Any, *, engine: str = "student", timeout_s: float = 600.0):
        self.handle, self.engine, self.timeout_s = handle, engine, timeout_s

    def rollout(self, rollout_id: int, tasks: list | None = None) -> Any:
        """Rollout step ``rollout_id``: the data source's tasks, or the trainer's (``tasks``)."""
        args = (rollout_id,) if tasks is None else (rollout_id, tasks)
        return self.handle.generate.remote(*args).result(timeout_s=self.timeout_s)

    def evaluate(self, rollout_id: int) -> Any:
        return self.handle.evaluate.remote(rollout_id).result(timeout_s=self.timeout_s)

    def update_weights(self, path: str) -> list[dict]:
        return self.handle.update_weights_from_disk.remote(self.engine, path).result(timeout_s=self.timeout_s)

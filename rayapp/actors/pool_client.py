"""The core's Pool protocol over the PlacementPool deployment's handle."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from rayapp.types import Resource, Token


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

"""The core's Pool protocol over the PlacementPoolService deployment's handle (or a plain actor's).

Every call is bounded and cancelled when its caller stops waiting (``rayapp.actors.remote``), so
the pool never grants a batch nobody waits for. A waiting acquire is bounded by its own
``timeout_s`` plus ``call_timeout_s`` for the trip. Retrying a batch Ray could not place is the
core pool's business (at the head of its queue), not the client's. Each request carries the
client's ``owner``, so a replica that replaces a crashed one frees what its predecessor held.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rayapp.actors.remote import bounded
from rayapp.types import BatchRequest, Resource, Token

NO_BOUND_S = 86400.0  # an acquire without a timeout still ends its trip some day


class PoolClient:
    def __init__(self, handle: Any, owner: str, call_timeout_s: float = 60.0):
        self.handle, self.owner, self.call_timeout_s = handle, owner, call_timeout_s

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        return await bounded(getattr(self.handle, method).remote(*args), timeout_s or self.call_timeout_s)

    async def acquire_batch(self, request: BatchRequest) -> list[Token]:
        request = msgspec.structs.replace(request, owner=self.owner)
        wait_s = NO_BOUND_S if request.timeout_s is None else request.timeout_s
        return await self._call("acquire_batch", request, timeout_s=wait_s + self.call_timeout_s)

    async def release_batch(self, tokens: list[Token]) -> None:
        await self._call("release_batch", tokens)

    async def release_tokens(self, tokens: list[Token]) -> None:
        """Early release of some of a batch's tokens (bounded like every call; the batch's
        ``release_batch`` frees them anyway if this one is lost)."""
        await self._call("release_tokens", tokens)

    async def max_tokens_for(self, per_sample: Resource) -> int:
        return await self._call("max_tokens_for", per_sample)

    async def release_owner(self) -> int:
        return await self._call("release_owner", self.owner)

    async def placement(self) -> dict[str, Any]:
        return await self._call("placement")

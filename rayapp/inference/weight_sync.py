"""The weights each engine serves, kept by the manager, so a replica that replaces a lost one comes
back on the weights the manager last applied, never silently on the model it started from.

- ``update(engine, path)`` names the new weights ``version`` = the last applied + 1 and sends path
  and version to every replica; the record moves only once every replica has loaded them (a refusal
  changes the record not at all, and the next ``restore`` brings back a replica that did load).
- ``restore()``, before every step: each engine's record goes to every replica again; a replica that
  serves it already skips it (the deployment compares path and version, touching no file), a
  replacement loads it. A replica lost meanwhile is no error here: the next check catches its turns.
- ``lagging(engine, version)``: a model turn made on other weights than the record (a replica
  replaced mid-step, not yet restored). The engine client then restores that engine and asks again;
  a turn still lagging fails its sample as ``StaleWeights`` (an engine fault), never returned.
- A manager that replaced a lost one takes the record back from the replicas (``adopt``: the highest
  version a replica reports), once, before its first restore or update.

Nothing here imports Ray.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from rayapp.core.termination import EngineConnectionError
from rayapp.record import WeightVersion

log = logging.getLogger(__name__)


class Applied(msgspec.Struct, frozen=True):
    """The weights a replica loaded last, as it reports them (``InferenceEngine.applied_weights``) and
    as the manager keeps them per engine."""

    path: str
    version: WeightVersion


class WeightTarget(Protocol):
    """An engine as the manager reaches it: every call goes to every replica."""

    async def update_weights_from_disk(self, path: str,
                                       version: WeightVersion | None = None) -> list[dict[str, Any]]: ...

    async def applied_weights(self) -> list[Applied | None]: ...


class StaleWeights(EngineConnectionError):
    """A model turn came from other weights than the manager last applied, after a restore."""


class WeightSync:
    def __init__(self, engines: Mapping[str, WeightTarget]):
        self.engines = dict(engines)
        self.applied: dict[str, Applied] = {}
        self._adopted = False
        self._lock = asyncio.Lock()  # one round of weights at a time: a restore never overtakes an update

    def lagging(self, engine: str, weight_version: WeightVersion | None) -> bool:
        record = self.applied.get(engine)
        return record is not None and weight_version != record.version

    async def update(self, engine: str, path: str) -> list[dict[str, Any]]:
        """Every replica of ``engine`` on the weights at ``path``, as the next version; their replies."""
        async with self._lock:
            await self._adopt()
            last = self.applied.get(engine)
            version = (last.version if last is not None else 0) + 1
            replies = await self.engines[engine].update_weights_from_disk(path, version)
            self.applied[engine] = Applied(path, version)
            return replies

    async def restore(self, engine: str | None = None) -> None:
        """Every replica of ``engine`` (None: of every engine) on the record's weights."""
        async with self._lock:
            await self._adopt()
            for name, record in self.applied.items():
                if engine is None or name == engine:
                    try:
                        await self.engines[name].update_weights_from_disk(record.path, record.version)
                    except EngineConnectionError as e:  # a replica lost: its replacement is checked per turn
                        log.warning("engine %s: weights version %d not restored on every replica: %s",
                                    name, record.version, e)

    async def _adopt(self) -> None:
        if self._adopted:
            return
        adopted = True
        for name, target in self.engines.items():
            try:
                reports = [r for r in await target.applied_weights() if r]
            except EngineConnectionError as e:  # asked again before the next step
                log.warning("engine %s: cannot ask its replicas for their weights: %s", name, e)
                adopted, reports = False, []
            if reports:
                best = self.applied[name] = max(reports, key=lambda r: r.version)
                log.warning("engine %s: taking up weights version %d (%s) from its replicas",
                            name, best.version, best.path)
        self._adopted = adopted

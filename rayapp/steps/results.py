"""Idempotent steps: a rollout or eval id runs at most once at a time, and a finished step's result
is served again rather than run again.

It exists so a trainer's retry, after a lost answer or a manager restart, gets the samples it was
already given instead of new ones. ``StepResults`` is a single-flight memo per id, kept for the
``keep`` latest ids of each kind in memory and, with a folder, on disk; a step's record keeps the
digest of the trainer's tasks, so the same id with other tasks is refused. Invariant: a result is
handed out only once it is durable, and a step that failed or was cancelled leaves nothing behind.
Ids, files, cancellation: docs/scheduler.md §1, "How steps are idempotent".
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.core.convert import InputError, decode
from rayapp.steps.atomic_files import atomic_write
from rayapp.trainers.step_tasks import tasks_named
from rayapp.types import StepKind

log = logging.getLogger(__name__)

MAX_STEP_ID = 2**31 - 1
_FILE_RE = re.compile(rf"^({'|'.join(k.value for k in StepKind)})_(\d{{6,}})\.msgpack$")
R = TypeVar("R")


def check_step_id(rollout_id: Any) -> int:
    """``rollout_id`` itself when it is an int in 0 .. MAX_STEP_ID, else one ValueError naming it."""
    if type(rollout_id) is not int or not 0 <= rollout_id <= MAX_STEP_ID:
        shown = rollout_id if type(rollout_id) is not int or rollout_id.bit_length() <= 64 else "a very large int"
        raise ValueError(f"rollout_id must be an int in 0 .. {MAX_STEP_ID}, got {shown!r}")
    return rollout_id


class _Stored(msgspec.Struct, tag_field="format", tag="rayapp.step_result", forbid_unknown_fields=True):
    version: Literal[1]
    kind: StepKind
    rollout_id: Annotated[int, Meta(ge=0, le=MAX_STEP_ID)]


# One file type per kind: the two result types are untagged Structs, which cannot share a union field.
class StoredRollout(_Stored):
    result: RolloutResult
    tasks_digest: str | None = None  # the trainer's tasks it ran; None: the data source's (and files before it)


class StoredEval(_Stored):
    result: EvalResult


_ENVELOPES: dict[StepKind, type[StoredRollout] | type[StoredEval]] = {StepKind.ROLLOUT: StoredRollout,
                                                                     StepKind.EVAL: StoredEval}


class StepResults:
    """The single-flight memo of a StepRunner's steps (module docstring). ``folder`` None: results
    are kept in memory only, and a restarted process runs every step anew."""

    def __init__(self, folder: str | os.PathLike | None = None, *, keep: int = 2):
        if type(keep) is not int or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.dir = Path(folder) / "step_results" if folder is not None else None
        self.keep = keep
        self._memo: dict[StepKind, dict[int, Any]] = {kind: {} for kind in _ENVELOPES}
        self._digests: dict[tuple[StepKind, int], str | None] = {}  # of each step kept or in flight
        self._flight: dict[tuple[StepKind, int], asyncio.Task] = {}
        self._waiters: dict[tuple[StepKind, int], int] = {}
        # requests by kind: how many ran a step, how many got one kept or in flight (the status page's)
        self.ran: dict[StepKind, int] = dict.fromkeys(_ENVELOPES, 0)
        self.served: dict[StepKind, int] = dict.fromkeys(_ENVELOPES, 0)

    def path(self, kind: StepKind, rollout_id: int) -> Path | None:
        return self.dir / f"{kind.value}_{check_step_id(rollout_id):06d}.msgpack" if self.dir is not None else None

    async def once(self, kind: StepKind, rollout_id: int, run: Callable[[int], Awaitable[R]], *,
                   digest: str | None = None) -> R:
        """Step ``kind``/``rollout_id``'s result: the kept one, the one in flight, else ``run(rollout_id)``.
        ``digest`` names the tasks the trainer chose for it (None: the data source chooses)."""
        if not isinstance(kind, StepKind):
            raise ValueError(f"kind must be a StepKind ({', '.join(k.name for k in StepKind)}), got {kind!r}")
        check_step_id(rollout_id)
        key = (kind, rollout_id)
        while (task := self._flight.get(key)) is not None and task.cancelling():
            await asyncio.wait([task])  # a step its last requester gave up: let it end, then run afresh
        if rollout_id in self._memo[kind] or task is not None:
            _same_tasks(kind, rollout_id, digest, self._digests[key], "ran" if task is None else "is running")
        if rollout_id in self._memo[kind]:
            self.served[kind] += 1
            return self._memo[kind][rollout_id]
        if task is None:
            task = asyncio.ensure_future(self._load_or_run(kind, rollout_id, run, digest))
            self._flight[key], self._digests[key] = task, digest
        else:
            self.served[kind] += 1
        return await self._wait(key, task)

    async def _wait(self, key: tuple[StepKind, int], task: asyncio.Task) -> Any:
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if self._waiters[key] == 1 and not task.done():
                task.cancel()
                while not task.done():  # its teardown ends before this caller's cancellation goes on
                    try:
                        await asyncio.wait([task])
                    except asyncio.CancelledError:
                        continue
            raise
        finally:
            self._waiters[key] -= 1
            if not self._waiters[key]:
                del self._waiters[key]

    async def _load_or_run(self, kind: StepKind, rollout_id: int, run: Callable[[int], Awaitable[Any]],
                           digest: str | None) -> Any:
        try:
            stored = await asyncio.to_thread(self._load, kind, rollout_id) if self.dir is not None else None
            if stored is not None:
                _same_tasks(kind, rollout_id, digest, getattr(stored, "tasks_digest", None), "was saved")
            result = stored.result if stored is not None else None
            if result is None:
                self.ran[kind] += 1
                result = await run(rollout_id)
                await asyncio.to_thread(self._store, kind, rollout_id, result, digest)
            else:
                self.served[kind] += 1
                log.info("%s %d: served from %s, not run again", kind, rollout_id, self.path(kind, rollout_id))
            self._remember(kind, rollout_id, result)
            return result
        finally:
            self._flight.pop((kind, rollout_id), None)
            if rollout_id not in self._memo[kind]:
                self._digests.pop((kind, rollout_id), None)

    def _remember(self, kind: StepKind, rollout_id: int, result: Any) -> None:
        memo = self._memo[kind]
        memo[rollout_id] = result
        for old in sorted(memo)[:-self.keep]:
            del memo[old]
            if (kind, old) not in self._flight:
                self._digests.pop((kind, old), None)

    def _load(self, kind: StepKind, rollout_id: int) -> StoredRollout | StoredEval | None:
        path = self.path(kind, rollout_id)
        if path is None or not path.exists():
            return None
        try:
            stored = decode(path.read_bytes(), _ENVELOPES[kind], str(path), fmt="msgpack")
            for where, got in (("$.rollout_id", stored.rollout_id), ("$.result.rollout_id", stored.result.rollout_id)):
                if got != rollout_id:
                    raise InputError(str(path), where, f"expected {rollout_id}, got {got}")
        except (OSError, InputError) as e:
            log.warning("%s %d: ignoring its saved result, the step runs again: %s", kind, rollout_id, e)
            return None
        return stored

    def _store(self, kind: StepKind, rollout_id: int, result: Any, digest: str | None) -> None:
        """Save the result, then drop the files of all but the ``keep`` highest ids of this kind. A
        result that cannot be saved fails the step (a ``WriteError`` naming the file, or the
        TypeError of a value msgpack cannot hold): the trainer never holds a result that a restart
        would answer differently, and its retry runs the step again. A failed prune is only logged."""
        path = self.path(kind, rollout_id)
        if path is None:
            return
        try:
            extra = {"tasks_digest": digest} if digest is not None else {}
            data = msgspec.msgpack.encode(_ENVELOPES[kind](1, kind, rollout_id, result, **extra))
        except (TypeError, ValueError) as e:
            raise TypeError(f"{kind} {rollout_id}: its result cannot be saved to {path}: {e}") from None
        atomic_write(path, lambda f: f.write(data), what="step result")
        try:
            kept = sorted((int(m.group(2)), p) for p in self.dir.iterdir()  # type: ignore[union-attr]
                          if (m := _FILE_RE.match(p.name)) and m.group(1) == kind.value)
            for _, old in kept[:-self.keep]:
                old.unlink(missing_ok=True)
        except OSError as e:
            log.warning("%s %d: could not remove older step results in %s: %s", kind, rollout_id, self.dir, e)


def _same_tasks(kind: StepKind, rollout_id: int, asked: str | None, had: str | None, how: str) -> None:
    """Nothing, when step ``kind``/``rollout_id`` is asked for with the tasks it ``how`` with; else one
    ValueError naming the step and both (a step's tasks never change: steps are idempotent)."""
    if asked != had:
        raise ValueError(f"{kind} {rollout_id} {how} with {tasks_named(had)}, and is now asked for with "
                         f"{tasks_named(asked)}: a step's tasks cannot change (its result is served again "
                         f"as it is); ask for a new rollout id")

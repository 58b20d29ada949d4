"""Mid-rollout checkpoints, and resuming a rollout step from one (docs/scheduler.md §5).

It exists so a manager replica killed mid-rollout resumes the step without losing or repeating a
group. ``RolloutCheckpoint`` keeps a rollout's progress on disk (the data source's state, each
finished group, a FINISHED marker); ``ResumableRollouts`` wraps the scheduler, setting and saving
the data source's state before each step and recording each group as it finishes, so the scheduler
itself knows nothing of checkpoints. Invariants: every file is a typed msgpack record, never
unpickled, and a damaged or foreign one is one ``InputError`` naming it; a step whose tasks the
trainer chose resumes only with the same tasks. The files: docs/reliability.md, "A full disk".
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from rayapp.core.contracts import (
    Carry,
    Fetch,
    OnTaskDone,
    ResumableSource,
    RolloutResult,
    require_async,
)
from rayapp.core.convert import InputError, decode
from rayapp.core.scheduler import TaskScheduler
from rayapp.core.uncancellable import run_to_end
from rayapp.steps.atomic_files import atomic_write, fsync_dir
from rayapp.trainers.step_tasks import tasks_named
from rayapp.types import Sample, Task

log = logging.getLogger(__name__)

T = TypeVar("T")
VERSION = 1
RolloutId = Annotated[int, Meta(ge=0)]
_STATE, _DONE = "state.msgpack", "FINISHED"
FINISH_TRIES, FINISH_BACKOFF_S = 3, 0.5  # the FINISHED write: tries, and the wait before the next (x try)
_GROUP_RE = re.compile(r"^group_(\d{6,})\.msgpack$")
_ROLLOUT_RE = re.compile(r"^rollout_(\d{6,})$")


class CarriedGroup(msgspec.Struct, forbid_unknown_fields=True):
    """A group a partial rollout step left unfinished, carried into a later step (and into the
    rollout checkpoint, so that it survives a restart): its task, the step its current attempt
    began in, and its samples as they were left (empty: it starts afresh)."""

    task: Task
    since: int  # the rollout step this attempt of the group began in
    samples: list[Sample] = []


class CheckpointState(msgspec.Struct, tag_field="format", tag="rayapp.rollout_checkpoint.state",
                      forbid_unknown_fields=True):
    version: Literal[1]
    rollout_id: RolloutId
    run: str  # the begin() this folder's groups belong to
    source_state: dict[str, Any]
    tasks_digest: str | None = None  # the trainer-chosen tasks it runs (trainers.step_tasks); None: fetched


class CheckpointGroup(msgspec.Struct, tag_field="format", tag="rayapp.rollout_checkpoint.group",
                      forbid_unknown_fields=True):
    version: Literal[1]
    rollout_id: RolloutId
    run: str
    index: Annotated[int, Meta(ge=0)]
    samples: list[Sample]


class CheckpointFinished(msgspec.Struct, tag_field="format", tag="rayapp.rollout_checkpoint.finished",
                         forbid_unknown_fields=True):
    version: Literal[1]
    rollout_id: RolloutId
    next_source_state: dict[str, Any] | None
    carried: list[CarriedGroup] = []  # partial rollouts: the unfinished groups the next step takes first


def _write(path: Path, record: msgspec.Struct, what: str) -> None:
    data = msgspec.msgpack.encode(record)  # encode first: a value msgpack cannot hold leaves the file as it was
    atomic_write(path, lambda f: f.write(data), what=what)


def _read(path: Path, type_: type[T]) -> T:
    try:
        raw = path.read_bytes()
    except OSError as e:  # missing, a folder, no permission: say that, not "corrupt"
        raise InputError(str(path), "$", (e.strerror or str(e)).lower()) from None
    return decode(raw, type_, str(path), fmt="msgpack")


@dataclass
class ResumeState:
    """What ``RolloutCheckpoint.resume`` found: the source state at begin() and the finished groups."""

    rollout_id: int
    source_state: dict
    groups: dict[int, list[Sample]] = field(default_factory=dict)  # finished groups by fetch index, sorted
    tasks_digest: str | None = None  # what begin() was given


class RolloutCheckpoint:
    """Durable progress of a rollout, so a replica killed mid-way resumes without re-running
    finished groups and without losing or duplicating one (layout: module docstring).

    Protocol: ``st = ckpt.resume(id)``; if None, ``ckpt.begin(id, source.state_dict())`` and fetch,
    else ``source.load_state_dict(st.source_state)``, fetch the same tasks and run only
    those not in ``st.groups``; ``record_group`` as each group finishes; ``finish(id, source.state_dict())``
    at the end (``ResumableRollouts`` follows it). A group file that cannot be read (damaged on disk)
    is skipped with a warning and re-run; a group of another ``begin`` (a stale writer) is skipped
    the same way. Each call does blocking I/O with fsync: on a busy event loop, call it through
    ``asyncio.to_thread``."""

    def __init__(self, dir: str | os.PathLike):
        self.dir = Path(dir)
        self._run: dict[int, str] = {}  # rollout id -> token of the begin() its groups belong to
        self._done: dict[int, set[int]] = {}

    def folder(self, rollout_id: int) -> Path:
        if type(rollout_id) is not int or rollout_id < 0:
            raise ValueError(f"rollout_id must be an int >= 0, got {rollout_id!r}")
        return self.dir / f"rollout_{rollout_id:06d}"

    def begin(self, rollout_id: int, source_state: dict, tasks_digest: str | None = None) -> None:
        """Start ``rollout_id`` afresh, discarding any earlier checkpoint of it; ``tasks_digest`` names
        the tasks the trainer chose for it (None: the step fetches them)."""
        folder = self.folder(rollout_id)
        state = CheckpointState(VERSION, rollout_id, uuid.uuid4().hex, source_state, tasks_digest)
        try:
            data = msgspec.msgpack.encode(state)
        except TypeError as e:
            raise TypeError(f"rollout {rollout_id}: source_state: {e}") from None
        # The state goes first and comes back last: a crash in between leaves no state, so no resume.
        if folder.exists():
            (folder / _STATE).unlink(missing_ok=True)
            fsync_dir(folder)
            shutil.rmtree(folder)
        atomic_write(folder / _STATE, lambda f: f.write(data), what="checkpoint state")
        self._run[rollout_id], self._done[rollout_id] = state.run, set()
        self._prune(before=rollout_id - 1)

    def _prune(self, before: int) -> None:
        """Drop the group files of finished rollouts older than ``before``: the trainer asked for later
        steps since, and kept copies would double the run's disk use. Their state and FINISHED stay."""
        for folder in self.dir.glob("rollout_*"):
            m = _ROLLOUT_RE.fullmatch(folder.name)
            if m and int(m.group(1)) < before and (folder / _DONE).exists():
                for p in folder.iterdir():
                    if _GROUP_RE.match(p.name):
                        p.unlink(missing_ok=True)

    def record_group(self, rollout_id: int, index: int, group: list[Sample]) -> None:
        """Durably add finished group ``index`` (its position in fetch order); a repeat is a ValueError."""
        folder = self.folder(rollout_id)
        if rollout_id not in self._run:
            raise ValueError(f"rollout {rollout_id}: call begin() or resume() before record_group()")
        if type(index) is not int or index < 0 or index in self._done[rollout_id]:
            raise ValueError(f"rollout {rollout_id}: group index {index!r} is not new (or not an int >= 0)")
        _write(folder / f"group_{index:06d}.msgpack",
               CheckpointGroup(VERSION, rollout_id, self._run[rollout_id], index, list(group)), "group checkpoint")
        self._done[rollout_id].add(index)

    def finish(self, rollout_id: int, next_source_state: dict | None = None,
               carried: list[CarriedGroup] | None = None) -> None:
        """Mark ``rollout_id`` complete: ``resume`` returns None for it from now on. The source's
        state after the step's fetch lets a restarted manager continue the stream (``next_source_state``);
        ``carried`` (partial rollouts) are the groups the step leaves to the next, in the same write,
        so that no crash can keep one without the other."""
        folder = self.folder(rollout_id)
        if not (folder / _STATE).exists():
            raise ValueError(f"rollout {rollout_id}: finish() without begin()")
        _write(folder / _DONE, CheckpointFinished(VERSION, rollout_id, next_source_state, list(carried or [])),
               "finished marker")
        self._forget(rollout_id)

    def next_source_state(self, rollout_id: int) -> dict | None:
        """The data source's state after finished rollout ``rollout_id``'s fetch; None when it did
        not finish or saved none. A damaged marker is an InputError: continuing from the start
        instead would silently repeat data."""
        marker = self.folder(rollout_id) / _DONE
        if not marker.exists():
            return None
        return _read(marker, CheckpointFinished).next_source_state

    def carried(self, rollout_id: int) -> list[CarriedGroup] | None:
        """The groups finished rollout ``rollout_id`` carried on (partial rollouts); None when it did
        not finish. A damaged marker is an InputError: going on without them would lose tasks."""
        marker = self.folder(rollout_id) / _DONE
        if not marker.exists():
            return None
        return _read(marker, CheckpointFinished).carried

    def resume(self, rollout_id: int) -> ResumeState | None:
        """The saved source state and finished groups of an unfinished ``rollout_id``; None when it
        never began or finished. A damaged state file is an InputError (nothing to resume from)."""
        folder = self.folder(rollout_id)
        if not (folder / _STATE).exists() or (folder / _DONE).exists():
            return None
        state = _read(folder / _STATE, CheckpointState)
        if state.rollout_id != rollout_id:
            raise InputError(str(folder / _STATE), "$.rollout_id", f"expected {rollout_id}, got {state.rollout_id}")
        groups: dict[int, list[Sample]] = {}
        for p in folder.iterdir():
            if not (m := _GROUP_RE.match(p.name)):
                continue  # state, marker, and temp files a crash left behind
            try:
                g = _read(p, CheckpointGroup)
                if g.run != state.run or g.rollout_id != rollout_id or g.index != int(m.group(1)):
                    raise InputError(str(p), "$", "belongs to another begin() of this rollout, or to another group")
            except InputError as e:
                log.warning("resume: skipping %s, its group will be re-run: %s", p, e)
                continue
            groups[g.index] = g.samples
        self._run[rollout_id], self._done[rollout_id] = state.run, set(groups)
        return ResumeState(rollout_id, state.source_state, dict(sorted(groups.items())), state.tasks_digest)

    def _forget(self, rollout_id: int) -> None:
        self._run.pop(rollout_id, None)
        self._done.pop(rollout_id, None)


async def in_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a thread (blocking I/O with fsync), awaited to its end even when the caller is
    cancelled meanwhile (``core.uncancellable``): a thread cannot be stopped, and a checkpoint write must
    never be written after the step that made it has returned."""
    return await run_to_end(asyncio.to_thread(fn, *args))


class _Recorder:
    """One step's StepLog: the groups finished before, and a checkpoint write per group finished now.
    A failed write costs resumability, not the step: it is logged, and the step goes on."""

    def __init__(self, checkpoint: RolloutCheckpoint, rollout_id: int, restored: dict[int, list[Sample]]):
        self.checkpoint, self.rollout_id, self.restored = checkpoint, rollout_id, restored

    async def finished(self, tasks: list[Task]) -> Mapping[int, list[Sample]]:
        """The restored groups, once each is known to be the group of the task re-fetched at its
        index: a changed data config (datasets, weights, group sizes, batch size) fetches others,
        and splicing them in would lose and repeat tasks."""
        for i, group in self.restored.items():
            want = (tasks[i].task_id, tasks[i].config.n_samples) if i < len(tasks) else None
            got = (group[0].task_id, len(group)) if group else (None, 0)
            if got != want:
                raise ValueError(f"rollout {self.rollout_id}: its checkpoint's group {i} is {got[0]!r} x{got[1]}, "
                                 f"but the fetch from the saved source state gave "
                                 f"{'nothing there' if want is None else f'{want[0]!r} x{want[1]}'}: the data "
                                 f"config changed since the checkpoint was written; restore it, or delete that "
                                 f"rollout's checkpoint to run the step afresh")
        return self.restored

    async def group_done(self, index: int, samples: list[Sample]) -> None:
        try:
            await in_thread(self.checkpoint.record_group, self.rollout_id, index, samples)
        except Exception as e:  # a WriteError names the file and the cause
            log.warning("rollout %d: could not checkpoint group %d, a restart would run it again: %s",
                        self.rollout_id, index, e)


class ResumableRollouts:
    """Rollout steps of the scheduler below it, checkpointed and resumable (module docstring).
    ``source`` is the data source that scheduler fetches from: its stream is saved and set back
    (``ResumableSource``)."""

    def __init__(self, rollouts: TaskScheduler, source: ResumableSource, checkpoint: RolloutCheckpoint):
        if not isinstance(source, ResumableSource):
            missing = [m for m in ("get_tasks", "state_dict", "load_state_dict")
                       if not callable(getattr(source, m, None))]
            raise TypeError(f"a rollout checkpoint needs a data_source that saves its stream: {type(source).__name__} "
                            f"lacks {missing} (core.contracts.ResumableSource: async get_tasks(n), "
                            f"state_dict() -> dict, load_state_dict(state))")
        require_async(source, "get_tasks", "data_source", "async def get_tasks(self, n: int) -> list[Task]")
        self.rollouts, self.source, self.checkpoint = rollouts, source, checkpoint

    @classmethod
    def over(cls, scheduler: TaskScheduler, checkpoint: RolloutCheckpoint) -> ResumableRollouts:
        """``scheduler``'s rollout steps, checkpointed, with its data source."""
        return cls(scheduler, scheduler.data_source, checkpoint)

    async def execute_rollout(self, rollout_id: int, on_task_done: OnTaskDone | None = None, *,
                              fetch: Fetch | None = None, complete_after: int | None = None,
                              carry: Carry | None = None, digest: str | None = None) -> RolloutResult:
        """The step below; one that was cut short (the process killed) resumes: the same tasks are
        fetched again from the saved source state, and only the groups not recorded as finished run
        (``on_task_done`` fires for those only). ``fetch`` and ``complete_after`` go down, with this
        one's step log. ``carry(result)`` (partial rollouts) names what the finished step carries
        on, saved with its end (``carried``); ``digest`` names the trainer's chosen tasks (saved with
        the step's start: a step resumes only with the same)."""
        restored = await self._open(rollout_id, digest)
        step_log = _Recorder(self.checkpoint, rollout_id, restored)
        result = await self.rollouts.execute_rollout(rollout_id, on_task_done, fetch=fetch,
                                                     complete_after=complete_after, step_log=step_log)
        result.metrics["rollout/resumed_groups"] = float(len(restored))
        carried = carry(result) if carry is not None else []
        await self._finish(rollout_id, self.source.state_dict(), carried)
        return result

    async def _finish(self, rollout_id: int, next_source_state: dict, carried: list[CarriedGroup]) -> None:
        """Write the step's FINISHED record, tried ``FINISH_TRIES`` times. It is part of the step's
        durable record (the data stream's place after the step, and any carried groups, whose only
        copy outlives this process there), so when it cannot be written the step fails (nothing
        handed out): the trainer runs it again, and the rerun resumes this unfinished checkpoint,
        re-fetching the same tasks, taking the same carried groups and skipping the groups
        recorded as finished."""
        for attempt in range(1, FINISH_TRIES + 1):
            try:
                await in_thread(self.checkpoint.finish, rollout_id, next_source_state, carried)
                return
            except Exception as e:
                if attempt < FINISH_TRIES:
                    log.warning("rollout %d: could not mark its checkpoint finished (try %d of %d): %s",
                                rollout_id, attempt, FINISH_TRIES, e)
                    await asyncio.sleep(FINISH_BACKOFF_S * attempt)
                elif carried:
                    raise RuntimeError(f"rollout {rollout_id}: could not save the {len(carried)} groups it carries "
                                       f"on (its FINISHED record, {FINISH_TRIES} tries): {e}; run the step again, "
                                       f"it resumes from its checkpoint") from e
                else:  # without it a restarted manager would lose its place in the data stream
                    raise RuntimeError(f"rollout {rollout_id}: could not mark its checkpoint finished "
                                       f"({FINISH_TRIES} tries): {e}; run the step again, it resumes from "
                                       f"its checkpoint") from e

    async def carried(self, rollout_id: int) -> list[CarriedGroup] | None:
        """What finished rollout ``rollout_id`` carried on (``RolloutCheckpoint.carried``)."""
        return await in_thread(self.checkpoint.carried, rollout_id)

    async def _open(self, rollout_id: int, digest: str | None) -> dict[int, list[Sample]]:
        """Resume ``rollout_id`` (its source state back, its finished groups), or begin it where the
        data stream stood after rollout ``rollout_id - 1`` when that one finished here: a restarted
        process, or a trainer that went back to an earlier step, gets the same tasks again. A step
        the trainer chose the tasks of (``digest``) resumes only with the same tasks."""
        ck, source = self.checkpoint, self.source
        resumed = await in_thread(ck.resume, rollout_id)
        if resumed is not None and resumed.tasks_digest != digest:
            raise ValueError(f"rollout {rollout_id}: its unfinished checkpoint ({ck.folder(rollout_id)}) began with "
                             f"{tasks_named(resumed.tasks_digest)}, and the step is now asked for with "
                             f"{tasks_named(digest)}: "
                             f"a step's tasks cannot change; pass the same tasks, or delete that folder to run the "
                             f"step afresh")
        if resumed is not None:
            source.load_state_dict(resumed.source_state)
            log.warning("rollout %d resumes from its checkpoint: %d groups finished before", rollout_id,
                        len(resumed.groups))
            return dict(resumed.groups)
        before = await in_thread(ck.next_source_state, rollout_id - 1) if rollout_id > 0 else None
        if before is not None:
            source.load_state_dict(before)
        elif rollout_id > 0:
            log.info("rollout %d: no finished checkpoint of rollout %d; the data stream goes on from where the "
                     "source stands", rollout_id, rollout_id - 1)
        await in_thread(ck.begin, rollout_id, source.state_dict(), digest)
        return {}

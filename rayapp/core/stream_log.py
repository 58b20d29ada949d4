"""What a group stream hands the trainer, and what it keeps to survive a restart (docs/streaming.md).

``StreamGroup`` is one group as the trainer gets it, with the weights it was made on and the version
it was trained on. ``StreamLog`` is where a stream records admissions, finishes and acks, so that a
stream built again on it delivers again every group not acked and never one that was;
``MemoryStreamLog`` keeps them in memory (a durable one over the checkpoint folder is not built).
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from rayapp.record import WeightVersion
from rayapp.types import Sample, Task, TaskKey

_GROUP_ID = TaskKey.GROUP_ID.value


class StreamGroup(msgspec.Struct):
    """One group as the trainer gets it: its samples, whole; ``version``, the weights the engines
    served when it started; ``deadline``, the last version it may be trained on; ``trained_version``,
    the trainer's version when it was handed over (None before); how often it was delivered."""

    group_id: str
    task: Task
    samples: list[Sample]
    version: WeightVersion
    deadline: int
    trained_version: WeightVersion | None = None
    deliveries: int = 0

    def staleness(self) -> int | None:
        """Versions between the one it was trained on and the oldest weights that made a turn of it."""
        if self.trained_version is None:
            return None
        made = [t.weight_version for s in self.samples for t in s.episode.turn_records if t.weight_version is not None]
        return self.trained_version - min([self.version, *made])


class StreamState(msgspec.Struct):
    """What a stream starts from after a restart (``StreamLog.load``): the groups that finished and
    were not acked (delivered again), the tasks of groups that started and did not finish (run again,
    each with its group id), and the next group number."""

    finished: list[StreamGroup] = []
    unfinished: list[Task] = []
    next_seq: int = 0


class StreamLog(Protocol):
    """Where a stream records what must survive a restart. Each call has run to its end before the stream
    goes on (a group is delivered only once its finish is recorded; an ack counts once recorded)."""

    async def load(self) -> StreamState: ...
    async def admitted(self, tasks: list[Task], next_seq: int) -> None: ...
    async def finished(self, group: StreamGroup) -> None: ...
    async def acked(self, group_ids: list[str]) -> None: ...


class MemoryStreamLog:
    """A StreamLog kept in memory: a stream built again on it (the trainer's process lives on)
    delivers again what was not acked. The checkpoint folder's log is the durable one (not built)."""

    def __init__(self) -> None:
        self.running: dict[str, Task] = {}
        self.done: dict[str, StreamGroup] = {}
        self.next_seq = 0

    async def load(self) -> StreamState:
        finished = [msgspec.structs.replace(g, trained_version=None) for g in self.done.values()]
        return StreamState(finished, list(self.running.values()), self.next_seq)

    async def admitted(self, tasks: list[Task], next_seq: int) -> None:
        self.running |= {t.metadata[_GROUP_ID]: t for t in tasks}
        self.next_seq = next_seq

    async def finished(self, group: StreamGroup) -> None:
        self.running.pop(group.group_id, None)
        self.done[group.group_id] = group

    async def acked(self, group_ids: list[str]) -> None:
        for gid in group_ids:
            self.done.pop(gid, None)

"""The staleness bound of a group stream (docs/streaming.md): which groups may start, and which
finished groups a trainer may take, so that none is trained more than ``max_staleness`` versions
after the weights its generation started on.

Pure bookkeeping, no asyncio. The trainer trains ``batch_size`` (B) groups on each weight version.
A group admitted while the trainer is at version s must be trained by version s + η, its deadline.
The slots left are B - taken at the current version v and B at each later one, so the groups not
yet handed over can all meet their deadlines exactly when, for every version w >= v,

    (groups not handed over whose deadline is <= w)  <=  (B - taken) + (w - v) * B      (Hall)

Admission adds a group of the latest deadline, v + η, so it checks the one line w = v + η: that is
AReaL's capacity, (η + v + 1)·B - (accepted + running), counted from the trainer's side. Handing
a group over spends a slot of version v, so a group due later may be taken only while every
earlier line keeps a slot to spare (``may_take``); groups due now go first. With both, the lines
hold at every step and no group is ever overdue.
"""

from __future__ import annotations

import copy
import enum
from collections import Counter


class AtBound(enum.StrEnum):
    """What a group still running when it falls due (the trainer is at its deadline) does."""

    FINISH = "finish"  # it runs to its end; the trainer waits for it, and its staleness is recorded
    RESUME = "resume"  # cut, and resumed on the newest weights from its resume points (not built)
    RESTART = "restart"  # cut, and started afresh on the newest weights (not built)


BUILT = (AtBound.FINISH,)


class StalenessBound:
    """The Hall lines above, for a trainer at ``version`` taking ``batch_size`` groups a version.
    Every group admitted (or handed back after a restart) and not yet taken is counted by its
    deadline; ``taken`` counts the groups handed over at the current version."""

    def __init__(self, batch_size: int, max_staleness: int, version: int = 0):
        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if type(max_staleness) is not int or max_staleness < 0:
            raise ValueError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if type(version) is not int or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        self.batch_size, self.max_staleness, self.version = batch_size, max_staleness, version
        self.taken = 0
        self._deadlines: Counter[int] = Counter()  # deadline -> groups not handed over

    @property
    def outstanding(self) -> int:
        """Groups admitted and not handed over: running, or finished and waiting."""
        return self._deadlines.total()

    @property
    def left(self) -> int:
        """Groups the trainer still takes at the current version."""
        return self.batch_size - self.taken

    def capacity(self) -> int:
        """How many more groups may start now: (η + 1)·B - taken - outstanding (never below 0)."""
        return max(0, (self.max_staleness + 1) * self.batch_size - self.taken - self.outstanding)

    def admit(self) -> int:
        """Count one group starting now; its deadline. Only within ``capacity``."""
        if self.capacity() < 1:
            raise RuntimeError("a group admitted beyond the staleness bound's capacity (a bug in its caller)")
        deadline = self.version + self.max_staleness
        self._deadlines[deadline] += 1
        return deadline

    def restore(self, deadline: int) -> None:
        """Count a group handed back from before a restart, with the deadline it had."""
        self._deadlines[deadline] += 1

    def drop(self, deadline: int) -> None:
        """Stop counting a group that will not be handed over (cut short by close, or never fetched)."""
        self._forget(deadline)

    def due(self, deadline: int) -> int:
        """The version a group must be taken by, as things stand: its deadline, or now if overdue."""
        return max(deadline, self.version)

    def may_take(self, deadline: int) -> bool:
        """Whether a group of ``deadline`` may be handed over now and every Hall line still hold."""
        if self.left < 1:
            return False
        due = self.due(deadline)
        if due == self.version:
            return True  # due now: taking it only relieves the lines
        for w in range(self.version, due):
            earlier = sum(c for d, c in self._deadlines.items() if self.due(d) <= w)
            if earlier + 1 > self.left + (w - self.version) * self.batch_size:
                return False
        return True

    def plan(self) -> StalenessBound:
        """A copy to try hand-overs on without changing this one."""
        other = copy.copy(self)
        other._deadlines = self._deadlines.copy()
        return other

    def take(self, deadline: int) -> None:
        """Hand one group of ``deadline`` over at the current version."""
        if self.left < 1:
            raise RuntimeError(f"version {self.version} took its {self.batch_size} groups already (a caller bug)")
        self._forget(deadline)
        self.taken += 1

    def advance(self, version: int, *, drained: bool) -> None:
        """The trainer publishes ``version``, the next one, having taken its B groups (or, ``drained``,
        every group there will be)."""
        if type(version) is not int or version != self.version + 1:
            raise ValueError(f"set_version({version!r}): the trainer is at version {self.version}; "
                             f"publish {self.version + 1} next")
        if self.taken < self.batch_size and not drained:
            raise ValueError(f"set_version({version}): the trainer took {self.taken} of the {self.batch_size} groups "
                             f"of version {self.version}; the staleness bound counts batch_size groups a version: "
                             f"take the rest (next_batch) first")
        self.version, self.taken = version, 0

    def _forget(self, deadline: int) -> None:
        if self._deadlines[deadline] < 1:
            raise RuntimeError(f"no group of deadline {deadline} is counted (a bug in its caller)")
        self._deadlines[deadline] -= 1
        if not self._deadlines[deadline]:
            del self._deadlines[deadline]

"""The manager's weight record (rayapp.inference.weight_sync) against fake replicas: a replacement
replica (back at the model it started from) is brought onto the applied weights by the next
restore, replicas already on them load nothing, a refused update moves no record, and a new
manager takes the record up from the replicas."""

import asyncio

import pytest

from rayapp.inference.weight_sync import Applied, WeightSync


class Replicas:
    """Every call reaches every replica, as the engine client's broadcast does."""

    def __init__(self, n: int):
        self.state: list[Applied | None] = [None] * n  # None: the model it started from
        self.loads = 0
        self.refuse: str | None = None

    async def update_weights_from_disk(self, path, version=None):
        if path == self.refuse:
            raise ValueError(f"weights at {path!r} refused")
        out = []
        for i, s in enumerate(self.state):
            if s != Applied(path, version):
                self.state[i], self.loads = Applied(path, version), self.loads + 1
            out.append({"ok": True, "path": path, "version": version})
        return out

    async def applied_weights(self):
        return list(self.state)


def test_a_replacement_replica_is_restored_to_the_applied_weights():
    replicas = Replicas(2)
    sync = WeightSync({"student": replicas})
    asyncio.run(sync.update("student", "/w/1"))
    asyncio.run(sync.update("student", "/w/2"))
    assert replicas.state == [Applied("/w/2", 2)] * 2 and replicas.loads == 4
    replicas.state[1] = None  # killed and replaced: back at version 0
    assert sync.lagging("student", 0) and not sync.lagging("student", 2)
    assert sync.lagging("student", None)  # a turn whose engine named no version is not on the record's weights
    asyncio.run(sync.restore())
    assert replicas.state == [Applied("/w/2", 2)] * 2 and replicas.loads == 5  # only the new one


def test_a_refused_update_moves_nothing_and_a_new_manager_takes_up_the_record():
    replicas = Replicas(2)
    sync = WeightSync({"student": replicas})
    asyncio.run(sync.update("student", "/w/1"))
    replicas.refuse = "/etc"
    with pytest.raises(ValueError, match="refused"):
        asyncio.run(sync.update("student", "/etc"))
    assert sync.applied["student"].version == 1
    again = WeightSync({"student": replicas})  # the manager replaced: nothing in memory
    assert asyncio.run(again.update("student", "/w/2"))[0]["version"] == 2
    assert not WeightSync({"teacher": Replicas(1)}).lagging("teacher", None)  # never updated: no check

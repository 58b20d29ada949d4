"""One step id, one result, whatever the disk does: a step whose durable record (checkpoint state,
group files, FINISHED marker, stored result) cannot be written fails with an error naming the file
and the operation, so the trainer never holds a result that a repeat of its id, even after a
restart, would answer differently."""

import errno
import os
import pickle
from pathlib import Path

import pytest
from conftest import run
from test_step_runner import _counting, _samples

from rayapp.steps import checkpoint as checkpoint_module
from rayapp.steps.atomic_files import WriteError, atomic_write
from rayapp.steps.checkpoint import RolloutCheckpoint
from rayapp.steps.runner import StepRunner

WRITES_PER_STEP = 7  # checkpoint state, 4 group files, FINISHED, the stored result


class FullDisk:
    """Files opened for writing under ``root`` take their bytes until ``after`` of them were opened;
    from then on every write to one fails as a full disk does (ENOSPC), until ``free()``. Files
    elsewhere are untouched. Linux: an fd's path is read from /proc/self/fd."""

    def __init__(self, monkeypatch, root: Path, after: int):
        self.root, self.after, self.opened = str(root), after, 0
        real = os.fdopen

        def fdopen(fd, *args, **kwargs):
            f = real(fd, *args, **kwargs)
            if not os.readlink(f"/proc/self/fd/{fd}").startswith(self.root):
                return f
            self.opened += 1
            return f if self.opened <= self.after else _Full(f)

        monkeypatch.setattr(os, "fdopen", fdopen)

    def free(self) -> None:
        self.after = float("inf")


class _Full:
    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_a_failed_whole_file_write_names_the_operation_and_the_path_and_leaves_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "x" / "y.msgpack"
    atomic_write(target, lambda f: f.write(b"old"))
    FullDisk(monkeypatch, tmp_path, after=0)
    with pytest.raises(WriteError) as e:
        atomic_write(target, lambda f: f.write(b"new"), what="step result")
    assert str(e.value) == f"writing step result {target}: No space left on device"
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert target.read_bytes() == b"old" and os.listdir(target.parent) == ["y.msgpack"]  # no temp file left
    back = pickle.loads(pickle.dumps(e.value))  # as Ray hands it to the caller
    assert type(back) is WriteError and str(back) == str(e.value) and back.errno == errno.ENOSPC


@pytest.mark.parametrize("full_after", range(WRITES_PER_STEP))
def test_a_full_disk_mid_step_fails_the_step_and_a_repeated_id_never_returns_other_samples(
        make_pool, tmp_path, monkeypatch, full_after):
    monkeypatch.setattr(checkpoint_module, "FINISH_BACKOFF_S", 0.0)
    log = []

    def manager():  # a fresh one on the same folder: a restarted replica
        return StepRunner(_counting(make_pool, log, checkpointable=True), checkpoint=RolloutCheckpoint(tmp_path))

    disk = FullDisk(monkeypatch, tmp_path, after=full_after)
    first = manager()
    with pytest.raises(Exception, match=rf"writing [a-z ]+ {tmp_path}/\S+: No space left on device") as e:
        run(first.rollout(0))  # never a result the disk could not keep
    if full_after == WRITES_PER_STEP - 1:
        path = tmp_path / "step_results" / "rollout_000000.msgpack"
        assert str(e.value) == f"writing step result {path}: No space left on device"
    elif full_after == WRITES_PER_STEP - 2:
        assert str(e.value).startswith("rollout 0: could not mark its checkpoint finished (3 tries): writing "
                                       f"finished marker {tmp_path}/rollout_000000/FINISHED: No space left")
    assert disk.opened >= full_after + 1
    with pytest.raises(Exception, match="No space left on device"):
        run(manager().rollout(0))  # restarted while the disk is still full: fails again, returns nothing

    disk.free()
    received = run(first.rollout(0))  # the trainer's retry
    keys = [(t, i) for t, i, _, _ in _samples(received)]
    assert len(keys) == len(set(keys)) == 8 and {i for _, i in keys} == {0, 1}
    ran = len(log)
    for again in (first, manager(), manager()):  # repeated, and after restarts
        assert _samples(run(again.rollout(0))) == _samples(received)
    assert len(log) == ran  # served, not run again

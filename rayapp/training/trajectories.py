"""Saved trajectories and mid-rollout checkpoints (spec §5 "Reuse & resume"; the reuse policy that
chooses between them is ``reuse.py``).

A trajectory file is ``torch.save`` of plain data, read with ``torch.load(weights_only=True)``::

    {"format": "rayapp.trajectories", "version": 1, "rollout_id": int | None,
     "groups": [[sample, ...], ...]}   # one dict per Sample, keyed by field name

``tokens`` and ``loss_mask`` are 1-D int tensors (the smallest of int8..int64 that holds them),
``rollout_log_probs`` float64; other values are None, bool, int, float, str, list, tuple, dict or
tensors (not bytes: weights_only refuses an empty one). Tensors, not lists, for load time:
weights_only's unpickler is pure Python, and 2M tokens + 2M log-probs load in 0.4 s as tensors,
6.8 s as lists, at about the same size. Values are copied; a subclass of str/int/float/list/tuple/
dict (a StrEnum, a namedtuple) is stored as its base type; anything else is refused at save time
with a TypeError naming it, so that a file written here always loads.

Guarantees:
- ``plain_to_samples(samples_to_plain(g)) == g`` for valid Samples, also through torch.save/load.
- ``save_trajectories`` is atomic: a temp file in the same folder, fsync, ``os.replace``, so a
  crash leaves the old file or the new one, never half of one.
- ``load_trajectories`` raises one ``TrajectoryError`` (a ValueError) naming the file and what is
  wrong for a missing, truncated, corrupt or foreign file, never an error from deep inside.
"""

from __future__ import annotations

import logging
import operator
import os
import re
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from rayapp.training.artifacts import atomic_write, fsync_dir
from rayapp.types import Sample

log = logging.getLogger(__name__)

FORMAT, VERSION = "rayapp.trajectories", 1
_INT_FIELDS, _ARRAYS = ("tokens", "loss_mask"), ("tokens", "loss_mask", "rollout_log_probs")
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
_SCALARS = (type(None), bool, int, float, str)  # not bytes: b"" pickles as GLOBAL bytes, refused


class TrajectoryError(ValueError):
    """A trajectory or checkpoint file (or plain data) that cannot be read; names it and why."""

    def __init__(self, where: str | os.PathLike, problem: str):
        self.where, self.problem = str(where), problem
        super().__init__(f"{where}: {problem}")


# ---- plain data ----------------------------------------------------------------------------------

def _where(path: tuple) -> str:
    return path[0] + "".join(f"[{p!r}]" for p in path[1:])  # path[0] names the root


def _plain(v: Any, path: tuple, stack: tuple = ()) -> Any:
    """A copy of ``v`` made of the types weights_only loads back as they are (module docstring)."""
    if type(v) in _SCALARS:
        return v
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().clone()  # clone: torch.save of a view writes its whole storage
    for base in (str, int, float):
        if isinstance(v, base):
            return base(v)  # a StrEnum/IntEnum pickles as its class, which weights_only refuses
    if isinstance(v, (list, tuple, dict)):
        if id(v) in stack:
            raise TypeError(f"{_where(path)}: a reference cycle")
        stack = (*stack, id(v))
        if isinstance(v, dict):
            out = {}
            for k, x in v.items():
                key = _plain(k, path, stack)
                if type(key) not in _SCALARS:
                    raise TypeError(f"{_where(path)}: dict key {k!r} is not None/bool/int/float/str")
                out[key] = _plain(x, (*path, key), stack)
            return out
        items = [_plain(x, (*path, i), stack) for i, x in enumerate(v)]
        return items if isinstance(v, list) else tuple(items)
    t = type(v)
    raise TypeError(f"{_where(path)}: a {t.__module__}.{t.__qualname__} is not plain data "
                    "(None, bool, int, float, str, list, tuple, dict, torch.Tensor)")


def _checked(v: Any, is_int: bool, where: str) -> torch.Tensor | list:
    """A token-like field checked: a 1-D int (float) tensor on the CPU, or a list of ints (floats)."""
    kind = "integer" if is_int else "float"
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype == torch.bool or v.dtype.is_complex or v.dtype.is_floating_point == is_int:
            raise TypeError(f"{where}: expected a 1-D {kind} tensor, got {v.dtype} of shape {tuple(v.shape)}")
        return v.detach().cpu()
    if not isinstance(v, (list, tuple)):
        raise TypeError(f"{where}: expected a list, got {type(v).__name__}")
    if all(type(x) is (int if is_int else float) for x in v):  # the fast path real samples take
        return list(v)
    for i, x in enumerate(v):
        if isinstance(x, bool) or not (hasattr(x, "__index__") if is_int else isinstance(x, (int, float))):
            raise TypeError(f"{where}[{i}]: expected {'an int' if is_int else 'a float'}, got {x!r}")
    return [operator.index(x) for x in v] if is_int else [float(x) for x in v]


def _array(v: Any, is_int: bool, where: str) -> torch.Tensor:
    """A token-like field as a new tensor: ints in the smallest dtype that holds them, floats in
    float64 (so a Python float comes back bit for bit)."""
    v = _checked(v, is_int, where)
    if not is_int:
        return v.to(torch.float64, copy=True) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)
    if isinstance(v, torch.Tensor):
        lo, hi = (int(v.min()), int(v.max())) if len(v) else (0, 0)
    else:
        lo, hi = min(v, default=0), max(v, default=0)
    for dtype in _INT_DTYPES:
        if torch.iinfo(dtype).min <= lo and hi <= torch.iinfo(dtype).max:
            return v.to(dtype, copy=True) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=dtype)
    raise TypeError(f"{where}: values outside int64 ({lo}..{hi})")


def _sample_from_fields(d: dict, where: str) -> Sample:
    """Type-check the non-array fields as Sample declares them (msgspec names the bad field)."""
    try:
        return msgspec.convert({k: x for k, x in d.items() if k not in _ARRAYS}, Sample)
    except msgspec.ValidationError as e:
        raise TypeError(f"{where}: {e}") from None


def _sample_to_plain(s: Any, where: str) -> dict:
    if not isinstance(s, Sample):
        raise TypeError(f"{where}: expected a Sample, got {type(s).__name__}")
    out = {}
    for name in Sample.__struct_fields__:
        v = getattr(s, name)
        if name in _ARRAYS:
            out[name] = _array(v, name in _INT_FIELDS, f"{where}.{name}")
        else:
            out[name] = _plain(v, (f"{where}.{name}",))
    _sample_from_fields(out, where)  # what load would refuse is refused now, while the data is at hand
    return out


def _sample_from_plain(d: Any, where: str) -> Sample:
    if not isinstance(d, dict):
        raise TypeError(f"{where}: expected a dict, got {type(d).__name__}")
    arrays = {k: _checked(d[k], k in _INT_FIELDS, f"{where}.{k}") for k in _ARRAYS if k in d}
    arrays = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in arrays.items()}
    s = _sample_from_fields(_plain({k: x for k, x in d.items() if k not in arrays}, (where,)), where)
    for k, v in arrays.items():
        setattr(s, k, v)
    return s


def samples_to_plain(groups: list[list[Sample]], rollout_id: int | None = None) -> dict:
    """The plain-data dict of ``groups`` with the format header. Raises TypeError naming the first
    value that is not plain data or does not fit its Sample field."""
    if rollout_id is not None and (type(rollout_id) is not int or rollout_id < 0):
        raise TypeError(f"rollout_id must be None or an int >= 0, got {rollout_id!r}")
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in groups):
        raise TypeError("groups: expected a list of lists of Samples")
    plain = [[_sample_to_plain(s, f"groups[{i}][{j}]") for j, s in enumerate(g)] for i, g in enumerate(groups)]
    return {"format": FORMAT, "version": VERSION, "rollout_id": rollout_id, "groups": plain}


def _check_header(data: Any, fmt: str, where: str | os.PathLike) -> dict:
    if not isinstance(data, dict):
        raise TrajectoryError(where, f"holds a {type(data).__name__}, not a {fmt!r} dict")
    if "format" not in data:
        raise TrajectoryError(where, f"a dict without the 'format' header (keys: {sorted(map(str, data))[:8]})")
    if data["format"] != fmt:
        raise TrajectoryError(where, f"format {data['format']!r}, expected {fmt!r}")
    if data.get("version") != VERSION:
        raise TrajectoryError(where, f"version {data.get('version')!r}; this code reads version {VERSION}")
    rid = data.get("rollout_id")
    if rid is not None and (type(rid) is not int or rid < 0):
        raise TrajectoryError(where, f"rollout_id {rid!r} is not an int >= 0")
    return data


def plain_to_samples(data: Any, where: str = "trajectory data") -> list[list[Sample]]:
    """The groups of a ``samples_to_plain`` dict; a bad header or value is a TrajectoryError."""
    groups = _check_header(data, FORMAT, where).get("groups")
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise TrajectoryError(where, "'groups' is not a list of lists")
    try:
        return [[_sample_from_plain(d, f"groups[{i}][{j}]") for j, d in enumerate(g)] for i, g in enumerate(groups)]
    except TypeError as e:
        raise TrajectoryError(where, str(e)) from None


# ---- files ---------------------------------------------------------------------------------------

def _torch_load(path: str | os.PathLike) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's pickle-protocol notes are noise next to our error
            return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:  # missing, a folder, no permission: say that, not "corrupt"
        raise TrajectoryError(path, (e.strerror or str(e)).lower()) from None
    except Exception as e:
        # weights_only buries the reason in a long help text; its one useful line says which global.
        m = re.search(r"WeightsUnpickler error: ([^\n]*)", str(e))
        why = m.group(1) if m else (str(e).splitlines() or [""])[0][:200]
        raise TrajectoryError(path, f"not a torch.save file of plain data, or truncated/corrupt "
                                    f"({type(e).__name__}: {why})") from None


def save_trajectories(path: str | os.PathLike, groups: list[list[Sample]], rollout_id: int | None) -> Path:
    """Write ``groups`` atomically as a trajectory file (module docstring)."""
    plain = samples_to_plain(groups, rollout_id)
    return atomic_write(path, lambda f: torch.save(plain, f))


def load_trajectories(path: str | os.PathLike) -> tuple[int | None, list[list[Sample]]]:
    """``(rollout_id, groups)`` of a trajectory file; any problem is one TrajectoryError naming it."""
    data = _torch_load(path)
    return _check_header(data, FORMAT, path)["rollout_id"], plain_to_samples(data, str(path))


# ---- mid-rollout checkpoints ---------------------------------------------------------------------

_STATE, _GROUP = "rayapp.rollout_checkpoint.state", "rayapp.rollout_checkpoint.group"
_FINISHED, _DONE = "rayapp.rollout_checkpoint.finished", "FINISHED"
_GROUP_RE = re.compile(r"^group_(\d{6,})\.pt$")


@dataclass
class ResumeState:
    """What ``RolloutCheckpoint.resume`` found: the source state at begin() and the finished groups."""

    rollout_id: int
    source_state: dict
    groups: dict[int, list[Sample]] = field(default_factory=dict)  # finished groups by index, sorted

    def missing(self, n: int) -> list[int]:
        """The indices in ``range(n)`` still to run."""
        return [i for i in range(n) if i not in self.groups]


class RolloutCheckpoint:
    """Durable progress of a rollout, so a replica killed mid-way resumes without re-running
    finished groups and without losing or duplicating one. Layout, one folder per rollout::

        {dir}/rollout_{id:06d}/state.pt          data source state at begin() (written first)
        {dir}/rollout_{id:06d}/group_{i:06d}.pt  one per finished group, each written atomically;
                                                 pruned once two later rollouts began
        {dir}/rollout_{id:06d}/FINISHED          finish() was called: never resumed; holds the
                                                 source state after the fetch (next_source_state)

    Protocol: ``st = ckpt.resume(id)``; if None, ``ckpt.begin(id, source.state_dict())`` and fetch,
    else ``source.load_state_dict(st.source_state)``, fetch the same tasks and run only
    ``st.missing(n)``; ``record_group`` as each group finishes; ``finish(id, source.state_dict())``
    at the end. ``TaskScheduler(checkpoint=...)`` follows this protocol.
    A group file that cannot be read (damaged on disk) is skipped with a warning and re-run; a
    group of another ``begin`` (a stale writer) is skipped the same way. Each call does blocking
    I/O with fsync: on a busy event loop, call it through ``asyncio.to_thread``."""

    def __init__(self, dir: str | os.PathLike):
        self.dir = Path(dir)
        self._run: dict[int, str] = {}  # rollout id -> token of the begin() its groups belong to
        self._done: dict[int, set[int]] = {}

    def folder(self, rollout_id: int) -> Path:
        if type(rollout_id) is not int or rollout_id < 0:
            raise ValueError(f"rollout_id must be an int >= 0, got {rollout_id!r}")
        return self.dir / f"rollout_{rollout_id:06d}"

    def begin(self, rollout_id: int, source_state: dict) -> None:
        """Start ``rollout_id`` afresh, discarding any earlier checkpoint of it."""
        folder = self.folder(rollout_id)
        state = {"format": _STATE, "version": VERSION, "rollout_id": rollout_id, "run": uuid.uuid4().hex,
                 "source_state": _plain(source_state, ("source_state",))}
        # state.pt goes first and comes back last: a crash in between leaves no state, so no resume.
        if folder.exists():
            (folder / "state.pt").unlink(missing_ok=True)
            fsync_dir(folder)
            shutil.rmtree(folder)
        atomic_write(folder / "state.pt", lambda f: torch.save(state, f))
        self._run[rollout_id], self._done[rollout_id] = state["run"], set()
        self._prune(before=rollout_id - 1)

    def _prune(self, before: int) -> None:
        """Drop the group files of finished rollouts older than ``before``: the trainer asked for later
        steps since, and kept copies would double the run's disk use. Their state and FINISHED stay."""
        for folder in self.dir.glob("rollout_*"):
            m = re.fullmatch(r"rollout_(\d{6,})", folder.name)
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
        data = {"format": _GROUP, "version": VERSION, "rollout_id": rollout_id, "run": self._run[rollout_id],
                "index": index, "groups": samples_to_plain([group])["groups"]}
        atomic_write(folder / f"group_{index:06d}.pt", lambda f: torch.save(data, f))
        self._done[rollout_id].add(index)

    def finish(self, rollout_id: int, next_source_state: dict | None = None) -> None:
        """Mark ``rollout_id`` complete: ``resume`` returns None for it from now on. The source's
        state after the step's fetch lets a restarted manager continue the stream (``next_source_state``)."""
        folder = self.folder(rollout_id)
        if not (folder / "state.pt").exists():
            raise ValueError(f"rollout {rollout_id}: finish() without begin()")
        done = {"format": _FINISHED, "version": VERSION, "rollout_id": rollout_id,
                "next_source_state": None if next_source_state is None
                else _plain(next_source_state, ("next_source_state",))}
        atomic_write(folder / _DONE, lambda f: torch.save(done, f))
        self._forget(rollout_id)

    def next_source_state(self, rollout_id: int) -> dict | None:
        """The data source's state after finished rollout ``rollout_id``'s fetch; None when it did
        not finish or saved none. A damaged marker is a TrajectoryError: continuing from the start
        instead would silently repeat data."""
        marker = self.folder(rollout_id) / _DONE
        if not marker.exists():
            return None
        done = _check_header(_torch_load(marker), _FINISHED, marker)
        state = done.get("next_source_state")
        if state is not None and not isinstance(state, dict):
            raise TrajectoryError(marker, "next_source_state is not a dict")
        return state

    def resume(self, rollout_id: int) -> ResumeState | None:
        """The saved source state and finished groups of an unfinished ``rollout_id``; None when it
        never began or finished. A damaged state.pt is a TrajectoryError (nothing to resume from)."""
        folder = self.folder(rollout_id)
        if not (folder / "state.pt").exists() or (folder / _DONE).exists():
            return None
        state = _check_header(_torch_load(folder / "state.pt"), _STATE, folder / "state.pt")
        run = state.get("run")
        if not isinstance(state.get("source_state"), dict) or state["rollout_id"] != rollout_id:
            raise TrajectoryError(folder / "state.pt", f"not the state of rollout {rollout_id}")
        groups: dict[int, list[Sample]] = {}
        for p in folder.iterdir():
            if not (m := _GROUP_RE.match(p.name)):
                continue  # state, marker, and temp files a crash left behind
            try:
                d = _check_header(_torch_load(p), _GROUP, p)
                if d.get("run") != run or d["rollout_id"] != rollout_id or d.get("index") != int(m.group(1)):
                    raise TrajectoryError(p, "belongs to another begin() of this rollout, or to another group")
                [group] = plain_to_samples({**d, "format": FORMAT}, str(p))
            except ValueError as e:  # a TrajectoryError, or not exactly one group
                log.warning("resume: skipping %s, its group will be re-run: %s", p, e)
                continue
            groups[d["index"]] = group
        self._run[rollout_id], self._done[rollout_id] = run, set(groups)
        return ResumeState(rollout_id, state["source_state"], dict(sorted(groups.items())))

    def _forget(self, rollout_id: int) -> None:
        self._run.pop(rollout_id, None)
        self._done.pop(rollout_id, None)

    def discard(self, rollout_id: int) -> None:
        """Remove ``rollout_id``'s checkpoint folder (e.g. after the trainer consumed it)."""
        shutil.rmtree(self.folder(rollout_id), ignore_errors=True)
        self._forget(rollout_id)

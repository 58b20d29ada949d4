"""Saved trajectories: the trainer's data (docs/scheduler.md §5; the reuse policy that chooses
between fresh and saved is ``reuse.py``, mid-rollout checkpoints are ``checkpoint.py``).

It exists so a step's samples can be saved and replayed as the trainer gets them: a file is
``torch.save`` of plain data (token data as tensors, for load time), read with
``torch.load(weights_only=True)``; the episode record travels as the spec's metadata keys and comes
back into ``Sample.episode`` on load. Invariants: ``plain_to_samples(samples_to_plain(g)) == g``, also
through save and load; a value that could not load is refused at save time; saving is atomic; a bad
file is one ``TrajectoryError`` naming it. The file format: docs/scheduler.md, "Reuse".
"""

from __future__ import annotations

import logging
import operator
import os
import re
import warnings
from pathlib import Path
from typing import Any

import msgspec
import torch

from rayapp.core.convert import InputError, convert
from rayapp.steps.atomic_files import atomic_write
from rayapp.trainers.converters import stored_sample, trainer_sample
from rayapp.types import Sample

log = logging.getLogger(__name__)

FORMAT, VERSION = "rayapp.trajectories", 1
_INT_FIELDS, _ARRAYS = ("tokens", "loss_mask"), ("tokens", "loss_mask", "rollout_log_probs")
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
_SCALARS = (type(None), bool, int, float, str)  # not bytes: b"" pickles as GLOBAL bytes, refused
_FIELDS = tuple(f for f in Sample.__struct_fields__ if f != "episode")  # the episode is in the metadata


class TrajectoryError(ValueError):
    """A trajectory file (or plain data) that cannot be read; names it and why."""

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
    """Type-check the non-array fields as Sample declares them, where all outside input is checked
    (it names the bad field); a TypeError like every other refusal here."""
    try:
        return convert({k: x for k, x in d.items() if k not in _ARRAYS}, Sample, where)
    except InputError as e:
        raise TypeError(str(e)) from None


def _sample_to_plain(s: Any, where: str) -> dict:
    if not isinstance(s, Sample):
        raise TypeError(f"{where}: expected a Sample, got {type(s).__name__}")
    s, out = trainer_sample(s), {}  # the trainer's data: its episode as the spec's metadata keys
    for name in _FIELDS:
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
    try:
        return stored_sample(s)
    except msgspec.ValidationError as e:  # the spec's keys not fitting the record (a string weight version)
        raise TypeError(f"{where}.metadata: {e}") from None


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
    return atomic_write(path, lambda f: torch.save(plain, f), what="trajectory file")


def load_trajectories(path: str | os.PathLike) -> tuple[int | None, list[list[Sample]]]:
    """``(rollout_id, groups)`` of a trajectory file; any problem is one TrajectoryError naming it."""
    data = _torch_load(path)
    return _check_header(data, FORMAT, path)["rollout_id"], plain_to_samples(data, str(path))

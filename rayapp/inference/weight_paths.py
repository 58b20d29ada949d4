"""Where ``update_weights_from_disk`` may read: every backend's weight update goes through
``checkpoint_files`` in the engine deployment (``rayapp.actors.engine``) before the backend sees
the path, so a trainer's path is confined to the folders the recipe names
(``engines.<name>.weight_roots``; unset: the served model folder's parent and
``scheduler.checkpoint_dir``) and nothing but a regular file is ever opened.

- The checkpoint is one ``.safetensors`` file, a folder with ``model.safetensors.index.json`` (its
  ``weight_map`` names the files), or a folder of ``*.safetensors``; its path is absolute.
- The checkpoint, its index and every file they name resolve, symlinks followed, inside one root;
  an index names files inside its own folder (plain relative names: no ``..``, no absolute path).
- Each file is looked at with ``os.lstat`` on its resolved path before anything opens it: a FIFO,
  a device, a socket or a folder where a file belongs is refused at once, never opened (opening a
  FIFO blocks until a writer comes: it froze an engine for ~100 s). The index is read non-blocking
  and bounded (``rayapp.core.regular_file``).

Any refusal is one ``WeightPathError`` naming the path and why, raised before a weight is read, so
the engine keeps serving the weights it had. Nothing here imports Ray or torch.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath

from rayapp.core.regular_file import read_regular

INDEX = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20  # an index lists tensor names: megabytes for the largest models
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symlink"))


class WeightPathError(ValueError):
    """A weight path refused: ``weights at '<path>' refused: <why>``."""

    def __init__(self, path: object, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"weights at {path!r} refused: {reason}")

    def __reduce__(self) -> tuple:  # crosses Ray as itself
        return type(self), (self.path, self.reason)


def default_weight_roots(model_path: str | None, checkpoint_dir: str | None) -> list[str]:
    """The roots when a recipe names none: the folder holding the served model (a trainer saves its
    checkpoints beside it) and the run's checkpoint folder, where each exists as a path here."""
    roots = []
    if model_path and Path(model_path).expanduser().is_dir():
        roots.append(str(Path(model_path).expanduser().absolute().parent))
    if checkpoint_dir:
        roots.append(str(Path(checkpoint_dir).expanduser().absolute()))
    return roots


def checkpoint_files(path: str, roots: Sequence[str]) -> list[Path]:
    """The resolved safetensors files of the checkpoint at ``path``, each a regular file inside one of
    ``roots``; ``WeightPathError`` for anything else (module docstring)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise WeightPathError(path, "expected a non-empty path")
    if not Path(path).is_absolute():
        raise WeightPathError(path, "expected an absolute path (a relative one depends on where the engine runs)")
    real_roots = [Path(os.path.realpath(r)) for r in roots]
    if not real_roots:
        raise WeightPathError(path, "this engine has no weight_roots: set engines.<name>.weight_roots in the recipe")
    real = _inside(path, Path(path), real_roots)
    mode = _lstat(path, real)
    if stat.S_ISREG(mode):
        if real.suffix != ".safetensors":
            raise WeightPathError(path, f"{str(real)!r} is not a .safetensors file (pickled checkpoints are refused)")
        files = [real]
    elif stat.S_ISDIR(mode):
        index = real / INDEX
        files = _index_files(path, real, real_roots) if os.path.lexists(index) else sorted(real.glob("*.safetensors"))
        if not files:
            raise WeightPathError(path, f"no .safetensors files in {str(real)!r} (pickled checkpoints are refused)")
    else:
        raise WeightPathError(path, f"{str(real)!r} is {_kind(mode)}, not a file or a folder")
    return [_regular(path, f, real_roots) for f in files]


def _index_files(path: str, folder: Path, roots: list[Path]) -> list[Path]:
    """The files an index's ``weight_map`` names, each a plain name inside ``folder``."""
    index = _regular(path, folder / INDEX, roots)
    try:
        weight_map = json.loads(read_regular(index, MAX_INDEX_BYTES))["weight_map"]
        names = set(weight_map.values()) if isinstance(weight_map, dict) else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightPathError(path, f"{str(index)!r} is not a safetensors index with a weight_map: {e}") from None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise WeightPathError(path, f"{str(index)!r}: weight_map must map tensor names to file names")
    for name in sorted(names):
        parts = PurePosixPath(name).parts
        if PurePosixPath(name).is_absolute() or ".." in parts or "\0" in name:
            raise WeightPathError(path, f"{str(index)!r} names {name!r}, outside its folder")
    return [folder / n for n in sorted(names)]


def _regular(path: str, file: Path, roots: list[Path]) -> Path:
    """``file`` resolved: inside a root and a regular file (looked at, not opened)."""
    real = _inside(path, file, roots)
    mode = _lstat(path, real)
    if not stat.S_ISREG(mode):
        raise WeightPathError(path, f"{str(file)!r} is {_kind(mode)}, not a regular file")
    return real


def _inside(path: str, file: Path, roots: Iterable[Path]) -> Path:
    real = Path(os.path.realpath(file))
    if not any(real == r or real.is_relative_to(r) for r in roots):
        shown = f"{str(file)!r}" + (f" (resolving to {str(real)!r})" if real != file else "")
        raise WeightPathError(path, f"{shown} is outside the engine's weight_roots "
                                    f"{[str(r) for r in roots]} (engines.<name>.weight_roots)")
    return real


def _lstat(path: str, real: Path) -> int:
    try:
        return os.lstat(real).st_mode
    except OSError as e:
        raise WeightPathError(path, f"{str(real)!r}: {e.strerror or e}") from None


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")

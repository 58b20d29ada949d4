"""A tokenizer's files, carried from the node where an engine loaded its model to the node where the
agents run.

The engine replica reads the files next to its checkpoint (``read_tokenizer_files``); the manager,
which usually runs on a node that holds no checkpoint (the head), writes them into a folder of its
own cache named by their digest (``cache_tokenizer_files``) and loads the tokenizer from there. So
agents tokenize with exactly the files the engine uses, and a recipe never has to say where models
live on nodes without an engine.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from pathlib import Path, PurePosixPath

# Weights and other large artifacts that are never part of a tokenizer.
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx",
                             ".npz", ".tflite", ".ot"})
MAX_FILE_BYTES = 64 << 20    # a large tokenizer.json is ~10-30 MB
MAX_TOTAL_BYTES = 256 << 20  # what one call may carry through Ray's object store
MAX_DEPTH = 2                # top level, and one folder down (additional_chat_templates/, original/)


class TokenizerFilesError(ValueError):
    """A tokenizer folder that cannot be carried, or a file set that cannot be written; names why."""


def local_folder(name: str | os.PathLike) -> Path | None:
    """``name`` as a folder on this node: itself, or, for a Hugging Face id the engine downloaded,
    its snapshot in this node's hub cache; None when neither is here."""
    if Path(name).is_dir():
        return Path(name)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(os.fspath(name), local_files_only=True))
    except Exception:  # not an id, not cached, or no huggingface_hub: nothing local to carry
        return None


def read_tokenizer_files(folder: str | os.PathLike) -> dict[str, bytes]:
    """The files of the model folder ``folder`` (or cached hub id, ``local_folder``) a tokenizer may
    read, by relative POSIX path: every regular file up to ``MAX_DEPTH`` levels deep except weights
    (by suffix) and hidden files. Empty when there is no such folder here (the agents then load the
    tokenizer by that name)."""
    root = local_folder(folder)
    if root is None:
        return {}
    files: dict[str, bytes] = {}
    total = 0
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if (len(rel.parts) > MAX_DEPTH or any(p.startswith(".") for p in rel.parts)
                or path.suffix.lower() in WEIGHT_SUFFIXES or not path.is_file()):  # is_file follows links
            continue
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            continue  # not a tokenizer file at this size (a weight shard under another name)
        total += size
        if total > MAX_TOTAL_BYTES:
            raise TokenizerFilesError(f"{root}: more than {MAX_TOTAL_BYTES >> 20} MiB of non-weight files; "
                                      "point the engine's tokenizer_path at a folder holding only the tokenizer")
        files[rel.as_posix()] = path.read_bytes()
    return files


def _checked_name(name: str) -> PurePosixPath:
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts or len(rel.parts) > MAX_DEPTH or "\\" in name:
        raise TokenizerFilesError(f"refusing tokenizer file name {name[:200]!r}: not a plain relative path")
    return rel


def files_digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        data = files[name]
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def cache_tokenizer_files(files: dict[str, bytes], cache_root: str | os.PathLike) -> Path:
    """``files`` written under ``cache_root/<digest>`` (once: a folder of that name already holds exactly
    these files) and that folder's path. Written to a temporary folder and renamed into place, so a
    reader never sees half a tokenizer and concurrent writers agree."""
    names = {name: _checked_name(name) for name in files}
    dest = Path(cache_root) / files_digest(files)[:32]
    if dest.is_dir():
        return dest
    tmp = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex}"
    try:
        tmp.mkdir(parents=True)
        for name, rel in names.items():
            target = tmp.joinpath(*rel.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(files[name])
        try:
            tmp.rename(dest)
        except OSError:
            if not dest.is_dir():  # not a writer that got there first: a real failure
                raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(tmp)
    return dest

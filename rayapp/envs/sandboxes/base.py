"""The sandbox interface agents and verifiers act through.

A sandbox is one isolated working folder with a command runner. Every call is bounded in time.
Faults surface as the core's exception types, so ``classify_abort`` reads them: a command that runs
past its wall clock raises ``AgentTimeout`` only when the caller asks (``check_timeout=True``),
otherwise the result says ``timed_out``; a sandbox that crashed, was killed, was closed or lost its
folder raises ``SandboxError``. What a command does to itself (non-zero exit, killed by a signal or
by its memory limit) is the command's outcome and is only reported in ``ExecResult``.

Paths handed to ``write_file``/``read_file`` are relative to ``workdir`` (absolute paths are accepted
only when they lie inside it); one that leaves the folder raises ``ValueError``.
"""

from __future__ import annotations

import math
import posixpath
from typing import Protocol

import msgspec


class SandboxLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one sandbox may use. ``cpu`` and ``memory_gb`` normally come from the sample's run
    resource; ``None`` means the backend's default."""

    cpu: float | None = None  # cores (docker --cpus); CPU time per command is cpu_seconds
    memory_gb: float | None = None  # address-space / container memory limit
    cpu_seconds: int | None = 60  # RLIMIT_CPU per command
    wall_seconds: float = 60.0  # per command; the whole process group is killed after it
    max_open_files: int = 256
    max_processes: int = 128  # per sandbox user where the kernel enforces it
    max_output_bytes: int = 1 << 20  # stdout/stderr kept per command
    network: bool = False
    max_file_bytes: int | None = 1 << 30  # RLIMIT_FSIZE: the largest file a command may write

    def __post_init__(self) -> None:
        # Constructors do not type-check (msgspec); a zero or negative limit would silently mean
        # "kill everything at once" or "no limit" depending on the backend, so refuse it here.
        for field in ("cpu", "memory_gb", "cpu_seconds", "max_file_bytes"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"SandboxLimits.{field} must be > 0 or None, got {value!r}")
        for field in ("wall_seconds", "max_open_files", "max_processes", "max_output_bytes"):
            if not getattr(self, field) > 0:
                raise ValueError(f"SandboxLimits.{field} must be > 0, got {getattr(self, field)!r}")


DEFAULT_LIMITS = SandboxLimits()  # frozen: safe to share as an argument default


class ExecResult(msgspec.Struct, frozen=True):
    exit_code: int  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_s: float = 0.0
    truncated: bool = False  # stdout or stderr went past max_output_bytes; the rest was dropped

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Sandbox(Protocol):
    """One isolated working folder. ``workdir`` is the path commands start in. ``start`` is
    idempotent and returns the sandbox; the other calls start it on first use."""

    workdir: str
    network_isolated: bool

    async def start(self) -> Sandbox: ...

    async def exec(self, command: str | list[str], *, timeout_s: float | None = None, stdin: str | None = None,
                   check_timeout: bool = False) -> ExecResult: ...

    async def write_file(self, path: str, content: str | bytes) -> None: ...

    async def read_file(self, path: str) -> str: ...

    async def close(self) -> None: ...


def thread_env(limits: SandboxLimits) -> dict[str, str]:
    """Thread-pool sizes for numeric libraries. Left alone, OpenBLAS/OpenMP start one thread per core
    of the node, which runs into ``max_processes`` (threads count) on a large node and ignores ``cpu``."""
    n = str(max(1, math.ceil(limits.cpu or 1)))
    return {"OMP_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def relative_inside(workdir: str, path: str) -> str:
    """``path`` as a normalised path relative to ``workdir``, or ``ValueError`` if it leaves it.

    Purely lexical (no symlinks are looked at): backends that can see the file system add their
    own symlink check on top."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"bad sandbox path {path!r}")
    root = posixpath.normpath(workdir)
    full = posixpath.normpath(posixpath.join(root, path))  # an absolute path replaces root here
    if full == root:
        raise ValueError(f"sandbox path {path!r} names the working folder itself, not a file")
    if not full.startswith(root.rstrip("/") + "/"):
        raise ValueError(f"sandbox path {path!r} leaves the working folder {workdir}")
    return full[len(root.rstrip("/")) + 1:]

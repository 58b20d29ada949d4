"""Host-side pieces of process isolation, shared by ``LocalProcessSandbox``: launching the
trampoline (``_launch.py``), per-sandbox uids, killing by process group and by uid, and cleanup.

Guarantees: a uid from ``allocate_uid`` is held by one sandbox on this machine at a time (an flock the
kernel drops if the holder dies) and never belongs to a login account; ``cleanup`` is idempotent,
synchronous and safe to run as a finalizer: it kills every process group the sandbox still runs and,
for an exclusive uid, every process of that uid, then deletes the sandbox's folder and its files in
the shared temporary folders, then frees the uid.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import grp
import json
import logging
import os
import pwd
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from rayapp.core.termination import SandboxError

log = logging.getLogger(__name__)

LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launch.py")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
UID_RANGE = range(61184, 65520)  # systemd's dynamic users: no login account lives here
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # world-writable: swept of the sandbox uid's files
_PROBE_UID = 65534  # nobody: only used to learn whether this process may switch users

_probe_result: dict[str, str | None] | None = None
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


@dataclass
class SandboxState:
    """What ``close`` (or the finalizer, if the sandbox is dropped unclosed) must undo. It holds no
    reference to the sandbox, so the finalizer can run when the sandbox is collected."""

    base: str | None = None
    uid: int | None = None  # exclusive uid: every process of it belongs to this sandbox
    lock_fd: int | None = None
    pgids: set[int] = field(default_factory=set)
    done: bool = False


def launcher_argv(spec: dict, status_fd: int, argv: list[str]) -> list[str]:
    # -I: ignore PYTHON* variables and the user's site; -S: no site import (faster, nothing to trust)
    return [sys.executable, "-I", "-S", "-B", LAUNCH, json.dumps(spec), str(status_fd), "--", *argv]


def killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def count_processes(uid: int) -> int:
    """Processes whose /proc entry ``uid`` owns (their effective uid)."""
    count = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                count += os.stat(f"/proc/{pid}").st_uid == uid
    return count


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``, from a helper that becomes that uid (see _launch.py)."""
    subprocess.run(launcher_argv({"kill_uid": uid}, -1, []), env={"PATH": DEFAULT_PATH}, timeout=30,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def sweep_shared_tmp(uid: int) -> None:
    for folder in SHARED_TMP:
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid != uid:
                        continue
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        os.unlink(entry.path)


def cleanup(state: SandboxState) -> None:
    """Kill, delete, release; idempotent and synchronous (it also runs as a finalizer)."""
    if state.done:
        return
    state.done = True
    for pgid in list(state.pgids):
        killpg(pgid)
    if state.uid is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            kill_uid(state.uid)
        sweep_shared_tmp(state.uid)
    if state.base is not None:
        shutil.rmtree(state.base, ignore_errors=True)
    if state.lock_fd is not None:
        os.close(state.lock_fd)  # releases the uid's flock


def _uid_lock_dir() -> str:
    path = "/run/rayapp-sandbox-uids" if os.access("/run", os.W_OK) else f"{tempfile.gettempdir()}/.rayapp-sandbox-uids"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    # In a world-writable parent someone else could have made it first; their locks would be theirs.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxError(f"sandbox uid lock folder {path} is not a private folder of uid {os.geteuid()}")
    return path


def allocate_uid() -> tuple[int, int]:
    """(uid, fd holding its flock). The lock is per machine, so concurrent workers never share a
    uid, and it is released by the kernel if this process dies."""
    lock_dir = _uid_lock_dir()
    start = random.randrange(len(UID_RANGE))
    for i in range(len(UID_RANGE)):
        uid = UID_RANGE[(start + i) % len(UID_RANGE)]
        with contextlib.suppress(KeyError):
            pwd.getpwuid(uid)
            continue  # a real account
        with contextlib.suppress(KeyError):
            grp.getgrgid(uid)
            continue
        fd = os.open(f"{lock_dir}/{uid}", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return uid, fd
    raise SandboxError(f"no free sandbox uid in {UID_RANGE.start}-{UID_RANGE.stop - 1}")


async def probe() -> dict[str, str | None]:
    """Which isolation steps this process may take: {"net"|"mount"|"pid"|"user": error or None}.
    Asked once per process, by a real launch, since only trying tells (seccomp, missing caps)."""
    global _probe_result
    if _probe_result is None:
        root = os.geteuid() == 0
        spec = {"probe": True, "uid": _PROBE_UID if root else None, "gid": _PROBE_UID}
        r, w = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(*launcher_argv(spec, w, []), pass_fds=(w,),
                                                        env={"PATH": DEFAULT_PATH}, stdin=subprocess.DEVNULL)
            os.close(w)
            w = -1
            await asyncio.wait_for(proc.wait(), 30)
            report = json.loads(os.read(r, 65536) or b"{}")
        except (OSError, ValueError, TimeoutError) as e:
            raise SandboxError(f"sandbox launcher {LAUNCH} failed to start: {e}") from e
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)
        if not root:
            report["user"] = "not running as root"
        missing = "not reported by the launcher"
        _probe_result = {key: report.get(key, missing) for key in ("net", "mount", "pid", "user")}
    return _probe_result


SYSTEM_PREFIXES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # in every sandbox's root


def runtime_prefixes(path: str) -> list[str]:
    """Folders outside the system's own that commands need read-only: the prefix (the folder above
    ``bin``) of each PATH entry and of the python3 it finds (a pyenv or conda Python is a symlink
    chain out of PATH). The default PATH needs none; a venv or conda PATH opens exactly that prefix
    (one under /tmp or /var/tmp too: it is placed inside the sandbox's own tmp)."""
    entries = [entry for entry in path.split(os.pathsep) if entry]
    python = shutil.which("python3", path=path)
    if python:
        entries.append(os.path.dirname(os.path.realpath(python)))
    out: list[str] = []
    for entry in entries:
        real = os.path.realpath(entry)
        if not os.path.isdir(real) or any(real == p or real.startswith(p + "/") for p in SYSTEM_PREFIXES):
            continue
        prefix = os.path.dirname(real) if os.path.basename(real) == "bin" else real
        if prefix != "/" and prefix not in out:
            out.append(prefix)
    return out


# -- folders: the owner stamp, stale folders --------------------------------------------------------

FOLDER_PREFIX = "rayapp-sbx-"
OWNER_FILE = "owner"  # "<pid> <start time>" of the host process that made the folder
_swept: set[str] = set()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid it
    names one process, so a pid reused after a crash is not taken for the old owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_stamp() -> str:
    return f"{os.getpid()} {_start_time(os.getpid())}"


def _owner_alive(stamp: str) -> bool:
    try:
        pid, started = stamp.split()
        return _start_time(int(pid)) == started
    except ValueError:
        return False


def sweep_stale_folders(root: str) -> list[str]:
    """Delete sandbox folders under ``root`` whose owner process is gone (a host SIGKILLed before
    ``close``). Once per process and root; only folders this user made; a folder still being set up
    (no owner stamp yet) is left alone. Their uids' processes need nothing here: a uid's flock died
    with the owner and its next holder kills what is left."""
    root = os.path.realpath(root)
    if root in _swept:
        return []
    _swept.add(root)
    removed = []
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            if not entry.name.startswith(FOLDER_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                    continue
                with open(os.path.join(entry.path, OWNER_FILE)) as f:
                    stamp = f.read()
                if not _owner_alive(stamp):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(entry.path)
    if removed:
        log.info("removed %d stale sandbox folder(s) under %s", len(removed), root)
    return removed

"""A sandbox made of plain processes on this node: ``LocalProcessSandbox``.

It exists so an agent's commands can run on a node without Docker, each sandbox apart from the
worker and from the others: its own folder and uid, commands in their own process group under
rlimits and a wall clock, and (where the kernel allows) their own network, mount and PID
namespaces. Invariant: every guarantee is kept by the kernel, not by the command's politeness, and
``isolation`` names exactly the ones in force. Not a boundary against kernel exploits: untrusted code
belongs in Docker with gVisor, or a VM. The guarantees in full: docs/reliability.md, "The local
sandbox's view of the machine".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import pwd
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
import weakref

from rayapp.core.termination import AgentTimeout, SandboxError
from rayapp.envs.sandboxes._host import (
    DEFAULT_PATH,
    FOLDER_PREFIX,
    OWNER_FILE,
    SandboxState,
    allocate_uid,
    cleanup,
    count_processes,
    kill_uid,
    killpg,
    launcher_argv,
    owner_stamp,
    probe,
    runtime_prefixes,
    sweep_shared_tmp,
    sweep_stale_folders,
    warn_once,
)
from rayapp.envs.sandboxes._proc import communicate
from rayapp.envs.sandboxes.base import DEFAULT_LIMITS, ExecResult, SandboxLimits, relative_inside, thread_env

SHM_BYTES = 64 << 20  # each command's private /dev/shm (Docker's default size)
DEFAULT_MEMORY_GB = 4.0  # address space per process when the run resource names none
MAX_READ_BYTES = 64 << 20  # read_file refuses bigger files rather than filling the worker's memory


class LocalProcessSandbox:
    """A folder plus a command runner on this node, isolated as the module docstring says.

    ``user``: None picks an exclusive uid when running as root (the current user otherwise); a name
    or number runs as that user instead (shared, so nothing is killed by uid). ``env`` adds variables
    to the scrubbed environment; ``path`` is its PATH. Use ``async with``, or ``await start()`` and
    ``await close()``; the other calls start it on first use."""

    def __init__(self, limits: SandboxLimits = DEFAULT_LIMITS, root: str | None = None, name: str = "", *,
                 user: int | str | None = None, env: dict[str, str] | None = None, path: str = DEFAULT_PATH) -> None:
        self.limits, self.root, self.name = limits, root, re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40]
        self.user, self.extra_env, self.path = user, dict(env or {}), path
        self.workdir = ""
        self.network_isolated = False
        self.uid: int | None = None  # the uid commands run as; None: this process's own
        self._gid: int | None = None
        self._state = SandboxState()
        self._finalizer: weakref.finalize | None = None
        self._started = self._closed = False
        self._start_lock = asyncio.Lock()
        self._env: dict[str, str] = {}
        self._real_workdir = ""
        self._shell = "/bin/sh"
        self._root: dict | None = None
        self._own_pids = False
        self.isolation: frozenset[str] = frozenset()  # of "user", "network", "filesystem", "processes"

    async def __aenter__(self) -> LocalProcessSandbox:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"LocalProcessSandbox({self.name!r}, workdir={self.workdir!r}, uid={self.uid})"

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> LocalProcessSandbox:
        async with self._start_lock:
            if self._closed:
                raise SandboxError(f"sandbox {self.name!r} is closed")
            if not self._started:
                allowed = await probe()
                try:
                    self._setup(allowed)
                except BaseException:
                    cleanup(self._state)
                    raise
                self._started = True
        return self

    def _setup(self, allowed: dict[str, str | None]) -> None:
        state = self._state
        self._finalizer = weakref.finalize(self, cleanup, state)
        if allowed["user"] is None:
            if self.user is None:
                state.uid, state.lock_fd = allocate_uid()
                self.uid, self._gid = state.uid, state.uid
                if count_processes(self.uid):  # left by a holder that crashed
                    kill_uid(self.uid)
                sweep_shared_tmp(self.uid)
            else:
                entry = pwd.getpwnam(self.user) if isinstance(self.user, str) else None
                self.uid = entry.pw_uid if entry else int(self.user)
                self._gid = entry.pw_gid if entry else self.uid
        elif self.user is not None:
            raise ValueError(f"cannot run sandbox commands as {self.user!r}: {allowed['user']}")
        else:
            warn_once("user", f"sandbox commands run as this process's own uid {os.geteuid()} ({allowed['user']}): "
                               "no per-sandbox user, so RLIMIT_NPROC also counts this user's other processes")
        try:
            root = self.root or tempfile.gettempdir()
            os.makedirs(root, exist_ok=True)
            sweep_stale_folders(root)
            state.base = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{self.name or 'x'}-", dir=root)
            self.workdir, tmp = os.path.join(state.base, "work"), os.path.join(state.base, "tmp")
            for folder in (self.workdir, tmp):
                os.mkdir(folder, 0o700)
                if self.uid is not None:
                    os.chown(folder, self.uid, self._gid)
            os.mkdir(os.path.join(state.base, "root"), 0o700)  # where each command's root is built
            stamp = os.path.join(state.base, OWNER_FILE)
            with open(stamp + ".new", "w") as f:
                f.write(owner_stamp())
            os.replace(stamp + ".new", stamp)  # whole or absent: another host's sweep never reads it empty
            os.chmod(state.base, 0o711)  # the sandbox user may pass through to its folders, not list or write
        except OSError as e:
            raise SandboxError(f"sandbox {self.name!r}: cannot create its folder under {self.root}: {e}") from e
        self._real_workdir = os.path.realpath(self.workdir)
        if self.limits.network:
            self.network_isolated = False
        elif allowed["net"] is None:
            self.network_isolated = True
        else:
            warn_once("net", f"sandbox network isolation is unavailable ({allowed['net']}): sandbox commands run "
                              "WITH the node's network (network_isolated=False)")
        self._root = self._root_spec(allowed, tmp)
        self._own_pids = self._root is not None and allowed.get("pid") is None
        if self._root is not None and not self._own_pids:
            warn_once("pid", f"no PID namespace for sandboxes ({allowed.get('pid')}): commands see every process of "
                             "the node and its command line (isolation lacks 'processes')")
        self.isolation = frozenset(name for name, on in (
            ("user", self.uid is not None and self.user is None), ("network", self.network_isolated),
            ("filesystem", self._root is not None), ("processes", self._own_pids)) if on)
        self._shell = shell = shutil.which("bash", path=self.path) or "/bin/sh"
        self._env = {"PATH": self.path, "HOME": self.workdir, "PWD": self.workdir, "TMPDIR": tmp,
                     "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb", "SHELL": shell, **thread_env(self.limits),
                     **self.extra_env}

    def _root_spec(self, allowed: dict[str, str | None], tmp: str) -> dict | None:
        """What the launcher builds each command's root from (see _newroot.py)."""
        if allowed.get("mount") is not None:
            warn_once("mount", f"no mount namespace for sandboxes ({allowed['mount']}): commands see the host's files, "
                               "/tmp, /dev/shm and /run/lock (isolation lacks 'filesystem'; TMPDIR and HOME still "
                               "point into the sandbox)")
            return None
        base = os.path.realpath(self._state.base or "")
        return {"stage": os.path.join(base, "root"), "base": base, "tmp": os.path.realpath(tmp),
                "ro": runtime_prefixes(self.path), "shm_bytes": SHM_BYTES}

    async def close(self) -> None:
        """Kill every process, delete the folder, free the uid. Idempotent."""
        self._closed = True
        if self._finalizer is not None and self._finalizer.alive:
            await asyncio.to_thread(self._finalizer)  # runs cleanup once

    def _check_usable(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.name!r} is closed")
        if not os.path.isdir(self.workdir):
            raise SandboxError(f"sandbox {self.name!r}: its working folder {self.workdir} vanished")

    # -- commands ---------------------------------------------------------------------------------

    def _rlimits(self) -> list[tuple[str, int | list[int]]]:
        lim = self.limits
        nproc = lim.max_processes
        if self.uid is None:
            # Our own uid: the kernel counts all of this user's processes (Ray's included), so the
            # budget is on top of what is already running.
            nproc += count_processes(os.geteuid())
        out: list[tuple[str, int | list[int]]] = [
            ("RLIMIT_NOFILE", lim.max_open_files), ("RLIMIT_NPROC", nproc), ("RLIMIT_CORE", 0),
            ("RLIMIT_AS", int((lim.memory_gb or DEFAULT_MEMORY_GB) * (1 << 30)))]
        if lim.cpu_seconds is not None:
            # SIGXCPU at the soft limit (a runtime may report it), SIGKILL one CPU-second later.
            out.append(("RLIMIT_CPU", [lim.cpu_seconds, lim.cpu_seconds + 1]))
        if lim.max_file_bytes is not None:
            out.append(("RLIMIT_FSIZE", lim.max_file_bytes))
        return out

    async def exec(self, command: str | list[str], *, timeout_s: float | None = None, stdin: str | None = None,
                   check_timeout: bool = False) -> ExecResult:
        """Run ``command`` (a string goes to bash -c; a list is argv) in the working folder."""
        await self.start()
        self._check_usable()
        argv = [self._shell, "-c", command] if isinstance(command, str) else [str(a) for a in command]
        if not argv:
            raise ValueError("empty command")
        wall = self.limits.wall_seconds if timeout_s is None else min(float(timeout_s), self.limits.wall_seconds)
        if not wall > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        spec = {"cwd": self.workdir, "rlimits": self._rlimits(), "uid": self.uid, "gid": self._gid,
                "isolate_network": self.network_isolated, "root": self._root, "isolate_pids": self._own_pids}
        r, w = os.pipe()
        # Non-blocking: a process forked (without exec) elsewhere in this worker at the wrong moment
        # could hold a copy of the write end, and the read below must not wait for it.
        os.set_blocking(r, False)
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *launcher_argv(spec, w, argv), pass_fds=(w,), env=self._env, start_new_session=True,
                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            except OSError as e:
                raise SandboxError(f"sandbox {self.name!r}: cannot spawn a command: {e}") from e
            finally:
                os.close(w)
            self._state.pgids.add(proc.pid)
            try:
                got = await communicate(proc, stdin=None if stdin is None else stdin.encode(), wall_s=wall,
                                        cap=self.limits.max_output_bytes, kill=lambda: killpg(proc.pid))
            finally:
                self._state.pgids.discard(proc.pid)
            # The launcher exec'd (closing its end) or exited: what it wrote, if anything, is there now.
            setup_error = ""
            if got.returncode is not None:
                with contextlib.suppress(BlockingIOError):
                    setup_error = os.read(r, 65536).decode(errors="replace")
        finally:
            os.close(r)
        if self._closed:
            raise SandboxError(f"sandbox {self.name!r} was closed while a command ran")
        if got.returncode is None:
            raise SandboxError(f"sandbox {self.name!r}: a killed command could not be reaped")
        if setup_error:
            raise SandboxError(f"sandbox {self.name!r}: {setup_error}")
        self._check_usable()
        if got.timed_out and check_timeout:
            # No command text here: classify_abort also reads messages, and a command may say "sandbox".
            raise AgentTimeout(f"command timed out after {wall:g}s of wall clock")
        return ExecResult(got.returncode, got.stdout.decode(errors="replace"), got.stderr.decode(errors="replace"),
                          timed_out=got.timed_out, duration_s=got.duration_s, truncated=got.truncated)

    # -- files ------------------------------------------------------------------------------------

    def _inside(self, path: str) -> str:
        """``path`` relative to the working folder after resolving symlinks; ValueError if it leaves."""
        rel = relative_inside(self.workdir, path)
        real = os.path.realpath(os.path.join(self._real_workdir, rel))
        if not real.startswith(self._real_workdir + os.sep):
            raise ValueError(f"sandbox path {path!r} resolves outside the working folder (a symlink)")
        return os.path.relpath(real, self._real_workdir)

    def _open_parent(self, rel: str, create: bool) -> tuple[int, str]:
        """An fd of the folder holding ``rel`` and the last name, opened one component at a time
        with O_NOFOLLOW, so a symlink swapped in after ``_inside`` checked the path is refused."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self._real_workdir, flags)
        except FileNotFoundError as e:
            raise SandboxError(f"sandbox {self.name!r}: its working folder {self.workdir} vanished") from e
        try:
            *folders, name = rel.split(os.sep)
            for part in folders:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                        if self.uid is not None:
                            os.chown(part, self.uid, self._gid, dir_fd=fd, follow_symlinks=False)
                sub = os.open(part, flags, dir_fd=fd)
                os.close(fd)
                fd = sub
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError) and e.errno in (errno.ELOOP, errno.ENOTDIR):  # a link or a file in the way
                raise ValueError(f"sandbox path {rel!r} goes through a symlink or a file: {e}") from e
            raise
        return fd, name

    def _write_sync(self, path: str, data: bytes) -> None:
        fd, name = self._open_parent(self._inside(path), create=True)
        tmp = f".{name[:200]}.{secrets.token_hex(4)}.part"
        try:
            out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view):]
                if self.uid is not None:
                    os.fchown(out, self.uid, self._gid)
            finally:
                os.close(out)
            # Replace the name, never write through it: a link planted there is replaced, not followed.
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise
        finally:
            os.close(fd)

    def _read_sync(self, path: str) -> str:
        fd, name = self._open_parent(self._inside(path), create=False)
        try:
            f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"sandbox path {path!r} is a symlink that changed while being read") from e
            raise
        finally:
            os.close(fd)
        try:
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"sandbox path {path!r} is not a regular file")
            if self.uid is not None and st.st_uid != self.uid:
                # Only what the sandbox user owns: a hard link to someone else's file is not read.
                raise ValueError(f"sandbox path {path!r} is not owned by the sandbox user")
            if st.st_size > MAX_READ_BYTES:
                raise ValueError(f"sandbox file {path!r} is {st.st_size} bytes, over {MAX_READ_BYTES}")
            chunks, size = [], 0
            while (chunk := os.read(f, 1 << 20)) and size <= MAX_READ_BYTES:
                chunks.append(chunk)
                size += len(chunk)
            if size > MAX_READ_BYTES:
                raise ValueError(f"sandbox file {path!r} grew past {MAX_READ_BYTES} bytes while being read")
            return b"".join(chunks).decode(errors="replace")
        finally:
            os.close(f)

    async def write_file(self, path: str, content: str | bytes) -> None:
        await self.start()
        self._check_usable()
        data = content.encode() if isinstance(content, str) else bytes(content)
        await asyncio.to_thread(self._write_sync, path, data)

    async def read_file(self, path: str) -> str:
        await self.start()
        self._check_usable()
        return await asyncio.to_thread(self._read_sync, path)

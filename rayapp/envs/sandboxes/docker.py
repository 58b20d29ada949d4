"""A sandbox in a Docker container: ``DockerSandbox``, for nodes with a Docker engine.

Guarantees:
- One container per sandbox (``docker run -d --rm --init ... sleep infinity``) with its limits from
  ``SandboxLimits``: ``--cpus`` (cpu), ``--memory`` = ``--memory-swap`` (memory_gb, no swap),
  ``--pids-limit`` (max_processes), ``--ulimit`` nofile/fsize/core, ``--network none`` unless
  ``limits.network``, ``no-new-privileges``. Only the variables given in ``env`` (plus HOME, LANG,
  TMPDIR) enter it; the worker's environment stays outside.
- Every docker call is bounded in time. A command runs under ``timeout -s KILL`` inside the
  container, which kills its whole process group; if even that does not return, the ``docker exec``
  client is killed and the group is killed from a second ``docker exec`` (its pgid is written to a
  file first). ``--init`` reaps what is killed.
- The container is removed on ``close`` (``docker rm -f``) and, if the sandbox is dropped unclosed,
  by a finalizer (also at interpreter exit).
- Faults: an engine that cannot be reached, a container that cannot start, died or was removed
  raises ``SandboxError``; what a command does is reported in ``ExecResult`` (a shell's 128+N exit is
  reported as -N, killed by signal N). ``check_timeout=True`` turns a wall-clock expiry into
  ``AgentTimeout``.
The image needs ``sh`` and ``timeout`` (GNU coreutils; busybox's does not kill the group, so there
a timed-out command's children live on until ``close``). These machines have no Docker engine: the
tests that need one skip with ``docker_available()``'s reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import posixpath
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import weakref

from rayapp.core.termination import AgentTimeout, SandboxError
from rayapp.envs.sandboxes._proc import Captured, communicate
from rayapp.envs.sandboxes.base import DEFAULT_LIMITS, ExecResult, SandboxLimits, relative_inside, thread_env

log = logging.getLogger(__name__)

ENGINE_CALL_S = 30.0  # docker rm / inspect / the in-container kill
EXEC_GRACE_S = 10.0  # docker exec's own overhead on top of the command's wall clock
MAX_READ_BYTES = 64 << 20
_NO_ENGINE = re.compile(r"Cannot connect to the Docker daemon|error during connect")
_ENGINE_ERROR = re.compile(r"^(Error response from daemon|Cannot connect to the Docker daemon|error during connect)",
                           re.M)

# Runs inside the container: $1 wall seconds, $2 CPU seconds, $3 pid file, then the argv. The pid of
# this shell becomes timeout's pid and, because timeout makes itself a process-group leader, the pgid
# to kill from outside if docker exec itself hangs. -s KILL: a command cannot trap its way past it.
_WRAP = 'echo $$ > "$3"; [ "$2" = none ] || ulimit -t "$2" 2>/dev/null; w=$1; shift 3; exec timeout -s KILL "$w" "$@"'
_SHELL = 'command -v bash >/dev/null 2>&1 && exec bash -c "$1"; exec sh -c "$1"'  # bash when the image has it
_READ = ('p=$(readlink -f -- "$1") || exit 4; case "$p" in "$2"/*) exec cat -- "$p";; esac; '
         'echo "path leaves the working folder" >&2; exit 3')
_WRITE = ('d=$(dirname -- "$1"); mkdir -p -- "$d" && r=$(cd -- "$d" && pwd -P) || exit 4; case "$r/" in "$2"/*) ;; '
          '*) echo "path leaves the working folder" >&2; exit 3;; esac; f="$r/$(basename -- "$1")"; '
          'rm -f -- "$f" 2>/dev/null; exec cat > "$f"')


def docker_available(docker: str = "docker", timeout_s: float = 5.0) -> tuple[bool, str]:
    """(True, server version) when ``docker info`` answers within ``timeout_s``; else (False, why)."""
    if shutil.which(docker) is None:
        return False, f"no Docker CLI ({docker!r} not on PATH)"
    try:
        got = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                             timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return False, f"no Docker engine: `{docker} info` did not answer within {timeout_s:g}s"
    except OSError as e:
        return False, f"no Docker engine: {e}"
    if got.returncode != 0 or not got.stdout.strip():
        why = (got.stderr.strip().splitlines() or [f"exit code {got.returncode}"])[-1]
        return False, f"no Docker engine: {why}"
    return True, f"Docker engine {got.stdout.strip()}"


def _remove(docker: str, container: str, bridge_dir: str = "") -> None:
    """``docker rm -f``, synchronously: the finalizer's (and close's) last word on the container (and
    on its bridge folder)."""
    if bridge_dir:
        shutil.rmtree(bridge_dir, ignore_errors=True)
    try:
        got = subprocess.run([docker, "rm", "-f", container], capture_output=True, text=True, timeout=ENGINE_CALL_S,
                             stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not remove sandbox container %s: %s", container, e)
        return
    if got.returncode != 0 and "No such container" not in got.stderr:
        log.warning("could not remove sandbox container %s: %s", container, got.stderr.strip())


class DockerSandbox:
    """A container plus ``docker exec``. Use ``async with``, or ``await start()`` / ``await close()``;
    the other calls start it on first use. ``run_args`` are extra ``docker run`` flags."""

    def __init__(self, image: str, limits: SandboxLimits = DEFAULT_LIMITS, docker: str = "docker", *,
                 name: str = "", workdir: str = "/workspace", env: dict[str, str] | None = None,
                 run_args: tuple[str, ...] = (), start_timeout_s: float = 300.0) -> None:
        self.image, self.limits, self.docker, self.workdir = image, limits, docker, posixpath.normpath(workdir)
        self.name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:40]
        self.container = f"rayapp-sbx-{self.name + '-' if self.name else ''}{secrets.token_hex(6)}"
        self.env = {"HOME": self.workdir, "LANG": "C.UTF-8", "TMPDIR": "/tmp", **thread_env(limits), **(env or {})}
        self.run_args, self.start_timeout_s = tuple(run_args), start_timeout_s
        self.network_isolated = not limits.network
        # a host folder mounted at the same path in the container: gateway bridges put their sockets there
        # (rayapp.envs.sandboxes.bridge); made at start, removed with the container
        self.bridge_dir = ""
        self._started = self._closed = False
        self._start_lock = asyncio.Lock()
        self._finalizer: weakref.finalize | None = None

    async def __aenter__(self) -> DockerSandbox:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def run_argv(self) -> list[str]:
        """The ``docker run`` command line this sandbox starts with."""
        lim = self.limits
        argv = [self.docker, "run", "-d", "--rm", "--init", "--name", self.container, "--label", "rayapp.sandbox=1",
                "--pids-limit", str(lim.max_processes), "--ulimit", f"nofile={lim.max_open_files}:{lim.max_open_files}",
                "--ulimit", "core=0", "--security-opt", "no-new-privileges", "-w", self.workdir]
        if not lim.network:
            argv += ["--network", "none"]
        if lim.cpu is not None:
            argv += ["--cpus", f"{lim.cpu:g}"]
        if lim.memory_gb is not None:
            memory = str(int(lim.memory_gb * (1 << 30)))
            argv += ["--memory", memory, "--memory-swap", memory]
        if lim.max_file_bytes is not None:
            argv += ["--ulimit", f"fsize={lim.max_file_bytes}:{lim.max_file_bytes}"]
        for key, value in self.env.items():
            argv += ["-e", f"{key}={value}"]
        if self.bridge_dir:
            argv += ["-v", f"{self.bridge_dir}:{self.bridge_dir}"]
        return [*argv, *self.run_args, "--entrypoint", "sleep", self.image, "infinity"]

    async def _docker(self, args: list[str], *, wall_s: float, stdin: bytes | None = None,
                      cap: int | None = None) -> Captured:
        """One docker CLI call in its own process group, bounded by ``wall_s``."""
        try:
            proc = await asyncio.create_subprocess_exec(
                self.docker, *args, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
        except OSError as e:
            raise SandboxError(f"docker sandbox {self.container}: cannot run {self.docker!r}: {e}") from e

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

        return await communicate(proc, stdin=stdin, wall_s=wall_s, cap=cap or self.limits.max_output_bytes, kill=kill)

    async def start(self) -> DockerSandbox:
        async with self._start_lock:
            if self._closed:
                raise SandboxError(f"docker sandbox {self.container} is closed")
            if self._started:
                return self
            # Registered before the run: a run that times out may still have made the container.
            self.bridge_dir = tempfile.mkdtemp(prefix="rayapp-gw-")
            os.chmod(self.bridge_dir, 0o711)  # its entries are reached by name only
            self._finalizer = weakref.finalize(self, _remove, self.docker, self.container, self.bridge_dir)
            try:
                got = await self._docker(self.run_argv()[1:], wall_s=self.start_timeout_s)
            except SandboxError:
                self._finalizer.detach()  # the CLI did not even run: there is no container to remove
                shutil.rmtree(self.bridge_dir, ignore_errors=True)
                raise
            if got.timed_out or got.returncode != 0:
                why = "timed out" if got.timed_out else got.stderr.decode(errors="replace").strip()
                if _NO_ENGINE.search(why):
                    self._finalizer.detach()  # no engine reached, so no container was made
                    shutil.rmtree(self.bridge_dir, ignore_errors=True)
                else:
                    await asyncio.to_thread(self._finalizer)
                raise SandboxError(f"docker sandbox: `docker run {self.image}` failed: {why}")
            self._started = True
        return self

    async def close(self) -> None:
        """Remove the container (and everything running in it). Idempotent."""
        self._closed = True
        if self._finalizer is not None and self._finalizer.alive:
            await asyncio.to_thread(self._finalizer)

    async def exec(self, command: str | list[str], *, timeout_s: float | None = None, stdin: str | None = None,
                   check_timeout: bool = False) -> ExecResult:
        """Run ``command`` (a string goes to bash -c, or sh -c without bash; a list is argv)."""
        argv = ["sh", "-c", _SHELL, "sh", command] if isinstance(command, str) else [str(a) for a in command]
        if not argv:
            raise ValueError("empty command")
        wall = self.limits.wall_seconds if timeout_s is None else min(float(timeout_s), self.limits.wall_seconds)
        if not wall > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        return await self._exec(argv, wall, None if stdin is None else stdin.encode(), check_timeout)

    async def _exec(self, argv: list[str], wall: float, stdin: bytes | None, check_timeout: bool,
                    cap: int | None = None) -> ExecResult:
        await self.start()
        if self._closed:
            raise SandboxError(f"docker sandbox {self.container} is closed")
        pidfile = f"/tmp/.rayapp-exec-{secrets.token_hex(6)}"
        cpu = str(self.limits.cpu_seconds) if self.limits.cpu_seconds is not None else "none"
        got = await self._docker(["exec", *(["-i"] if stdin is not None else []), "-w", self.workdir, self.container,
                                  "sh", "-c", _WRAP, "rayapp", f"{wall:g}", cpu, pidfile, *argv],
                                 wall_s=wall + EXEC_GRACE_S, stdin=stdin, cap=cap)
        if got.timed_out:  # docker exec itself hung: kill the command's group from inside
            await self._docker(["exec", self.container, "sh", "-c", f'kill -9 -- "-$(cat {pidfile})"'],
                               wall_s=ENGINE_CALL_S)
        stderr = got.stderr.decode(errors="replace")
        if self._closed:
            raise SandboxError(f"docker sandbox {self.container} was closed while a command ran")
        if got.returncode is None or (got.returncode != 0 and _ENGINE_ERROR.search(stderr)):
            raise SandboxError(f"docker sandbox {self.container}: {stderr.strip() or 'docker exec was lost'}")
        code = got.returncode
        if 128 < code <= 128 + 64:
            code = -(code - 128)  # the shell's way of saying "killed by signal N"
        timed_out = got.timed_out or (code == -signal.SIGKILL and got.duration_s >= wall)
        if timed_out and check_timeout:
            raise AgentTimeout(f"command timed out after {wall:g}s of wall clock")
        return ExecResult(code, got.stdout.decode(errors="replace"), stderr, timed_out=timed_out,
                          duration_s=got.duration_s, truncated=got.truncated)

    async def write_file(self, path: str, content: str | bytes) -> None:
        full = posixpath.join(self.workdir, relative_inside(self.workdir, path))
        data = content.encode() if isinstance(content, str) else bytes(content)
        res = await self._exec(["sh", "-c", _WRITE, "sh", full, self.workdir], self.limits.wall_seconds, data, False)
        self._raise_file_error(path, res)

    async def read_file(self, path: str) -> str:
        full = posixpath.join(self.workdir, relative_inside(self.workdir, path))
        res = await self._exec(["sh", "-c", _READ, "sh", full, self.workdir], self.limits.wall_seconds, None, False,
                               cap=MAX_READ_BYTES)
        self._raise_file_error(path, res)
        if res.truncated:
            raise ValueError(f"sandbox file {path!r} is over {MAX_READ_BYTES} bytes")
        return res.stdout

    @staticmethod
    def _raise_file_error(path: str, res: ExecResult) -> None:
        if res.ok:
            return
        if res.exit_code == 3:
            raise ValueError(f"sandbox path {path!r} resolves outside the working folder")
        if "No such file" in res.stderr:
            raise FileNotFoundError(f"sandbox file {path!r}: {res.stderr.strip()}")
        if "Is a directory" in res.stderr:
            raise IsADirectoryError(f"sandbox path {path!r} is a directory")
        raise OSError(f"sandbox file {path!r}: exit {res.exit_code}: {res.stderr.strip()}")

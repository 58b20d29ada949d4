"""The least-privilege way from a sandboxed command to its episode's gateway: ``GatewayBridge``.

It exists because a sandbox's commands run in a network namespace of their own, where the gateway
is out of reach, and it must stay so for everything else on the host. The bridge opens exactly one
way out:

    command ──TCP──▶ 127.0.0.1:<free port> in the sandbox's namespace   (_bridge_inner.py, the sandbox user)
              ──bytes──▶ Unix socket in the sandbox's own folder           (owned by the sandbox user, 0600)
              ──HTTP──▶ forwarder here ──TCP──▶ the gateway's host:port    (this module, this process)

Invariant: the forwarder passes only requests under the episode's own base path with a plain
``Content-Length`` body; the gateway's key check stays behind it. Local and Docker sandboxes:
docs/agents.md, "Bring an agent" (a program in a sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rayapp.core.termination import SandboxError
from rayapp.envs.sandboxes.base import ExecResult
from rayapp.envs.sandboxes.docker import DockerSandbox
from rayapp.envs.sandboxes.local import LocalProcessSandbox

CONNECT_TIMEOUT_S = 10.0  # to the gateway's proxy
CLOSE_TIMEOUT_S = 5.0  # for the connections' tasks to end once cancelled
MAX_SOCKET_PATH = 107  # sun_path, less its terminating NUL
INNER = (Path(__file__).with_name("_bridge_inner.py")).read_text()


async def exec_with_gateway(sandbox: Any, argv: list[str], base_url: str, key: str, *, timeout_s: float | None = None,
                            check_timeout: bool = False) -> ExecResult:
    """``sandbox.exec(argv)`` behind a ``GatewayBridge`` to ``base_url``. The bridge's host end must run
    where the sandbox's processes do: a sandbox kept elsewhere (``BundleSandbox``, in its bundle's
    actor) has its own ``exec_with_gateway``, which runs this there."""
    remote = getattr(sandbox, "exec_with_gateway", None)
    if remote is not None:
        return await remote(argv, base_url, key, timeout_s=timeout_s, check_timeout=check_timeout)
    if not isinstance(sandbox, LocalProcessSandbox | DockerSandbox):
        raise SandboxError(f"a {type(sandbox).__name__} has no gateway bridge: a command agent needs a local or "
                           "a docker sandbox")
    async with GatewayBridge(sandbox, base_url, key) as bridge:
        return await sandbox.exec(bridge.wrap(argv), timeout_s=timeout_s, check_timeout=check_timeout)


def _refusal(status: int, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": "bridge_refused"}}).encode()
    reason = {403: "Forbidden", 411: "Length Required", 400: "Bad Request", 431: "Request Header Fields Too Large",
              502: "Bad Gateway"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


def check_head(head: bytes, path: str) -> tuple[int, str] | int:
    """The body length of a request whose head may pass, or (status, why) refusing it."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return 400, "not an HTTP/1.x request line"
    target = parts[1].split("?", 1)[0]
    # No "..", no escapes: the target is compared as the gateway's router will read it.
    if not target.startswith(path + "/") or ".." in target or "%" in target:
        return 403, f"this sandbox reaches only its episode's gateway routes under {path}/"
    lengths = []
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "transfer-encoding":
            return 411, "send the body with a Content-Length (no Transfer-Encoding)"
        if name == "upgrade":  # what follows a switch of protocols would pass unread
            return 400, "no protocol upgrade through the gateway bridge"
        if name == "content-length":
            lengths.append(value.strip())
    if len(lengths) > 1 or (lengths and not lengths[0].isdigit()):
        return 400, "one Content-Length, a number"
    return int(lengths[0]) if lengths else 0


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


class GatewayBridge:
    """The host's end for one command of ``sandbox`` (a ``LocalProcessSandbox`` or a ``DockerSandbox``),
    speaking to ``base_url`` with ``key``. ``async with`` it around the command; ``wrap(argv)`` is what
    to run."""

    def __init__(self, sandbox: LocalProcessSandbox | DockerSandbox, base_url: str, key: str):
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname or not url.port:
            raise ValueError(f"gateway base URL {base_url!r}: expected http://host:port/path")
        self.sandbox, self.key = sandbox, key
        self.host, self.port, self.path = url.hostname, url.port, url.path.rstrip("/")
        self.folder = self.socket = ""  # at the same path inside the sandbox as here
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run behind the bridge, with OPENAI_BASE_URL / OPENAI_API_KEY in its environment."""
        if isinstance(self.sandbox, DockerSandbox):
            python = "python3"  # the image's, found on the container's PATH
        else:
            python = shutil.which("python3", path=self.sandbox.path)
            if python is None:
                raise SandboxError(f"no python3 on the sandbox's PATH {self.sandbox.path!r} to run its gateway bridge")
        return [python, "-I", "-S", "-c", INNER, self.socket, os.path.join(self.folder, "key"), self.path, "--",
                *argv]

    async def __aenter__(self) -> GatewayBridge:
        await self.sandbox.start()
        docker = isinstance(self.sandbox, DockerSandbox)
        # A local sandbox's base (the folder above its workdir) is at the same path inside its root; a
        # container's bridge folder is mounted at its host path.
        base = self.sandbox.bridge_dir if docker else os.path.dirname(self.sandbox.workdir)
        self.folder = os.path.join(base, f"gw-{secrets.token_hex(16 if docker else 4)}")
        self.socket = os.path.join(self.folder, "sock")
        if len(self.socket.encode()) > MAX_SOCKET_PATH:
            raise SandboxError(f"the gateway bridge's socket path {self.socket} is over {MAX_SOCKET_PATH} bytes: "
                               "give the sandbox a shorter root folder")
        uid = None if docker else self.sandbox.uid
        os.mkdir(self.folder, 0o711)  # ours: the sandbox user can reach its two files, not change them
        key_file = os.path.join(self.folder, "key")
        # the container's user is the image's: the key is readable by any user who can name the folder
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o444 if docker else 0o400)
        try:
            os.write(fd, self.key.encode())
            if uid is not None:
                os.fchown(fd, uid, -1)
        finally:
            os.close(fd)
        self._server = await asyncio.start_unix_server(self._carry, self.socket)
        os.chmod(self.socket, 0o666 if docker else 0o600)
        if uid is not None:
            os.chown(self.socket, uid, -1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop accepting, cut every connection (a call in flight loses its client; the episode's
        close aborts it at the engine), remove the folder. Idempotent."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=CLOSE_TIMEOUT_S)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_w: asyncio.StreamWriter | None = None
        back: asyncio.Task | None = None
        try:
            try:
                up_r, up_w = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as e:
                writer.write(_refusal(502, f"the gateway at {self.host}:{self.port} is unreachable: {e}"))
                return
            back = asyncio.ensure_future(_pipe(up_r, writer))
            # The agent's side has no clock of its own: the connection lives while the command does,
            # and close() (at the command's end) cancels it.
            while await self._request(reader, writer, up_w):
                pass
            if up_w.can_write_eof():
                up_w.write_eof()
            await back
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            if back is not None:
                back.cancel()
            for w in (writer, up_w):
                if w is not None:
                    w.close()
            self._tasks.discard(task)

    async def _request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       up_w: asyncio.StreamWriter) -> bool:
        """Pass one request on, or refuse it; False when the connection is done."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False  # the agent closed its side
        except asyncio.LimitOverrunError:
            writer.write(_refusal(431, "request head over 64 KiB"))
            return False
        verdict = check_head(head, self.path)
        if isinstance(verdict, tuple):
            writer.write(_refusal(*verdict))
            await writer.drain()
            raise OSError(f"refused: {verdict[1]}")  # ends the connection without waiting for the gateway
        up_w.write(head)
        left = verdict
        while left:
            chunk = await reader.read(min(left, 1 << 16))
            if not chunk:
                return False
            up_w.write(chunk)
            left -= len(chunk)
            await up_w.drain()
        await up_w.drain()
        return True

"""LocalProcessSandbox's view of the machine: its own root file system and PID namespace.

Each test plants something on the host (or in another sandbox) that today's world-readable modes
would let a command read, and checks the command cannot see it. They assert the strong isolation
where the machine allows it (root, or user namespaces: checked with util-linux ``unshare``,
independently of the code under test) and skip, saying why, elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from rayapp.envs.sandboxes import LocalProcessSandbox, SandboxLimits, _host

CHECKOUT = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(wall_seconds=20)


def _machine_allows() -> str | None:
    """Why the kernel refuses a mount + PID namespace with its own /proc here, or None."""
    if shutil.which("unshare") is None:
        return "util-linux unshare is not installed, so the machine's support cannot be checked"
    args = ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "true"]
    if os.geteuid() != 0:
        args.insert(1, "--user")
    got = subprocess.run(args, capture_output=True, text=True, timeout=30, check=False)
    return None if got.returncode == 0 else f"the kernel refuses mount/PID namespaces here: {got.stderr.strip()}"


REFUSED = _machine_allows()
strong = pytest.mark.skipif(REFUSED is not None, reason=str(REFUSED))


def run(coro):
    return asyncio.run(coro)


@strong
def test_dev_shm_and_run_lock_are_private_and_size_limited():
    name = f"rayapp-shm-{secrets.token_hex(4)}"

    async def main():
        async with LocalProcessSandbox(LIMITS, name="a") as a, LocalProcessSandbox(LIMITS, name="b") as b:
            wrote = await a.exec(f"echo secret > /dev/shm/{name} && echo lock > /run/lock/{name} && "
                                 f"cat /dev/shm/{name} /run/lock/{name}")
            assert wrote.ok and wrote.stdout == "secret\nlock\n"  # both are usable inside
            assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/run/lock/{name}")
            seen = await b.exec(f"cat /dev/shm/{name}; cat /run/lock/{name}; ls -A /dev/shm /run/lock")
            assert "secret" not in seen.stdout and "lock\n" not in seen.stdout and name not in seen.stdout
            # A host file there is not visible either (the other direction).
            host_file = Path(f"/dev/shm/{name}-host")
            host_file.write_text("host")
            try:
                assert "host" not in (await a.exec(f"cat {host_file}")).stdout
            finally:
                host_file.unlink()
            # 50 MB went to the host's /dev/shm before; the private one holds 64 MiB at most.
            big = await a.exec("head -c 100000000 /dev/zero > /dev/shm/big; echo rc=$?; du -m /dev/shm/big")
            assert "rc=1" in big.stdout and "No space left" in big.stderr
            assert int(big.stdout.split("\n")[1].split()[0]) <= 64
            lock = await a.exec("head -c 5000000 /dev/zero > /run/lock/big")
            assert lock.exit_code != 0 and "No space left" in lock.stderr
            assert {"filesystem", "processes"} <= a.isolation

    run(main())


@strong
def test_host_files_outside_the_sandbox_are_not_there():
    tag = secrets.token_hex(4)
    # World-readable on purpose: only the sandbox's own root, not file modes, may keep them out.
    other_copy = Path(tempfile.mkdtemp(prefix=f".rayapp-copy-{tag}-", dir=CHECKOUT.parent))
    token_dir = Path(tempfile.mkdtemp(prefix=f"rayapp-auth-{tag}-"))
    try:
        for folder in (other_copy, token_dir):
            folder.chmod(0o755)
        (other_copy / "pyproject.toml").write_text(f"copy of the source {tag}\n")
        (token_dir / "auth_token").write_text(f"token {tag}\n")
        for f in (other_copy / "pyproject.toml", token_dir / "auth_token"):
            f.chmod(0o644)

        async def main():
            async with LocalProcessSandbox(LIMITS, name="view") as sb, LocalProcessSandbox(LIMITS, name="other") as o:
                await o.write_file("mine.txt", f"other sandbox {tag}")
                os.chmod(o.workdir, 0o755)  # even opened up, another sandbox's folder is not there
                os.chmod(os.path.join(o.workdir, "mine.txt"), 0o644)
                paths = [other_copy / "pyproject.toml", token_dir / "auth_token", CHECKOUT / "pyproject.toml",
                         Path(o.workdir) / "mine.txt"]
                got = await sb.exec("; ".join(f"cat {p}" for p in paths) + f"; ls {CHECKOUT.parent} /work /root /home")
                assert tag not in got.stdout and got.exit_code != 0
                assert "No such file or directory" in got.stderr
                top = set((await sb.exec("ls -A /")).stdout.split())
                assert top <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin", "tmp",
                               "usr", "var"}, top
                etc = set((await sb.exec("ls -A /etc")).stdout.split())
                assert "passwd" in etc and not {"shadow", "ssh", "sudoers", "pip.conf", "npmrc"} & etc
                # The runtime is there and read-only; the sandbox's own folder is writable.
                py = await sb.exec(["python3", "-c", "import json, sqlite3; print('ok')"])
                assert py.stdout == "ok\n", py.stderr
                ro = await sb.exec("touch /usr/x /etc/x /x 2>&1; echo mine > here.txt && cat here.txt")
                assert ro.stdout.count("Read-only file system") + ro.stdout.count("Permission denied") == 3
                assert ro.stdout.endswith("mine\n")
                assert "filesystem" in sb.isolation

        run(main())
    finally:
        shutil.rmtree(other_copy)
        shutil.rmtree(token_dir)


@strong
def test_commands_see_only_their_own_processes():
    marker = secrets.token_hex(8)
    # A host command line carrying a secret, and another sandbox's command: neither may show.
    host = subprocess.Popen(["python3", "-c", "import time; time.sleep(60)", f"--token={marker}"])

    async def main():
        async with LocalProcessSandbox(LIMITS, name="ps") as sb, LocalProcessSandbox(LIMITS, name="nbr") as nbr:
            neighbour = asyncio.ensure_future(nbr.exec(["python3", "-c", "import time; time.sleep(15)", marker]))
            await asyncio.sleep(0.5)
            try:
                ps = await sb.exec("ps -eo pid=,args=; cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
                assert ps.ok and marker not in ps.stdout and "_launch.py" not in ps.stdout, ps.stdout
                pids = [int(line.split()[0]) for line in ps.stdout.splitlines() if line.split()[0].isdigit()]
                assert pids and max(pids) < 50  # numbers of its own namespace, not the host's
                listed = await sb.exec(["python3", "-c", "import json, os; "
                                        "print(json.dumps([int(p) for p in os.listdir('/proc') if p.isdigit()]))"])
                assert json.loads(listed.stdout) == [2]  # itself; init (PID 1, root) is hidden too
                assert "processes" in sb.isolation
            finally:
                neighbour.cancel()
                await asyncio.gather(neighbour, return_exceptions=True)

    try:
        run(main())
    finally:
        host.kill()
        host.wait()


def test_fallbacks_are_logged_and_named(monkeypatch, caplog):
    # Stand in for kernels that refuse a mount namespace, or only a PID namespace's /proc: the
    # sandbox must say so once, name what is missing in ``isolation``, and still run commands.
    real = run(_host.probe())
    cases = [("mount", {"mount": "PermissionError: mount refused", "pid": "needs the sandbox's own root"},
              "no mount namespace for sandboxes"),
             ("pid", {"pid": "PermissionError: proc refused"}, "no PID namespace for sandboxes")]
    for key, refused, warning in cases:
        monkeypatch.setattr(_host, "_probe_result", {**real, **refused})
        monkeypatch.setattr(_host, "_warned", set())
        caplog.clear()

        async def main(key=key):
            async with LocalProcessSandbox(LIMITS, name="fallback") as sb:
                assert "processes" not in sb.isolation
                assert ("filesystem" in sb.isolation) == (key == "pid" and real["mount"] is None)
                assert (await sb.exec("echo ran; pwd")).stdout == f"ran\n{sb.workdir}\n"

        with caplog.at_level(logging.WARNING, logger=_host.__name__):
            run(main())
        assert warning in caplog.text and refused[key] in caplog.text


@strong
@pytest.mark.parametrize("where", ["beside the checkout", "/tmp"])
def test_a_runtime_outside_usr_named_by_path_is_there_read_only(where):
    """A venv beside the checkout, or under /tmp (which the sandbox's own tmp covers), is there read-only."""
    prefix = Path(tempfile.mkdtemp(prefix=".rayapp-runtime-", dir=CHECKOUT.parent if where != "/tmp" else "/tmp"))
    try:
        prefix.chmod(0o755)
        (prefix / "bin").mkdir(mode=0o755)
        tool = prefix / "bin" / "rayapp-tool"
        tool.write_text("#!/bin/sh\necho tool ok\n")
        tool.chmod(0o755)
        if os.path.realpath(shutil.which("python3", path=_host.DEFAULT_PATH) or "").startswith("/usr/"):
            assert _host.runtime_prefixes(_host.DEFAULT_PATH) == []  # the system's Python needs nothing more
        path = f"{prefix}/bin:{_host.DEFAULT_PATH}"
        assert _host.runtime_prefixes(path) == [str(prefix)]

        async def main():
            async with LocalProcessSandbox(LIMITS, name="runtime", path=path) as sb:
                got = await sb.exec(f"rayapp-tool; touch {prefix}/bin/x; ls {CHECKOUT}")
                assert got.stdout == "tool ok\n" and "Read-only file system" in got.stderr
                assert "No such file or directory" in got.stderr  # the folder beside it is still not there
                assert not (prefix / "bin" / "x").exists()

        run(main())
    finally:
        shutil.rmtree(prefix)

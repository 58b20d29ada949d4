"""LocalProcessSandbox isolation: folder, user, limits, process-group kill, network, env, faults.

Commands that try to escape are real (a fork bomb, a CPU spin, a 2 GB allocation, writes to /etc),
each bounded by a short limit so the suite stays quick and the machine healthy. Leftover processes
are looked for with ``ps`` by a unique marker in their command line, independently of the sandbox's
own bookkeeping.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rayapp.core.termination import AbortReason, AgentTimeout, SandboxError, classify_abort
from rayapp.envs.sandboxes import (
    LocalProcessSandbox,
    SandboxLimits,
    _host,
    limits_from_resource,
    make_sandbox,
)
from rayapp.envs.sandboxes.base import relative_inside
from rayapp.types import Resource

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="per-sandbox users need root")


def live(marker: str) -> list[str]:
    """Processes (not zombies) whose command line holds ``marker``."""
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if marker in line and not line.lstrip().startswith("Z")]


def live_uid(uid: int) -> list[str]:
    out = subprocess.run(["ps", "-u", str(uid), "-o", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if not line.lstrip().startswith("Z")]


def gone(marker: str | int, within_s: float = 3.0) -> bool:
    # SIGKILL is delivered asynchronously: give the kernel a moment to finish the killed processes.
    deadline = time.monotonic() + within_s
    while live_uid(marker) if isinstance(marker, int) else live(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def marker_sleep() -> str:
    """A sleep length no other process on the machine uses (``sleep`` takes fractions)."""
    return f"1000.{secrets.randbelow(10**9):09d}"


def run(coro):
    return asyncio.run(coro)


def test_runs_command_and_captures_output():
    async def main():
        async with LocalProcessSandbox(SandboxLimits(wall_seconds=10), name="basic") as sb:
            res = await sb.exec("echo out; echo err >&2; pwd; exit 3")
            assert (res.exit_code, res.stderr, res.ok) == (3, "err\n", False)
            assert res.stdout == f"out\n{sb.workdir}\n"
            piped = await sb.exec(["cat"], stdin="from stdin")
            assert piped.ok and piped.stdout == "from stdin"
            missing = await sb.exec(["no-such-command-xyz"])  # the command's failure, not the sandbox's
            assert missing.exit_code == 127 and "no-such-command-xyz" in missing.stderr
            await sb.write_file("pkg/mod.py", "print(6 * 7)\n")
            assert (await sb.exec(["python3", "pkg/mod.py"])).stdout == "42\n"
            assert await sb.read_file(f"{sb.workdir}/pkg/mod.py") == "print(6 * 7)\n"  # absolute, inside
            with pytest.raises(FileNotFoundError):
                await sb.read_file("nope.txt")

    run(main())


@needs_root
def test_cannot_write_outside_its_folder():
    tag = secrets.token_hex(6)
    outside = [f"/etc/rayapp-{tag}", f"/tmp/rayapp-sbx-parent-{tag}"]

    async def main():
        async with LocalProcessSandbox(SandboxLimits(wall_seconds=10), name="escape") as sb:
            assert sb.uid is not None and sb.uid != 0
            assert (await sb.exec("id -u")).stdout.strip() == str(sb.uid)
            parent = os.path.dirname(sb.workdir)
            res = await sb.exec(f"touch /etc/rayapp-{tag}; touch ../x-{tag}; echo x > {parent}/y-{tag}; "
                                f"ls .. ; chmod 777 /etc; echo done")
            assert "Permission denied" in res.stderr and res.stdout.endswith("done\n")
            assert not os.path.exists(outside[0])
            assert not os.path.exists(f"{parent}/x-{tag}") and not os.path.exists(f"{parent}/y-{tag}")
            for bad in ("../x", f"../../{os.path.basename(outside[1])}", "/etc/passwd", outside[0], "a/../../b", "."):
                with pytest.raises(ValueError):
                    await sb.write_file(bad, "no")
            # Symlinks made by a command: one pointing out is refused, one pointing inside is followed.
            await sb.exec("ln -s /etc out; ln -s / root; echo in > a.txt; ln -s a.txt b.txt")
            for bad in ("out/passwd", "root/etc/passwd", f"out/rayapp-{tag}"):
                with pytest.raises(ValueError):
                    await sb.write_file(bad, "no")
                with pytest.raises(ValueError):
                    await sb.read_file(bad)
            assert await sb.read_file("b.txt") == "in\n"
            # A link planted on a file name is not written through.
            before = Path("/etc/passwd").read_text()
            await sb.exec("ln -sf /etc/passwd planted")
            with pytest.raises(ValueError):
                await sb.write_file("planted", "mine")
            assert Path("/etc/passwd").read_text() == before
        for path in outside:
            assert not os.path.exists(path)

    run(main())


@needs_root
def test_sandboxes_cannot_read_each_other():
    async def main():
        async with LocalProcessSandbox(name="a") as a, LocalProcessSandbox(name="b") as b:
            assert a.uid != b.uid
            await b.write_file("secret.txt", "b's secret")
            res = await a.exec(f"cat {b.workdir}/secret.txt")
            assert res.exit_code != 0 and "b's secret" not in res.stdout

    run(main())


def test_fork_bomb_is_contained():
    tag = "bomb" + secrets.token_hex(4)  # the function's name: every forked shell carries it in its argv
    limits = SandboxLimits(max_processes=24, wall_seconds=3, cpu_seconds=5)

    async def main():
        async with LocalProcessSandbox(limits, name="bomb") as sb:
            # The classic bomb, with the command kept alive so that the limits, not its exit, stop it.
            res = await sb.exec(f"{tag}() {{ {tag} | {tag} & }}; {tag}; sleep 30")
            assert res.timed_out and res.exit_code == -signal.SIGKILL and res.duration_s < limits.wall_seconds + 5
            assert "Resource temporarily unavailable" in res.stderr  # RLIMIT_NPROC refused its forks
            assert gone(tag), live(tag)
            if sb.uid is not None:
                assert gone(sb.uid), live_uid(sb.uid)  # nothing of the sandbox user is left either
            assert (await sb.exec("echo still fine")).stdout == "still fine\n"

    run(main())
    assert subprocess.run(["true"], check=False).returncode == 0  # the machine can still fork


def test_runaway_loop_is_stopped_by_cpu_limit():
    async def main():
        # the wall limit far above the CPU one: on a loaded machine a CPU second takes many wall seconds
        async with LocalProcessSandbox(SandboxLimits(cpu_seconds=1, wall_seconds=300), name="spin") as sb:
            res = await sb.exec(["python3", "-c", "while True: pass"])
            assert res.exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and not res.timed_out

    run(main())


def test_memory_limit_is_enforced():
    async def main():
        async with LocalProcessSandbox(SandboxLimits(memory_gb=0.25, wall_seconds=20), name="mem") as sb:
            res = await sb.exec(["python3", "-c", "b = bytearray(2 * 1024**3); print('allocated')"])
            assert not res.ok and "allocated" not in res.stdout
            assert "MemoryError" in res.stderr or res.exit_code < 0

    run(main())


def test_timeout_kills_children():
    pid_marker, escaped = marker_sleep(), marker_sleep()

    async def main():
        async with LocalProcessSandbox(SandboxLimits(wall_seconds=10), name="kids") as sb:
            res = await sb.exec(f"for i in 1 2 3; do sleep {pid_marker} & done; sleep {pid_marker}", timeout_s=1)
            assert res.timed_out and res.exit_code == -signal.SIGKILL and 1 <= res.duration_s < 6
            assert gone(pid_marker), live(pid_marker)
            # A child that leaves the process group (setsid) dies with the command's PID namespace;
            # without one it outlives the command, but not the sandbox.
            await sb.exec(f"setsid sleep {escaped} > /dev/null 2>&1 < /dev/null & sleep 0.5", timeout_s=5)
            assert gone(escaped) if "processes" in sb.isolation else live(escaped)
        if ROOT:
            assert gone(escaped), live(escaped)

    run(main())


def test_cancelling_exec_kills_its_group():
    marker = marker_sleep()

    async def main():
        async with LocalProcessSandbox(name="cancel") as sb:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(sb.exec(f"sleep {marker} & sleep {marker}"), 0.5)
            assert gone(marker), live(marker)

    run(main())


def test_network_is_blocked():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        port = server.getsockname()[1]
        probe = ["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)"]

        async def main():
            async with LocalProcessSandbox(SandboxLimits(wall_seconds=10), name="net") as sb:
                blocked = await sb.exec(probe)
                if sb.network_isolated:
                    assert blocked.exit_code != 0 and "Error" in blocked.stderr
                else:  # the kernel refused: the fallback must have been logged
                    assert "net" in _host._warned
            async with LocalProcessSandbox(SandboxLimits(wall_seconds=10, network=True), name="net-on") as sb:
                assert not sb.network_isolated
                assert (await sb.exec(probe)).ok  # control: the probe itself reaches the port

        run(main())


def test_network_fallback_is_reported(monkeypatch, caplog):
    # Stand in for a kernel that refuses network namespaces: the sandbox must say so, not pretend.
    real = run(_host.probe())
    monkeypatch.setattr(_host, "_probe_result", {"net": "PermissionError: unshare refused", "user": real["user"]})
    monkeypatch.setattr(_host, "_warned", set())

    async def main():
        async with LocalProcessSandbox(name="fallback") as sb:
            assert sb.network_isolated is False
            assert (await sb.exec("echo ran")).stdout == "ran\n"

    with caplog.at_level("WARNING", logger=_host.__name__):
        run(main())
    assert "network isolation is unavailable" in caplog.text and "unshare refused" in caplog.text


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("RAYAPP_TEST_SECRET_TOKEN", "hunter2")

    async def main():
        async with LocalProcessSandbox(name="env", env={"EXTRA": "given"}) as sb:
            env = dict(line.split("=", 1) for line in (await sb.exec("env")).stdout.splitlines() if "=" in line)
            assert "RAYAPP_TEST_SECRET_TOKEN" not in env and "hunter2" not in str(env)
            assert env["HOME"] == sb.workdir and env["EXTRA"] == "given"
            assert env["PATH"] == _host.DEFAULT_PATH
            assert not {"VIRTUAL_ENV", "PYTHONPATH", "RAY_ADDRESS"} & set(env)

    run(main())


def test_output_is_capped():
    async def main():
        async with LocalProcessSandbox(SandboxLimits(max_output_bytes=1000), name="cap") as sb:
            res = await sb.exec("head -c 200000 /dev/zero | tr '\\0' a; echo short >&2")
            assert res.ok and res.truncated and res.stdout == "a" * 1000 and res.stderr == "short\n"

    run(main())


def test_close_removes_folder_and_later_calls_raise():
    async def main():
        sb = await make_sandbox("local", SandboxLimits(wall_seconds=5), name="close")
        await sb.write_file("f.txt", "x")
        workdir = sb.workdir
        assert os.path.isdir(workdir)
        await sb.close()
        await sb.close()  # idempotent
        assert not os.path.exists(os.path.dirname(workdir))
        for call in (sb.exec("true"), sb.write_file("g.txt", "y"), sb.read_file("f.txt"), sb.start()):
            with pytest.raises(SandboxError) as info:
                await call
            assert classify_abort(info.value) is AbortReason.INFRA_SANDBOX

    run(main())


def test_folder_vanishing_or_close_during_a_command_is_a_sandbox_fault():
    async def main():
        async with LocalProcessSandbox(name="vanish") as sb:
            await asyncio.to_thread(subprocess.run, ["rm", "-rf", sb.workdir], check=True)
            for call in (sb.exec("true"), sb.write_file("a", "b"), sb.read_file("a")):
                with pytest.raises(SandboxError):
                    await call
        sb = await LocalProcessSandbox(name="killed").start()
        running = asyncio.ensure_future(sb.exec("sleep 30"))
        await asyncio.sleep(0.3)
        await sb.close()
        with pytest.raises(SandboxError) as info:
            await asyncio.wait_for(running, 10)
        assert classify_abort(info.value) is AbortReason.INFRA_SANDBOX

    run(main())


def test_check_timeout_raises_agent_timeout():
    async def main():
        async with LocalProcessSandbox(name="timeout") as sb:
            res = await sb.exec("sleep 5", timeout_s=0.3)
            assert res.timed_out and not res.ok
            with pytest.raises(AgentTimeout) as info:
                await sb.exec("sleep 5", timeout_s=0.3, check_timeout=True)
            assert classify_abort(info.value) is AbortReason.AGENT_TIMEOUT
            assert classify_abort(str(info.value)) is AbortReason.AGENT_TIMEOUT  # also once stringified

    run(main())


def test_limits_from_resource_and_factory_errors():
    limits = limits_from_resource(Resource(cpu=2, memory_gb=0.5), wall_seconds=7)
    assert (limits.cpu, limits.memory_gb, limits.wall_seconds) == (2, 0.5, 7)
    assert limits_from_resource(Resource()).memory_gb is None  # 0 = not gated: the backend's default
    with pytest.raises(TypeError):
        limits_from_resource(Resource(), no_such_field=1)
    with pytest.raises(ValueError):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ValueError):
        run(make_sandbox("vm", limits))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        run(make_sandbox("docker", limits))  # no image


@given(st.lists(st.sampled_from(["..", ".", "a", "b", "", "/", "//", "a/..", "../a"]), min_size=1, max_size=6))
def test_relative_inside_never_escapes(parts):
    root = "/srv/box/work"
    path = "/".join(parts)
    try:
        rel = relative_inside(root, path)
    except ValueError:
        return
    full = posixpath.normpath(posixpath.join(root, rel))
    assert full.startswith(root + "/") and ".." not in rel.split("/")


CHECKOUT = Path(__file__).resolve().parents[1]


def test_commands_get_a_private_tmp_and_no_view_of_the_checkout():
    name = f"rayapp-escape-{secrets.token_hex(4)}"
    secret = CHECKOUT / "pyproject.toml"

    async def main():
        async with LocalProcessSandbox(SandboxLimits(wall_seconds=10), name="tmp") as sb:
            if "filesystem" not in sb.isolation:
                pytest.skip(f"no mount namespace here: {_host._probe_result['mount']}")
            wrote = await sb.exec(f"echo x > /tmp/{name} && echo y > /var/tmp/{name}v && cat /tmp/{name}")
            assert wrote.ok and wrote.stdout == "x\n"  # the command has a /tmp of its own, and it works
            assert not os.path.exists(f"/tmp/{name}") and not os.path.exists(f"/var/tmp/{name}v")
            again = await sb.exec(f"cat /tmp/{name}")  # the same private /tmp for the sandbox's next command
            assert again.ok and again.stdout == "x\n"
            read = await sb.exec(f"cat {secret}; ls {CHECKOUT}")
            assert secret.read_text()[:20] not in read.stdout and read.exit_code != 0
            assert (await sb.exec("pwd; echo $TMPDIR")).stdout == f"{sb.workdir}\n{os.path.dirname(sb.workdir)}/tmp\n"

    run(main())


HOST_SCRIPT = """
import asyncio, sys, time
from rayapp.envs.sandboxes import LocalProcessSandbox
async def main():
    sb = await LocalProcessSandbox(root=sys.argv[1], name="doomed").start()
    print(sb.workdir, flush=True)
    time.sleep(600)
asyncio.run(main())
"""


def test_a_sigkilled_hosts_folder_is_swept_when_the_next_host_starts(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    host = subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        workdir = host.stdout.readline().strip()
        assert workdir and os.path.isdir(workdir)
    finally:
        host.kill()
        host.wait(timeout=30)
    live_base = tmp_path / "rayapp-sbx-alive-x"  # a folder whose owner still runs stays
    live_base.mkdir()
    (live_base / _host.OWNER_FILE).write_text(_host.owner_stamp())
    assert os.path.isdir(workdir)

    async def main():
        async with LocalProcessSandbox(root=str(tmp_path), name="next"):
            assert not os.path.exists(os.path.dirname(workdir))
            assert live_base.is_dir()

    run(main())

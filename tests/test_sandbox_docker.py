"""DockerSandbox. The engine tests need a Docker engine and an image with python3
(``RAYAPP_SANDBOX_IMAGE``, default ``python:3.11-slim``, used only if already pulled); without them they
skip with ``docker_available()``'s reason. The command line, path checks and engine-error mapping are
checked everywhere, with no engine.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess

import pytest

from rayapp.core.termination import AbortReason, AgentTimeout, SandboxError, classify_abort
from rayapp.envs.sandboxes import DockerSandbox, SandboxLimits, docker_available, make_sandbox

AVAILABLE, REASON = docker_available()
IMAGE = os.environ.get("RAYAPP_SANDBOX_IMAGE", "python:3.11-slim")


def _image_present() -> tuple[bool, str]:
    if not AVAILABLE:
        return False, REASON
    got = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, timeout=30, check=False)
    return got.returncode == 0, f"image {IMAGE} is not pulled (docker pull it, or set RAYAPP_SANDBOX_IMAGE)"


READY, WHY = _image_present()
needs_engine = pytest.mark.skipif(not READY, reason=WHY)


def run(coro):
    return asyncio.run(coro)


def test_docker_available_says_why_not():
    ok, reason = docker_available("no-such-docker-cli-xyz")
    assert not ok and "no-such-docker-cli-xyz" in reason
    assert REASON  # either the engine's version or why there is none


def test_run_command_line_carries_the_limits():
    limits = SandboxLimits(cpu=1.5, memory_gb=0.5, max_processes=64, max_open_files=100)
    argv = DockerSandbox("img:1", limits, name="t").run_argv()
    joined = " ".join(argv)
    for flag in ("--network none", "--cpus 1.5", f"--memory {1 << 29}", f"--memory-swap {1 << 29}",
                 "--pids-limit 64", "--ulimit nofile=100:100", "-w /workspace", "--rm", "--init",
                 "--security-opt no-new-privileges", "-e HOME=/workspace"):
        assert flag in joined, flag
    assert argv[-4:] == ["--entrypoint", "sleep", "img:1", "infinity"]
    assert "--network" not in DockerSandbox("img:1", SandboxLimits(network=True)).run_argv()
    assert not DockerSandbox("img:1", SandboxLimits(network=True)).network_isolated


def test_paths_leaving_the_workspace_are_refused_before_any_engine_call():
    sb = DockerSandbox("img:1", docker="no-such-docker-cli-xyz")
    for bad in ("../x", "/etc/passwd", "a/../../b"):
        with pytest.raises(ValueError):
            run(sb.write_file(bad, "x"))
        with pytest.raises(ValueError):
            run(sb.read_file(bad))


def test_engine_errors_are_sandbox_errors():
    with pytest.raises(SandboxError) as info:
        run(DockerSandbox("img:1", docker="no-such-docker-cli-xyz").exec("true"))
    assert classify_abort(info.value) is AbortReason.INFRA_SANDBOX
    if not AVAILABLE and "not on PATH" not in REASON:  # a CLI without an engine, as on these machines
        with pytest.raises(SandboxError):
            run(make_sandbox("docker", SandboxLimits(wall_seconds=5), image=IMAGE))


FAKE_DOCKER = """#!/bin/sh
# Stands in for the docker CLI: runs "containers" as local processes in the given workdir, so the
# sandbox's own logic (wrapper, timeouts, file snippets, error mapping) runs without an engine.
state="$(dirname "$0")/removed"
cmd=$1; shift
case "$cmd" in
  run) echo fake-container-id ;;
  rm) touch "$state" ;;
  exec)
    if [ -e "$state" ]; then echo "Error response from daemon: No such container: x" >&2; exit 1; fi
    [ "$1" = -i ] && shift
    dir=$2; shift 3
    cd "$dir" && exec "$@" ;;
  *) echo "fake docker: $cmd unsupported" >&2; exit 1 ;;
esac
"""


def test_sandbox_logic_against_a_fake_docker_cli(tmp_path):
    fake = tmp_path / "docker"
    fake.write_text(FAKE_DOCKER)
    fake.chmod(0o755)
    workspace = tmp_path / "ws"
    workspace.mkdir()

    async def main():
        sb = DockerSandbox("img:1", SandboxLimits(wall_seconds=20, max_output_bytes=100), docker=str(fake),
                           workdir=str(workspace))
        async with sb:
            res = await sb.exec("echo out; echo err >&2; pwd; exit 3")
            assert (res.exit_code, res.stdout, res.stderr) == (3, f"out\n{workspace}\n", "err\n")
            assert (await sb.exec(["cat"], stdin="piped")).stdout == "piped"
            assert (await sb.exec("kill -TERM $$")).exit_code == -15  # 128+N from the shell: signal N
            await sb.write_file("pkg/a.txt", "hello")
            assert (workspace / "pkg" / "a.txt").read_text() == "hello"
            assert await sb.read_file("pkg/a.txt") == "hello"
            (workspace / "out").symlink_to("/etc")
            with pytest.raises(ValueError):
                await sb.read_file("out/passwd")
            with pytest.raises(ValueError):
                await sb.write_file("out/x", "no")
            with pytest.raises(FileNotFoundError):
                await sb.read_file("missing.txt")
            assert (await sb.exec("head -c 5000 /dev/zero")).truncated
            slow = await sb.exec("sleep 5", timeout_s=0.5)
            assert slow.timed_out and slow.exit_code == -9 and slow.duration_s < 4
            with pytest.raises(AgentTimeout):
                await sb.exec("sleep 5", timeout_s=0.5, check_timeout=True)
            (tmp_path / "removed").touch()  # the container disappears under the sandbox
            with pytest.raises(SandboxError) as info:
                await sb.exec("true")
            assert classify_abort(info.value) is AbortReason.INFRA_SANDBOX
        with pytest.raises(SandboxError):
            await sb.exec("true")

    run(main())


@needs_engine
def test_runs_commands_and_files_in_the_container():
    async def main():
        async with DockerSandbox(IMAGE, SandboxLimits(wall_seconds=20, max_output_bytes=1000), name="basic") as sb:
            res = await sb.exec("echo out; echo err >&2; pwd; exit 3")
            assert (res.exit_code, res.stdout, res.stderr) == (3, "out\n/workspace\n", "err\n")
            assert (await sb.exec(["cat"], stdin="piped")).stdout == "piped"
            await sb.write_file("pkg/mod.py", "print(6 * 7)\n")
            assert (await sb.exec(["python3", "pkg/mod.py"])).stdout == "42\n"
            assert await sb.read_file("pkg/mod.py") == "print(6 * 7)\n"
            await sb.exec("ln -s /etc out")
            with pytest.raises(ValueError):
                await sb.read_file("out/passwd")
            with pytest.raises(FileNotFoundError):
                await sb.read_file("missing.txt")
            big = await sb.exec("head -c 100000 /dev/zero | tr '\\0' a")
            assert big.truncated and len(big.stdout) == 1000
            assert (await sb.exec("ls /sys/class/net")).stdout.split() == ["lo"]  # --network none

    run(main())


@needs_engine
def test_limits_and_timeouts_in_the_container():
    marker = f"1000.{secrets.randbelow(10**9):09d}"

    async def main():
        async with DockerSandbox(IMAGE, SandboxLimits(memory_gb=0.25, wall_seconds=20), name="limits") as sb:
            mem = await sb.exec(["python3", "-c", "b = bytearray(2 * 1024**3); print('allocated')"])
            assert not mem.ok and "allocated" not in mem.stdout
            res = await sb.exec(f"sleep {marker} & sleep {marker}", timeout_s=1)
            assert res.timed_out and res.exit_code < 0
            left = await sb.exec(f"grep -l {marker} /proc/[0-9]*/cmdline 2>/dev/null | grep -v self")
            assert left.stdout.strip() == ""  # the children died with the command
            with pytest.raises(AgentTimeout) as info:
                await sb.exec("sleep 10", timeout_s=0.5, check_timeout=True)
            assert classify_abort(info.value) is AbortReason.AGENT_TIMEOUT

    run(main())


@needs_engine
def test_close_removes_the_container_and_a_killed_one_is_a_sandbox_fault():
    async def main():
        sb = await make_sandbox("docker", SandboxLimits(wall_seconds=20), image=IMAGE, name="close")
        await sb.close()
        gone = subprocess.run(["docker", "inspect", sb.container], capture_output=True, check=False)
        assert gone.returncode != 0
        with pytest.raises(SandboxError):
            await sb.exec("true")
        async with DockerSandbox(IMAGE, SandboxLimits(wall_seconds=20), name="killed") as other:
            subprocess.run(["docker", "rm", "-f", other.container], capture_output=True, check=True)
            with pytest.raises(SandboxError) as info:
                await other.exec("true")
            assert classify_abort(info.value) is AbortReason.INFRA_SANDBOX

    run(main())

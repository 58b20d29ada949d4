"""The warm hosts that run a sample's function calls in its bundle (``rayapp.actors.work_hosts``), on
real Ray (the session's local cluster, logical GPUs) and a placement group shaped as the pool's: a
CPU/memory bundle and a GPU one. Contracts: a call's result or its own error comes back and the host
stays warm (no new process per call); slow calls get hosts of their own; a call that times out, is
cancelled or whose host dies leaves nothing running and a classified error; idle hosts are stopped."""

import asyncio
import os
import time
from pathlib import Path

import pytest

from rayapp.core.termination import AgentTimeout, SandboxError
from rayapp.types import Token


@pytest.fixture
def tokens(ray_session):
    """Tokens in a group of its own (a fresh name, outside the pools' ``rayapp/`` ones) that asks for
    little. The groups of pool services that earlier tests killed go first, as a starting pool's do
    (a killed plain actor's groups outlive it: ``rayapp.actors.pool_owners``)."""
    import uuid

    from ray.util.placement_group import placement_group, remove_placement_group

    from rayapp.actors.pool_owners import remove_leftovers

    ray = ray_session
    remove_leftovers(wait_s=30)
    name = f"test/work-hosts-{uuid.uuid4().hex[:8]}"
    pg = placement_group([{"CPU": 0.5}, {"GPU": 0.25}], name=name)
    try:
        ready, _ = ray.wait([pg.ready()], timeout=60)
        assert ready, f"the test's group could not be placed; free: {ray.available_resources()}"
        yield {"cpu": Token(0, "n0", (), 0.0, 0.25, 0.1, placement_group=name, bundle_index=0),
               "gpu": Token(1, "n0", (0,), 0.25, 0.0, 0.0, placement_group=name, bundle_index=1)}
    finally:
        remove_placement_group(pg)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def wait_gone(pid: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def test_calls_reuse_a_warm_host_and_slow_calls_get_hosts_of_their_own(tokens):
    from rayapp.actors.work_hosts import WorkHosts

    hosts = WorkHosts(grow_after_s=0.1)

    def slow_pid(seconds):
        time.sleep(seconds)
        return os.getpid()

    async def scenario():
        first = [await hosts.run(tokens["cpu"], os.getpid) for _ in range(5)]
        together = await asyncio.gather(*(hosts.run(tokens["cpu"], slow_pid, 1.0) for _ in range(3)))
        after = await asyncio.gather(*(hosts.run(tokens["cpu"], slow_pid, 0.0) for _ in range(3)))
        return first, together, after

    first, together, after = asyncio.run(scenario())
    assert len(set(first)) == 1 and first[0] != os.getpid(), first  # one warm host, not this process
    assert len(set(together)) == 3 and first[0] in together, together  # each slow call ran beside the others
    assert set(after) <= set(together) and hosts.started == 3, (after, hosts.started)  # no new process
    for pid in together:
        assert alive(pid)


def test_a_burst_of_cheap_calls_on_a_cold_bundle_starts_a_few_hosts_not_one_per_call(tokens):
    from rayapp.actors.work_hosts import WorkHosts

    hosts = WorkHosts()

    async def burst():
        return await asyncio.gather(*(hosts.run(tokens["gpu"], os.getpid) for _ in range(40)))

    pids = asyncio.run(burst())
    assert len(pids) == 40 and hosts.started == len(set(pids)) < 10, (hosts.started, len(set(pids)))


def test_the_functions_own_error_comes_back_as_itself_and_its_host_stays(tokens):
    from rayapp.actors.work_hosts import WorkHosts

    hosts = WorkHosts()

    def fails(label):
        raise ValueError(f"no answer for {label}")

    async def scenario():
        pid = await hosts.run(tokens["cpu"], os.getpid)
        with pytest.raises(ValueError, match="no answer for 4"):
            await hosts.run(tokens["cpu"], fails, "4")
        return pid, await hosts.run(tokens["cpu"], os.getpid)

    before, after = asyncio.run(scenario())
    assert before == after and hosts.started == 1


def test_a_call_that_times_out_or_is_cancelled_stops_with_its_host(tokens, tmp_path):
    from rayapp.actors.work_hosts import WorkHosts

    hosts = WorkHosts()

    def hangs(folder, name):
        Path(folder, f"{name}.pid").write_text(str(os.getpid()))
        time.sleep(3)
        Path(folder, f"{name}.done").write_text("ran on")

    async def scenario():
        await hosts.run(tokens["cpu"], os.getpid)  # a warm host: the bound below is the call's, not a start's
        with pytest.raises(AgentTimeout, match=r"ran past 1\.0s"):
            await hosts.run(tokens["cpu"], hangs, str(tmp_path), "late", timeout_s=1.0)
        call = asyncio.ensure_future(hosts.run(tokens["gpu"], hangs, str(tmp_path), "cancelled"))
        while not (tmp_path / "cancelled.pid").exists():
            await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call

    asyncio.run(scenario())
    for name in ("late", "cancelled"):
        assert wait_gone(int((tmp_path / f"{name}.pid").read_text())), f"the {name} call's host still runs"
    time.sleep(3.5)  # past the sleep: had the work gone on, it would have written this
    assert not list(tmp_path.glob("*.done"))


def test_a_host_that_dies_is_a_sandbox_error_and_the_next_call_gets_a_new_one(tokens):
    from rayapp.actors.work_hosts import WorkHosts

    hosts = WorkHosts()

    def dies():
        os._exit(3)

    async def scenario():
        pid = await hosts.run(tokens["cpu"], os.getpid)
        with pytest.raises(SandboxError, match=r"work in bundle .*\[0\] on n0 was lost"):
            await hosts.run(tokens["cpu"], dies)
        return pid, await hosts.run(tokens["cpu"], os.getpid)

    before, after = asyncio.run(scenario())
    assert before != after and hosts.started == 2 and not alive(before)


def test_work_in_a_gpu_bundle_sees_that_gpu(tokens, ray_session):
    from rayapp.actors.work_hosts import WorkHosts

    ray = ray_session
    hosts = WorkHosts()

    def gpus():
        return [str(g) for g in ray.get_gpu_ids()], os.environ.get("CUDA_VISIBLE_DEVICES")

    ids, visible = asyncio.run(hosts.run(tokens["gpu"], gpus))
    assert len(ids) == 1 and visible == ids[0], (ids, visible)


def test_a_host_idle_past_idle_s_is_stopped(tokens):
    from rayapp.actors.work_hosts import WorkHosts

    hosts = WorkHosts(idle_s=0.5)

    async def scenario():
        first = await hosts.run(tokens["cpu"], os.getpid)
        await asyncio.sleep(1.0)
        return first, await hosts.run(tokens["cpu"], os.getpid)

    first, second = asyncio.run(scenario())
    assert first != second and hosts.started == 2
    assert wait_gone(first), "the idle host was not stopped"


def test_without_a_placement_group_the_call_runs_in_a_thread_here():
    from rayapp.actors.work_hosts import WorkHosts

    hosts = WorkHosts()
    assert asyncio.run(hosts.run(None, os.getpid)) == os.getpid() and hosts.started == 0

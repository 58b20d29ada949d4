"""The Ray shell's parts that run without a cluster: the pool and engine clients' timeouts, retries
and error mapping over stand-in handles, the GPU check of `serve run`, and the demo's cluster cleanup."""

import asyncio

import pytest
import yaml
from conftest import run

from rayapp.actors.engine import EngineClient
from rayapp.actors.pool_client import PoolClient
from rayapp.cli import ROOT
from rayapp.core.termination import AgentTimeout, EngineConnectionError, classify_abort
from rayapp.recipe import RecipeError, parse_recipe
from rayapp.types import Resource, Token

LOCAL = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())["applications"][0]["args"]


class FakeResponse:
    def __init__(self, coro):
        self.coro, self.cancelled = coro, False

    def __await__(self):
        return self.coro.__await__()

    def cancel(self):
        self.cancelled = True


class FakeMethod:
    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def remote(self, *args, **kwargs):
        r = FakeResponse(self.fn(*args, **kwargs))
        self.log.append(r)
        return r


class FakeHandle:
    def __init__(self, **methods):
        self.responses = []
        for name, fn in methods.items():
            setattr(self, name, FakeMethod(fn, self.responses))


def test_engine_client_times_out_cancels_and_classifies():
    async def slow(req):
        await asyncio.sleep(10)

    handle = FakeHandle(generate=slow)
    with pytest.raises(AgentTimeout) as info:
        run(EngineClient(handle, "student", timeout_s=0.05).generate(object()))
    assert handle.responses[0].cancelled  # the replica stops generating for nobody
    assert classify_abort(info.value).value == "agent_timeout"


def test_engine_client_maps_a_dead_replica_to_infra_conn():
    from ray.exceptions import RayActorError

    async def dead(req):
        raise RayActorError()

    with pytest.raises(EngineConnectionError) as info:
        run(EngineClient(FakeHandle(generate=dead), "student").generate(object()))
    assert classify_abort(info.value).value == "infra_conn"


TOKENS = [Token(1, "n", (0,), 0.5, 1.0, 1.0, "rayapp/x/1", 0)]


def test_pool_client_retries_when_ray_could_not_place_the_group():
    answers = [None, None, TOKENS]
    seen = []

    async def acquire_batch(budget, per_sample, n, **kw):
        seen.append(kw)
        return answers.pop(0)

    client = PoolClient(FakeHandle(acquire_batch=acquire_batch), owner="m", retry_s=0.01)
    assert run(client.acquire_batch(Resource(), Resource(), 1, timeout=5, label="r0/b0/x")) == TOKENS
    assert len(seen) == 3 and all(kw["owner"] == "m" and kw["label"] == "r0/b0/x" for kw in seen)


def test_pool_client_gives_up_at_its_deadline():
    async def never(budget, per_sample, n, **kw):
        return None

    client = PoolClient(FakeHandle(acquire_batch=never), owner="m", retry_s=0.05)
    with pytest.raises(TimeoutError, match="could not place"):
        run(client.acquire_batch(Resource(), Resource(), 1, timeout=0.2))


def test_pool_client_cancels_a_call_it_stops_waiting_for():
    async def hang(*a, **kw):
        await asyncio.sleep(10)

    handle = FakeHandle(release_batch=hang)
    with pytest.raises(TimeoutError):
        run(PoolClient(handle, owner="m", call_timeout_s=0.05).release_batch(TOKENS))
    assert handle.responses[0].cancelled


def test_serve_run_without_gpus_gets_a_clear_error_before_anything_deploys(monkeypatch):
    import ray

    from rayapp.actors.app import check_live_gpus

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(RecipeError, match=r"hold GPU fractions, but this Ray cluster has no GPUs.*--num-gpus"):
        check_live_gpus(parse_recipe(LOCAL), "rollout.yaml")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "GPU": 4.0})
    check_live_gpus(parse_recipe(LOCAL), "rollout.yaml")


def test_the_demo_finds_and_stops_exactly_its_own_cluster_processes(tmp_path, monkeypatch):
    import subprocess
    import sys

    from rayapp.cli import ray_processes, stop_cluster

    mine, other = tmp_path / "rayapp-x-12", tmp_path / "rayapp-x-123"
    pad = "p" * 300  # the folder sits far past any terminal width in the command line
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", pad, f"--temp-dir={d}/s"])
             for d in (mine, other)]
    monkeypatch.setenv("COLUMNS", "40")  # as pytest sets it: ps must still see whole command lines
    try:
        assert ray_processes(mine) == [procs[0].pid]  # not the one whose folder only starts the same
        assert stop_cluster(mine, grace_s=5) == []
        assert procs[0].wait(timeout=10) is not None and procs[1].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()

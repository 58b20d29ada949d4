"""The Ray shell's parts that run without a cluster: the GPU check of `serve run` and the demo's cluster
cleanup. (The pool and engine clients' bounds and error mapping: test_remote_calls.py.)"""

import pytest
import yaml

from rayapp.cli import ROOT
from rayapp.recipe import RecipeError, check_live_gpus, parse_recipe

LOCAL = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())["applications"][0]["args"]


def test_serve_run_without_gpus_gets_a_clear_error_before_anything_deploys(monkeypatch):
    import ray

    from rayapp.actors.app import build_app

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(RecipeError, match=r"hold GPU fractions, but this Ray cluster has no GPUs.*--num-gpus"):
        build_app(LOCAL)
    check_live_gpus(parse_recipe(LOCAL), 4.0)  # GPUs there: nothing to say
    check_live_gpus(parse_recipe(LOCAL), None)  # no cluster to read yet: nothing to say


def test_a_local_cluster_runs_with_two_malloc_arenas_and_no_deployment_replaces_the_apps_env():
    """Issue 19 point 8: the manager's RSS grew ~2.4 MB a step in glibc's per-thread arenas (freed memory
    they kept). MALLOC_ARENA_MAX=2 goes in the local cluster's environment, which every Ray process
    inherits; a deployment's own runtime_env would replace the application's env_vars (the HTTP token
    among them: an unauthenticated POST then started a step), so none sets one."""
    from rayapp.actors.app import build_app
    from rayapp.cli.local_cluster import LOCAL_ENV

    assert LOCAL_ENV["MALLOC_ARENA_MAX"] == "2"
    manager = build_app(LOCAL)._bound_deployment
    assert "runtime_env" not in manager.ray_actor_options


def _by_command_line(folder):
    pad = "p" * 300  # the folder sits far past any terminal width in the command line
    return [pad, f"--temp-dir={folder}/s"], None


def _by_environment(folder):
    """As Ray's client server (``python -m ray.util.client.server --address=...``): no folder in its
    command line, only the environment ``start_head`` gave the cluster."""
    import os

    from rayapp.cli.local_cluster import CLUSTER_ENV

    return [], {**os.environ, CLUSTER_ENV: str(folder)}


@pytest.mark.parametrize("names_its_cluster", [_by_command_line, _by_environment])
def test_the_demo_finds_and_stops_exactly_its_own_cluster_processes(tmp_path, monkeypatch, names_its_cluster):
    import subprocess
    import sys

    from rayapp.cli import ray_processes, stop_cluster

    mine, other = tmp_path / "rayapp-x-12", tmp_path / "rayapp-x-123"
    procs = []
    for folder in (mine, other):
        args, env = names_its_cluster(folder)
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args], env=env))
    monkeypatch.setenv("COLUMNS", "40")  # as pytest sets it: ps must still see whole command lines
    try:
        assert ray_processes(mine) == [procs[0].pid]  # not the one whose folder only starts the same
        assert stop_cluster(mine, grace_s=5) == []
        assert procs[0].wait(timeout=10) is not None and procs[1].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("call", ["run_in_bundle", "open_sandbox"])
def test_finding_a_samples_bundle_does_not_block_the_managers_event_loop(monkeypatch, call):
    """Finding a token's placement group asks the GCS twice; the manager's loop runs every episode of the
    step meanwhile, so the asking happens in a thread (a slow GCS here: 0.3 s)."""
    import asyncio
    import time

    from rayapp.actors import pool_service, sandbox
    from rayapp.core.termination import SandboxError
    from rayapp.types import Token

    def slow_gcs(token):
        time.sleep(0.3)
        raise SandboxError("bundle gone")

    monkeypatch.setattr(pool_service, "work_options", slow_gcs)
    monkeypatch.setattr(sandbox, "bundle_strategy", slow_gcs)
    token = Token(1, "n0", (), 0.0, 1.0, 0.0, placement_group="rayapp-n0", bundle_index=0)

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        work = pool_service.run_in_bundle(token, sum, [1]) if call == "run_in_bundle" else sandbox.open_sandbox(token)
        with pytest.raises(SandboxError, match="bundle gone"):
            await work
        ticker.cancel()
        return ticks

    assert asyncio.run(main()) >= 10


def test_the_gateway_url_is_the_proxy_s_loopback_address_under_the_app_s_prefix():
    from rayapp.actors.http_errors import gateway_base_url

    assert gateway_base_url("127.0.0.1", 8000, "/rayapp") == "http://127.0.0.1:8000/rayapp/gateway"
    assert gateway_base_url("0.0.0.0", 8123, "/rayapp/") == "http://127.0.0.1:8123/rayapp/gateway"  # every interface
    assert gateway_base_url("localhost", 80, "/") == "http://127.0.0.1:80/gateway"
    assert gateway_base_url("::", 8000, "/x") == "http://[::1]:8000/x/gateway"
    assert gateway_base_url("10.1.2.3", 8000, "/x") == "http://10.1.2.3:8000/x/gateway"  # only there
    assert gateway_base_url("fd00::5", 8000, "/x") == "http://[fd00::5]:8000/x/gateway"
    assert gateway_base_url("head.internal", 8000, "/x") == "http://head.internal:8000/x/gateway"
    with pytest.raises(ValueError, match="route_prefix"):
        gateway_base_url("127.0.0.1", 8000, None)


def test_the_manager_serves_the_gateway_routes_from_their_own_module_each_bound_to_its_replica():
    """Issue 31 point 5: the agent gateway's routes live in ``actors/gateway_ingress.py`` and the manager's
    ingress includes them; the app still answers every route it did, each with its own parameters only
    (a ``self`` left as a query parameter would mean Serve did not bind the method to the replica)."""
    from rayapp.actors import gateway_ingress
    from rayapp.actors.manager import SchedulerRolloutManager, api

    paths = {path: sorted(ops) for path, ops in api.openapi()["paths"].items()}
    gateway = {f"/gateway/{{episode}}/v1/{r}": ["post"] for r in ("chat/completions", "responses", "completions")}
    assert paths == {**gateway, "/gateway/{episode}/v1/models": ["get"], "/status": ["get"],
                     "/placement": ["get"], "/healthz": ["get"], "/rollout/{rollout_id}": ["get", "post"],
                     "/eval/{rollout_id}": ["get", "post"]}
    for path, ops in api.openapi()["paths"].items():
        for op in ops.values():
            assert "self" not in {p["name"] for p in op.get("parameters", [])}, path
    assert issubclass(SchedulerRolloutManager, gateway_ingress.GatewayRoutes)
    own = {name for name, v in vars(SchedulerRolloutManager).items() if callable(v)}
    assert not {n for n in own if n.startswith("gateway_")}, "the gateway's routes belong to gateway_ingress.py"


def test_serve_run_gets_sigint_back_when_this_process_ignores_it():
    """A background job of a shell without job control ignores SIGINT, and a child inherits that: ``local_app``
    starts ``serve run`` through ``with_default_sigint`` so its Ctrl-C path (a clean shutdown) still works."""
    import signal
    import subprocess
    import sys

    from rayapp.cli.local_cluster import with_default_sigint

    probe = [sys.executable, "-c",
             "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"]
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        plain = subprocess.run(probe, capture_output=True, text=True, timeout=60).stdout.strip()
        wrapped = subprocess.run(with_default_sigint(probe), capture_output=True, text=True, timeout=60).stdout.strip()
    finally:
        signal.signal(signal.SIGINT, before)
    assert (plain, wrapped) == ("False", "True")

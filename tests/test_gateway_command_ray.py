"""The command adapter through a sandbox in its sample's bundle: the sandbox lives in a
``SandboxHost`` actor on real Ray (the session's local cluster, a placement group shaped as the
pool's), the bridge's host end runs in that actor (``BundleSandbox.exec_with_gateway``) and dials
the episode's gateway (uvicorn in this test) from there. The program's reply is the engine's, its
outcome comes back across the actor, and nothing of it is left when the sandbox closes."""

import asyncio

import pytest
from agent_helpers import InProcessEngine
from conftest import run
from gateway_helpers import episode_ctx, open_episode, served
from test_gateway_command import AGENT, VENV_BIN, backend  # noqa: F401 (backend: the module's fixture)

from rayapp.envs.sandboxes import SandboxLimits
from rayapp.envs.sandboxes._host import DEFAULT_PATH
from rayapp.gateway.command import CommandAgent
from rayapp.types import Sample, Token


@pytest.fixture
def token(ray_session):
    """A group of its own that asks for little, once the groups of pool services that earlier tests
    killed are gone (as in tests/test_work_hosts.py)."""
    import uuid

    from ray.util.placement_group import placement_group, remove_placement_group

    from rayapp.actors.pool_owners import remove_leftovers

    remove_leftovers(wait_s=30)
    name = f"test/command-bundle-{uuid.uuid4().hex[:8]}"
    pg = placement_group([{"CPU": 0.5}], name=name)
    try:
        ready, _ = ray_session.wait([pg.ready()], timeout=60)
        assert ready, f"the test's group could not be placed; free: {ray_session.available_resources()}"
        yield Token(0, "n0", (), 0.0, 0.5, 0.25, placement_group=name, bundle_index=0)
    finally:
        remove_placement_group(pg)


def test_a_command_agent_in_its_bundles_sandbox_reaches_its_gateway_and_its_outcome_comes_back(
        ray_session, token, tok, backend):  # noqa: F811
    from rayapp.actors.sandbox import BundleSandbox, open_sandbox

    async def main():
        async with served() as gw:
            port = int(gw.base_url.split(":")[2].split("/")[0])
            box = await open_sandbox(token, "local", SandboxLimits(wall_seconds=120, cpu_seconds=120),
                                     name="cmd", path=f"{VENV_BIN}:{DEFAULT_PATH}")
            try:
                client, _ = open_episode(gw, "cmd-ray", InProcessEngine(backend), tok, episode_ctx(max_new_tokens=8))
                await box.write_file("agent.py", AGENT)
                agent = CommandAgent(["python", "agent.py", "6", str(port)], collect=("answer.txt",))
                out = await agent(client, Sample("t-1", 0, "What is 2+2?"), box)
                pids = await box.exec(["sh", "-c", "ps -eo pid= | wc -l"])
            finally:
                await box.close()
            return box, out, await gw.close("cmd-ray"), port, pids

    box, out, log, port, _ = run(asyncio.wait_for(main(), 240))
    assert isinstance(box, BundleSandbox) and box.node_id == ray_session.get_runtime_context().get_node_id()
    assert out["exit_code"] == 3, out["stderr"]
    lines = out["stdout"].splitlines()
    assert f"blocked {port} ConnectionRefusedError" in lines  # the gateway only through the bridge
    assert "other episode 403" in lines
    assert "env ['OPENAI_AGENTS_DISABLE_TRACING', 'OPENAI_API_KEY', 'OPENAI_BASE_URL']" in lines
    assert log.calls == 1 and len(log.segments) == 1
    seg = log.segments[0]
    assert out["files"]["answer.txt"].strip() == tok.decode(seg.ids[seg.prompt_len:], skip_special_tokens=True).strip()

"""The command adapter: a program using the real ``openai`` SDK, run in a real local sandbox (its own
network namespace), reaches its episode's gateway through the bridge and nothing else on the host;
its exit code, output and files reach the caller; a timed-out or cancelled episode leaves no process
behind (checked in /proc) and its call in flight is aborted at the engine."""

import asyncio
import os
import socket
import sys

import pytest
from agent_helpers import InProcessEngine
from conftest import run
from gateway_helpers import HangingEngine, episode_ctx, open_episode, served

from rayapp.core.termination import AgentTimeout
from rayapp.envs.sandboxes import LocalProcessSandbox, SandboxLimits
from rayapp.envs.sandboxes._host import DEFAULT_PATH, count_processes
from rayapp.gateway.command import CommandAgent
from rayapp.types import Sample

VENV_BIN = os.path.dirname(sys.executable)  # the test's venv has openai; the sandbox sees it read-only
AGENT = """
import json, os, socket, sys, urllib.error, urllib.request
import openai

task = json.load(open("task.json"))
client = openai.OpenAI(max_retries=0, timeout=60)  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}],
                                       max_tokens=int(sys.argv[1]), seed=0)
for port in sys.argv[2:]:  # the host's other loopback ports: the gateway's own, an unrelated server
    try:
        socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
        print("reached", port)
    except OSError as e:
        print("blocked", port, type(e).__name__)
other = os.environ["OPENAI_BASE_URL"].rsplit("/", 2)[0] + "/another-episode/v1/models"
try:
    urllib.request.urlopen(urllib.request.Request(
        other, headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}), timeout=10)
    print("other episode answered")
except urllib.error.HTTPError as e:
    print("other episode", e.code)
with open("answer.txt", "w") as f:
    f.write(reply.choices[0].message.content)
print("env", sorted(k for k in os.environ if k.startswith("OPENAI")))
sys.exit(3)
"""


@pytest.fixture(scope="module")
def backend(model_dir):
    from rayapp.inference.hf import HFBackend

    b = HFBackend(str(model_dir), seed=0)
    yield b
    b.shutdown()


def sandbox(wall_seconds=120.0):
    return LocalProcessSandbox(SandboxLimits(wall_seconds=wall_seconds, cpu_seconds=120), name="cmd",
                               path=f"{VENV_BIN}:{DEFAULT_PATH}")


async def gone(box, within_s=10.0):
    """``leftovers`` once none are left, or as they are after ``within_s``: a SIGKILLed process's
    /proc entry stays until the kernel has torn it down and its parent reaped it, which a cancelled
    command's kill does not wait for."""
    async with asyncio.timeout(within_s):
        while (left := leftovers(box)) != (0, []):
            await asyncio.sleep(0.05)
    return left


def leftovers(box):
    """Processes of the sandbox's user, and any process whose command line names its folder."""
    base, found = os.path.dirname(box.workdir), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if base.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return (count_processes(box.uid) if box.uid is not None else 0), found


def test_a_command_agent_reaches_its_gateway_only_and_its_outcome_comes_back(tok, backend):
    async def main():
        with socket.create_server(("127.0.0.1", 0)) as unrelated:
            async with served() as gw, sandbox() as box:
                gw_port = int(gw.base_url.split(":")[2].split("/")[0])
                client, _ = open_episode(gw, "cmd-1", InProcessEngine(backend), tok, episode_ctx(max_new_tokens=8))
                await box.write_file("agent.py", AGENT)
                agent = CommandAgent(["python", "agent.py", "6", str(gw_port), str(unrelated.getsockname()[1])],
                                     collect=("answer.txt", "missing.txt"))
                out = await agent(client, Sample("t-1", 0, "What is 2+2?"), box)
                log = await gw.close("cmd-1")
                return out, log, box.network_isolated, await gone(box), gw_port, unrelated.getsockname()[1]

    out, log, isolated, left, gw_port, other_port = run(asyncio.wait_for(main(), 180))
    assert isolated, "this test needs the sandbox's own network namespace (root)"
    assert out["exit_code"] == 3, out["stderr"]
    lines = out["stdout"].splitlines()
    assert f"blocked {gw_port} ConnectionRefusedError" in lines
    assert f"blocked {other_port} ConnectionRefusedError" in lines
    assert "other episode 403" in lines  # the bridge passes its own episode's routes only
    assert "env ['OPENAI_AGENTS_DISABLE_TRACING', 'OPENAI_API_KEY', 'OPENAI_BASE_URL']" in lines
    assert log.calls == 1 and len(log.segments) == 1
    seg = log.segments[0]
    reply = tok.decode(seg.ids[seg.prompt_len:], skip_special_tokens=True)
    assert out["files"] == {"answer.txt": out["files"]["answer.txt"], "missing.txt": None}
    assert out["files"]["answer.txt"].strip() == reply.strip()
    assert left == (0, [])


HANG = """
import openai
openai.OpenAI(max_retries=0, timeout=600).chat.completions.create(
    model="m", messages=[{"role": "user", "content": "go on forever"}])
"""


@pytest.mark.parametrize("how", ["own clock", "episode cancelled"])
def test_a_timed_out_or_cancelled_command_leaves_nothing_running_and_its_call_is_aborted(tok, how):
    async def main():
        async with served() as gw, sandbox() as box:
            engine = HangingEngine()
            client, _ = open_episode(gw, "hang", engine, tok)
            await box.write_file("agent.py", HANG)
            agent = CommandAgent(["python", "agent.py"], timeout_s=20 if how == "own clock" else 100)
            run_it = agent(client, Sample("t-2", 0, "x"), box)
            while_running = None
            if how == "own clock":
                with pytest.raises(AgentTimeout):
                    await run_it
            else:
                task = asyncio.ensure_future(run_it)
                await asyncio.wait_for(engine.started.wait(), 60)
                while_running = leftovers(box)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert engine.started.is_set()  # the call was in flight when the command was killed
            left = await gone(box)
            log = await gw.close("hang")  # what the adapter does in its finally
            return engine, log, left, while_running, box.uid

    engine, log, left, while_running, uid = run(asyncio.wait_for(main(), 180))
    if while_running is not None and uid is not None:
        assert while_running[0] >= 2  # the bridge and the program were there, as the sandbox's user
    assert left == (0, [])  # the program and its bridge are gone, none of the sandbox user's processes left
    assert len(engine.aborted) == 1 and engine.aborted[0] and not engine.running
    assert log.calls == 0


@pytest.mark.parametrize(("head", "verdict"), [
    (b"POST /p/gateway/e1/v1/chat/completions HTTP/1.1\r\nContent-Length: 12\r\n\r\n", 12),
    (b"GET /p/gateway/e1/v1/models?x=1 HTTP/1.1\r\nHost: a\r\n\r\n", 0),
    (b"GET /p/gateway/e2/v1/models HTTP/1.1\r\n\r\n", 403),  # another episode
    (b"POST /p/rollout HTTP/1.1\r\nContent-Length: 2\r\n\r\n", 403),  # the manager's admin routes
    (b"GET /p/gateway/e1/v1/../../e2/v1/models HTTP/1.1\r\n\r\n", 403),
    (b"GET /p/gateway/e1/v1/%2e%2e/x HTTP/1.1\r\n\r\n", 403),
    (b"GET http://127.0.0.1:1/p/gateway/e1/v1/models HTTP/1.1\r\n\r\n", 403),  # absolute form
    (b"POST /p/gateway/e1/v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
    (b"POST /p/gateway/e1/v1/completions HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 90\r\n\r\n", 400),
    (b"POST /p/gateway/e1/v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"GET /p/gateway/e1/v1/models HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n", 400),
    (b"garbage\r\n\r\n", 400),
])
def test_the_bridge_passes_its_episodes_routes_with_a_plain_body_only(head, verdict):
    from rayapp.envs.sandboxes.bridge import check_head

    got = check_head(head, "/p/gateway/e1/v1")
    assert (got if isinstance(got, int) else got[0]) == verdict


def test_bad_input_is_refused_by_name():
    from rayapp.core.termination import SandboxError
    from rayapp.envs.sandboxes.bridge import exec_with_gateway

    for bad in ("python agent.py", [], ["python", ""]):
        with pytest.raises(ValueError, match="command: expected a non-empty list"):
            CommandAgent(bad)
    agent = CommandAgent(["true"])
    with pytest.raises(ValueError, match="runs in the sample's sandbox"):
        run(agent(None, Sample("t", 0, "x"), None))

    class Elsewhere:  # a sandbox kind with no bridge (Docker's today)
        async def exec(self, *a, **k):
            raise AssertionError("must not run without a bridge")

    with pytest.raises(SandboxError, match="has no gateway bridge"):
        run(exec_with_gateway(Elsewhere(), ["true"], "http://127.0.0.1:1/p/gateway/e/v1", "k"))


class Hanging(HangingEngine):
    def __init__(self, model_dir):
        super().__init__()
        self.model_dir = str(model_dir)

    async def info(self):
        return {"tokenizer_path": self.model_dir}


@pytest.mark.parametrize("hang", [False, True])
def test_through_the_evaluator_the_verifier_reads_the_command_s_outcome_or_the_episode_is_classified(
        tok, model_dir, backend, hang):
    # the command agent as the async-def adapter's agent: OpenAIAgent opens the episode and the
    # sandbox, the core Evaluator runs it under the episode's clock and calls the verifier
    from rayapp.core.contracts import StepContext
    from rayapp.core.evaluator import Evaluator, TaskRun
    from rayapp.gateway.agents import OpenAIAgent
    from rayapp.types import EvaluatorSpec, Resource, SamplingParams, Status, StoppingCriteria, Task, TaskConfig

    boxes = []

    async def open_sandbox(token):
        boxes.append(sandbox())
        await boxes[-1].write_file("agent.py", HANG if hang else AGENT)
        return boxes[-1]

    def verify(sample, result):
        out = result.metadata["agent_output"]
        return {"score": float(out["exit_code"] == 3 and out["files"]["answer.txt"] is not None)}

    engine = Hanging(model_dir) if hang else InProcessEngine(backend)

    async def go():
        async with served() as gw:
            command = ["python", "agent.py"] + ([] if hang else ["6"])
            handler = OpenAIAgent(gw, engine, CommandAgent(command, collect=("answer.txt",)), verify,
                                  open_sandbox=open_sandbox, call_timeout_s=60)
            task = Task("cmd-0", "What is 2+2?", TaskConfig("cmd", n_samples=1), label="4")
            samples = [Sample(task.task_id, 0, task.prompt, task.label)]
            group = TaskRun(task, samples, StoppingCriteria(max_turns=4, timeout_s=20.0 if hang else 120.0),
                            SamplingParams(max_new_tokens=8))
            await Evaluator(EvaluatorSpec("cmd", handler, resource=Resource(concurrency=1)), StepContext(0)).run(
                [group])
            return samples, len(gw), await gone(boxes[0])

    [s], still_open, left = run(asyncio.wait_for(go(), 180))
    assert still_open == 0 and left == (0, [])  # episode closed, no process of the command or its bridge left
    if hang:
        assert s.status is Status.ABORTED and s.episode.abort.reason == "agent_timeout"
        assert engine.aborted and not engine.running
    else:
        assert s.reward == {"score": 1.0} and s.metadata["gateway"]["calls"] == 1
        assert s.metadata["agent_output"]["exit_code"] == 3


DOCKER_AGENT = """
import json, openai
task = json.load(open("task.json"))
client = openai.OpenAI(max_retries=0, timeout=60)
reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": task["prompt"]}], max_tokens=6)
open("answer.txt", "w").write(reply.choices[0].message.content)
"""


def test_a_command_agent_in_a_docker_sandbox_reaches_its_episode_through_the_containers_bridge_folder(
        tok, backend, tmp_path):
    """The docker side of the bridge against a stand-in ``docker`` CLI (these machines have no Docker
    engine: it runs the container's commands here, in the sandbox's workdir): the container is started
    with its bridge folder mounted at the same path, the command finds its episode's gateway through the
    socket there, its outcome comes back, and the folder goes with the container."""
    from test_sandbox_docker import FAKE_DOCKER

    from rayapp.envs.sandboxes import DockerSandbox

    fake = tmp_path / "docker"
    fake.write_text(FAKE_DOCKER)
    fake.chmod(0o755)
    (tmp_path / "ws").mkdir()

    async def main():
        async with served() as gw:
            box = DockerSandbox("python:3.11", SandboxLimits(wall_seconds=60), docker=str(fake),
                                workdir=str(tmp_path / "ws"))
            async with box:
                mount = f"{box.bridge_dir}:{box.bridge_dir}"
                argv = " ".join(box.run_argv())
                client, _ = open_episode(gw, "cmd-docker", InProcessEngine(backend), tok, episode_ctx(max_new_tokens=6))
                await box.write_file("agent.py", DOCKER_AGENT)
                out = await CommandAgent([sys.executable, "agent.py"], collect=("answer.txt",))(
                    client, Sample("t-3", 0, "What is 2+2?"), box)
                during = os.listdir(box.bridge_dir)  # each command's bridge folder is gone once it ends
            return out, await gw.close("cmd-docker"), mount, argv, during, os.path.exists(box.bridge_dir)

    out, log, mount, argv, during, still_there = run(asyncio.wait_for(main(), 120))
    assert f"-v {mount}" in argv
    assert out["exit_code"] == 0, out["stderr"]
    seg = log.segments[0]
    assert log.calls == 1
    assert out["files"]["answer.txt"].strip() == tok.decode(seg.ids[seg.prompt_len:], skip_special_tokens=True).strip()
    assert during == [] and not still_there

"""An engine that Serve cannot route to for a while (issue 32, point 2): after its only replica dies,
or right after ``serve run`` starts, Serve's router refuses every call at once with
``DeploymentUnavailableError``. The engine client waits for the engine within each call's bound, says
so in ``state`` (the manager's status), and when the bound runs out fails with one line naming the
engine and its state; the weight restore before each step waits the same way. Over stand-in handles
that raise Serve's real error (no cluster)."""

import asyncio
import re

import pytest
from conftest import run
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError

import rayapp.actors.engine as engine_module
from rayapp.actors.engine import EngineClient
from rayapp.core.termination import EngineConnectionError, classify_abort
from rayapp.inference.client import GenerateOutput, GenerateRequest
from rayapp.inference.weight_sync import Applied, WeightSync

UNAVAILABLE = DeploymentUnavailableError(DeploymentID(name="engine-student", app_name="rayapp"))


@pytest.fixture(autouse=True)
def _short_pauses(monkeypatch):
    monkeypatch.setattr(engine_module, "UNAVAILABLE_PAUSES_S", (0.01,), raising=False)


class Response:
    """A Serve response whose await raises ``error`` (None: answers ``value``)."""

    def __init__(self, value, error):
        self.value, self.error = value, error

    def __await__(self):
        async def answer():
            if self.error is not None:
                raise self.error
            return self.value
        return answer().__await__()

    def cancel(self):
        pass


class Broadcast:
    def __init__(self, value, error):
        self.value, self.error = value, error

    async def results_async(self, timeout_s=None):
        if self.error is not None:
            raise self.error
        return self.value


class RestartingEngine:
    """An engine handle that Serve cannot route to for its first ``refusals`` calls, then answers."""

    def __init__(self, refusals: int, seen: list | None = None, client: list | None = None):
        self.refusals, self.calls, self.seen, self.client = refusals, 0, seen, client
        outer = self

        class Generate:
            @staticmethod
            def remote(req):
                return Response(GenerateOutput("r1", [7], [-0.5], "stop", engine="hf"), outer._refused())

        self.generate = Generate()

    def _refused(self):
        self.calls += 1
        if self.seen is not None and self.client:
            self.seen.append(self.client[0].state())
        return UNAVAILABLE if self.calls <= self.refusals else None

    def broadcast(self, method, *args):
        return Broadcast([{"ok": True, "method": method, "args": list(args)}], self._refused())


def test_a_call_waits_while_serve_has_no_replica_then_answers_and_the_state_says_so():
    seen, box = [], []
    handle = RestartingEngine(refusals=4, seen=seen, client=box)
    client = EngineClient(handle, "student", timeout_s=60)
    box.append(client)
    out = run(client.generate(GenerateRequest([1, 2])))
    assert out.output_ids == [7] and handle.calls == 5
    assert seen[0] == {"available": True}  # before the first refusal
    assert all(s["available"] is False and s["unavailable_s"] >= 0 for s in seen[1:])
    assert client.state() == {"available": True}


def test_a_call_whose_bound_runs_out_waiting_is_one_line_naming_the_engine_and_its_state():
    client = EngineClient(RestartingEngine(refusals=10**9), "student", timeout_s=0.2)
    with pytest.raises(EngineConnectionError) as err:
        run(client.generate(GenerateRequest([1])))
    message = str(err.value)
    assert re.match(r"engine student unavailable for \d+s: Serve has no running replica of it", message), message
    assert "\n" not in message and "engine-student" in message
    assert classify_abort(err.value).value == "infra_conn"
    assert client.state()["available"] is False


def test_the_weight_restore_before_a_step_waits_for_the_engine():
    handle = RestartingEngine(refusals=3)
    client = EngineClient(handle, "student")
    sync = WeightSync({"student": client})
    sync.applied["student"] = Applied("/ckpt/step-3", 3)
    sync._adopted = True
    run(sync.restore())
    assert handle.calls == 4 and client.state() == {"available": True}
    replies = run(client.update_weights_from_disk("/ckpt/step-3", 3))
    assert replies == [{"ok": True, "method": "update_weights_from_disk", "args": ["/ckpt/step-3", 3]}]


def test_an_abort_with_no_replica_running_aborts_nothing_at_once():
    handle = RestartingEngine(refusals=10**9)
    assert run(EngineClient(handle, "student").abort("r1")) == 0 and handle.calls == 1


def test_a_cancelled_call_stops_waiting():
    client = EngineClient(RestartingEngine(refusals=10**9), "student", timeout_s=60)

    async def main():
        task = asyncio.ensure_future(client.generate(GenerateRequest([1])))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())

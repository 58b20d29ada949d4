"""Bounded remote calls (``rayapp.actors.remote``) and the clients built on them, over stand-in
handles (no cluster): timeouts and cancellation cancel the call; Ray's errors map to the classes
the core counts (a lost engine is infra_conn, a lost sandbox infra_sandbox, a late answer
agent_timeout); a remote task's own error comes back as itself."""

import asyncio

import pytest
from conftest import run
from ray.exceptions import ActorDiedError, RayActorError, RayTaskError, WorkerCrashedError

from rayapp.actors.engine import EngineClient
from rayapp.actors.pool_client import PoolClient
from rayapp.actors.pool_wire import pack, unpack_request, unpack_tokens
from rayapp.actors.remote import bounded, is_lost
from rayapp.actors.sandbox import BundleSandbox
from rayapp.core.termination import AgentTimeout, EngineConnectionError, SandboxError, classify_abort
from rayapp.envs.sandboxes import SandboxLimits
from rayapp.inference.client import GenerateRequest
from rayapp.types import BatchRequest, Resource, Token


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


async def hang(*a, **kw):
    await asyncio.sleep(3600)


def raising(error):
    async def fn(*a, **kw):
        raise error

    return fn


# ---- bounded ----------------------------------------------------------------------------------------


def test_bounded_returns_the_answer_and_cancels_nothing():
    async def answer():
        return 42

    response = FakeResponse(answer())
    assert run(bounded(response, 1)) == 42 and not response.cancelled


def test_a_timeout_cancels_the_call_and_raises_the_callers_error():
    response = FakeResponse(hang())
    with pytest.raises(AgentTimeout, match="late"):
        run(bounded(response, 0.01, late=lambda: AgentTimeout("late")))
    assert response.cancelled
    response = FakeResponse(hang())
    with pytest.raises(TimeoutError):
        run(bounded(response, 0.01))  # no late error named: the TimeoutError itself
    assert response.cancelled


def test_a_cancelled_caller_cancels_the_call():
    async def main():
        response = FakeResponse(hang())
        task = asyncio.create_task(bounded(response, 3600, late=lambda: AgentTimeout("late")))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return response

    assert run(main()).cancelled


def test_a_remote_error_comes_back_as_its_cause_and_a_lost_callee_as_the_callers_error():
    task_error = RayTaskError("f", "ValueError: bad input", ValueError("bad input"))
    with pytest.raises(ValueError, match="bad input"):
        run(bounded(FakeResponse(raising(task_error)()), 1, lost=lambda e: SandboxError(f"lost: {e}")))
    for gone in (RayActorError(), ActorDiedError(), WorkerCrashedError()):
        with pytest.raises(SandboxError, match="lost") as info:
            run(bounded(FakeResponse(raising(gone)()), 1, lost=lambda e: SandboxError(f"lost: {e}")))
        assert info.value.__cause__ is gone
    with pytest.raises(RayActorError):  # no lost error named: Ray's own
        run(bounded(FakeResponse(raising(RayActorError())()), 1))
    # a TimeoutError the callee raised is its own, not a late answer
    with pytest.raises(TimeoutError, match="inside"):
        run(bounded(FakeResponse(raising(TimeoutError("inside"))()), 1, late=lambda: AgentTimeout("late")))
    assert is_lost(RayActorError()) and not is_lost(ValueError("died"))


# ---- the engine client ------------------------------------------------------------------------------


def test_engine_client_times_out_cancels_and_classifies():
    handle = FakeHandle(generate=hang)
    with pytest.raises(AgentTimeout, match=r"engine student\.generate gave no answer within 0s") as info:
        run(EngineClient(handle, "student", timeout_s=0.05).generate(GenerateRequest([1])))
    assert handle.responses[0].cancelled  # the replica stops generating for nobody
    assert classify_abort(info.value).value == "agent_timeout"


def test_engine_client_maps_a_dead_replica_to_infra_conn():
    with pytest.raises(EngineConnectionError, match="engine student unreachable") as info:
        run(EngineClient(FakeHandle(generate=raising(RayActorError())), "student").generate(GenerateRequest([1])))
    assert classify_abort(info.value).value == "infra_conn"


def test_engine_client_cancels_the_request_of_a_cancelled_episode():
    async def main():
        handle = FakeHandle(generate=hang)
        task = asyncio.create_task(EngineClient(handle, "student").generate(GenerateRequest([1])))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return handle

    assert run(main()).responses[0].cancelled


# ---- the sandbox --------------------------------------------------------------------------------------


def test_bundle_sandbox_maps_a_late_answer_and_a_lost_host_to_infra_sandbox():
    limits = SandboxLimits(wall_seconds=1, cpu_seconds=1)
    actor = FakeHandle(write_file=hang, read_file=raising(RayActorError()), exec=raising(RayTaskError(
        "exec", "AgentTimeout: command ran past its limit", AgentTimeout("command ran past its limit"))))
    box = BundleSandbox(actor, limits, "bundle g[0] on n", "g")
    with pytest.raises(SandboxError, match=r"sandbox in bundle g\[0\] on n: write_file gave no answer"):
        run(box._call("write_file", "x", "y", timeout_s=0.01))
    assert actor.responses[0].cancelled
    with pytest.raises(SandboxError, match="was lost") as info:
        run(box.read_file("x"))
    assert classify_abort(info.value).value == "infra_sandbox"
    with pytest.raises(AgentTimeout, match="ran past its limit"):  # the host's own error, as it raised it
        run(box.exec("sleep 9"))


# ---- the pool client --------------------------------------------------------------------------------

TOKENS = [Token(1, "n", (0,), 0.5, 1.0, 1.0, "rayapp/x/1", 0)]


def test_pool_client_sends_one_packed_request_stamped_with_its_owner():
    """The one wire format: the request and the tokens travel as msgpack bytes (``pool_wire``)."""
    seen = []

    async def acquire_batch(request, request_id):
        seen.append(request)
        return pack(TOKENS)

    async def release_batch(tokens):
        seen.append(tokens)

    client = PoolClient(FakeHandle(acquire_batch=acquire_batch, release_batch=release_batch), owner="m")
    request = BatchRequest(Resource(), Resource(), 1, label="r0/b0/x", timeout_s=5)
    assert run(client.acquire_batch(request)) == TOKENS
    run(client.release_batch(TOKENS))
    assert all(type(x) is bytes for x in seen)
    assert unpack_request(seen[0]) == BatchRequest(Resource(), Resource(), 1, label="r0/b0/x", owner="m", timeout_s=5)
    assert unpack_tokens(seen[1], "release_batch") == TOKENS


def test_pool_client_bounds_a_wait_by_its_timeout_plus_the_trip():
    handle = FakeHandle(acquire_batch=hang)
    client = PoolClient(handle, owner="m", call_timeout_s=0.02)
    with pytest.raises(TimeoutError):
        run(client.acquire_batch(BatchRequest(Resource(), Resource(), 1, timeout_s=0.02)))
    assert handle.responses[0].cancelled  # the pool must not grant a batch nobody waits for


def test_pool_client_cancels_a_call_it_stops_waiting_for():
    handle = FakeHandle(release_batch=hang)
    with pytest.raises(TimeoutError):
        run(PoolClient(handle, owner="m", call_timeout_s=0.05).release_batch(TOKENS))
    assert handle.responses[0].cancelled


def test_pool_client_retries_a_release_that_got_no_answer_and_logs_it(caplog):
    from rayapp.core.pool import PoolError

    calls = []

    async def flaky(tokens):
        calls.append(tokens)
        if len(calls) == 1:
            raise WorkerCrashedError()
        if len(calls) == 2:
            await asyncio.sleep(3600)  # no answer within the bound

    client = PoolClient(FakeHandle(release_batch=flaky), owner="m", call_timeout_s=0.05)
    run(client.release_batch(TOKENS))
    assert [unpack_tokens(c, "release_batch") for c in calls] == [TOKENS] * 3
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 2
    refused = PoolClient(FakeHandle(release_batch=raising(PoolError("released whole"))), owner="m")
    with pytest.raises(PoolError):
        run(refused.release_batch(TOKENS))  # a refusal is not retried

"""Faults injected in the middle of episodes, on real Ray (one local session with logical GPUs): a
sandbox killed while its command runs, an engine replica killed during the episode, an episode
that runs out of time. Each comes back as an ABORTED dummy with the right class, the other samples
finish, and the pool ends where it began."""

import asyncio

import pytest
from ray_helpers import pool_service

from rayapp.trainers.converters import trainer_metadata
from rayapp.types import EvaluatorSpec, Resource, Status, Task, TaskConfig

LAYOUT = '{"127.0.0.1": {"gpus": [0, 1], "cpu": 8, "memory_gb": 4}}'


@pytest.fixture
def pool(ray_session):
    from rayapp.actors.pool_client import PoolClient

    ray = ray_session
    with pool_service(ray, LAYOUT) as actor:
        initial = ray.get(actor.snapshot.remote(), timeout=60)
        yield PoolClient(actor, "faults")
        assert ray.get(actor.snapshot.remote(), timeout=60) == initial, "the pool did not end where it began"
        assert ray.get(actor.placement.remote(), timeout=60)["batches"] == {}


class Source:
    def __init__(self, kinds):
        self.kinds = kinds

    async def get_tasks(self, n):
        return [Task(f"{k}-{i}", "What is 2 + 2?", TaskConfig("faults"), label="4", metadata={"fault": k})
                for i, k in enumerate(self.kinds)]


def spec(agent, timeout_s=None):
    from rayapp.types import StoppingCriteria

    return EvaluatorSpec("faults", agent, resource=Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1),
                         run_resource=Resource(gpu=0.25, cpu=0.5, memory_gb=0.25),
                         default_stopping=StoppingCriteria(timeout_s=timeout_s))


def test_killed_sandbox_killed_engine_and_timeout_abort_with_their_class(ray_session, pool, model_dir):
    ray = ray_session
    from rayapp.actors.engine import EngineClient, InferenceEngine
    from rayapp.actors.sandbox import open_sandbox
    from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
    from rayapp.envs.agents.chat import ChatAgent
    from rayapp.envs.arithmetic import verify
    from rayapp.envs.sandboxes import SandboxLimits

    engine = ray.remote(InferenceEngine).options(num_cpus=0).remote("hf", model_path=str(model_dir))
    ray.get(engine.info.remote(), timeout=120)
    limits = SandboxLimits(wall_seconds=60, cpu_seconds=60)

    class FaultyAgent(ChatAgent):
        """A real chat agent; each task's metadata names the fault injected into its episode."""

        async def run(self, sample, ctx):
            fault = sample.metadata["fault"]
            if fault == "engine":  # the replica dies during the episode, before its request lands
                ray.kill(engine)   # (the tiny model answers in ~0.1 s: killing it mid-generation races)
                return await super().run(sample, ctx)
            if fault in ("sandbox", "timeout"):
                sandbox = await open_sandbox(ctx.token, limits=limits)
                try:
                    command = asyncio.ensure_future(sandbox.exec("sleep 30"))
                    await asyncio.sleep(1.0)
                    if fault == "sandbox":
                        ray.kill(sandbox.actor)  # the sandbox's host process is gone mid-command
                    return await command
                finally:
                    await sandbox.close()
            return await super().run(sample, ctx)

    agent = FaultyAgent(EngineClient(engine, "student", timeout_s=60), verify)
    sched_ok = TaskScheduler([spec(agent, timeout_s=20)], Source(["ok", "sandbox", "ok"]), pool,
                             SchedulerConfig(rollout_batch_size=3, progress=False))
    result = asyncio.run(sched_ok.execute_rollout(0))
    by_kind = {g[0].metadata["fault"] + str(i): g[0] for i, g in enumerate(result.groups)}
    assert by_kind["sandbox1"].status is Status.ABORTED
    assert trainer_metadata(by_kind["sandbox1"])["_termination_reason"] == "infra_sandbox"
    assert by_kind["ok0"].status is Status.COMPLETED and by_kind["ok2"].status is Status.COMPLETED

    sched_t = TaskScheduler([spec(agent, timeout_s=3)], Source(["timeout"]), pool,
                            SchedulerConfig(rollout_batch_size=1, progress=False))
    timed_out = asyncio.run(sched_t.execute_rollout(1)).groups[0][0]
    assert timed_out.status is Status.ABORTED and trainer_metadata(timed_out)["_termination_reason"] == "agent_timeout"

    sched_e = TaskScheduler([spec(agent, timeout_s=60)], Source(["engine"]), pool,
                            SchedulerConfig(rollout_batch_size=1, progress=False))
    lost = asyncio.run(sched_e.execute_rollout(2)).groups[0][0]
    assert lost.status is Status.ABORTED and trainer_metadata(lost)["_termination_reason"] == "infra_conn"
    for s in (by_kind["sandbox1"], timed_out, lost):
        assert s.remove_sample and s.loss_mask == [0] and s.tokens == [0, 0] and s.reward == {"score": 0.0}
        assert trainer_metadata(s)["_abort"]["phase"] == "run" and trainer_metadata(s)["_abort"]["node"] == "127.0.0.1"


def test_work_sent_to_a_lost_bundle_is_a_sandbox_fault_at_once(ray_session):
    """A group Ray no longer holds (its node died; here: removed under the pool) fails the work sent
    there at once, as infra_sandbox, instead of leaving it waiting for a bundle that never returns."""
    ray = ray_session
    from rayapp.actors.pool_client import PoolClient
    from rayapp.actors.pool_service import run_in_bundle
    from rayapp.actors.sandbox import open_sandbox
    from rayapp.core.termination import AbortReason, SandboxError, classify_abort
    from rayapp.types import BatchRequest

    with pool_service(ray, LAYOUT) as actor:
        client = PoolClient(actor, "lost")
        per_sample = Resource(gpu=0.25, cpu=0.5, memory_gb=0.25)
        request = BatchRequest(Resource(gpu=0.5, concurrency=2, cpu=1, memory_gb=0.5), per_sample, 2, label="lost")

        async def scenario():
            tokens = await client.acquire_batch(request)
            try:
                assert await run_in_bundle(tokens[0], sum, [1, 2], timeout_s=60) == 3  # the bundle works
                ray.util.remove_placement_group(ray.util.get_placement_group(tokens[0].placement_group))
                with pytest.raises(SandboxError, match=r"bundle rayapp/node/127\.0\.0\.1@\w+\[\d\] on 127\.0\.0\.1 is"):
                    await run_in_bundle(tokens[0], sum, [1, 2], timeout_s=60)
                with pytest.raises(SandboxError, match=r"is (lost|gone)"):
                    await open_sandbox(tokens[1])
                placement = await client.placement()
                assert placement["lost_nodes"] == ["127.0.0.1"] and placement["cordoned"] == ["127.0.0.1"]
            finally:
                await client.release_batch(tokens)
            # Sent again once the group is removed (as a restarted pool removes it): the same class.
            for attempt in (run_in_bundle(tokens[0], sum, [1, 2], timeout_s=60), open_sandbox(tokens[1])):
                with pytest.raises(SandboxError, match=r"is (lost|gone)") as info:
                    await attempt
                assert classify_abort(info.value) is AbortReason.INFRA_SANDBOX

        asyncio.run(scenario())


# ---- work waiting on a bundle whose group Ray reports lost ---------------------------------------------


def _hang(cancelled: list):
    async def hang():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
    return hang()


async def _fail_after(seconds: float):
    await asyncio.sleep(seconds)
    raise KeyError("the work's own error")


def test_a_wait_on_bundle_work_ends_as_infra_sandbox_once_its_group_is_lost_and_cancels_the_work():
    from rayapp.actors.bundle_watch import GroupStates, watched
    from rayapp.core.clock import run_virtual
    from rayapp.core.termination import AbortReason, SandboxError, classify_abort

    reported = {"g": "CREATED", "other": "CREATED"}
    states = GroupStates(max_age_s=1.0, read=lambda: dict(reported))
    cancelled: list = []

    async def scenario():
        waiter = asyncio.create_task(watched(_hang(cancelled), "g", "bundle g[0] on n", states))
        bystander = asyncio.create_task(watched(_hang([]), "other", "bundle other[0] on n", states))
        await asyncio.sleep(30)
        assert not waiter.done() and not cancelled  # its group is CREATED: it waits as long as the work
        reported["g"] = "RESCHEDULING"
        with pytest.raises(SandboxError, match=r"bundle g\[0\] on n is lost .*RESCHEDULING") as info:
            await waiter
        assert classify_abort(info.value) is AbortReason.INFRA_SANDBOX
        assert cancelled == [True]  # the work itself was cancelled, not left running for nobody
        await asyncio.sleep(5)
        assert not bystander.done()  # another group's work is untouched
        bystander.cancel()
        # Work that ends first gives its own result or error, whatever its group's state.
        assert await watched(asyncio.sleep(0.5, "done"), "g", "w", states) == "done"
        with pytest.raises(KeyError, match="own error"):
            await watched(_fail_after(0.5), "other", "w", states)

    run_virtual(scenario())


def test_an_unreadable_group_table_is_not_a_lost_group_and_waiters_share_one_read_per_period():
    from rayapp.actors.bundle_watch import GroupStates, watched
    from rayapp.core.clock import run_virtual

    reads: list = []

    def read():
        reads.append(1)  # counted; the GCS answers with an error
        raise TimeoutError("GCS unavailable")

    states = GroupStates(max_age_s=1.0, read=read)

    async def scenario():
        waiters = [asyncio.create_task(watched(asyncio.sleep(20, i), "g", "w", states)) for i in range(50)]
        return await asyncio.gather(*waiters)

    assert run_virtual(scenario()) == list(range(50))  # nothing known of the group: the work ran to its end
    assert 0 < len(reads) <= 21  # 50 waiters polling every second for 20 s: one shared read per period


def test_work_still_waiting_for_its_bundle_when_the_group_is_lost_aborts_and_leaves_the_bundle_free(
        ray_session, pool, monkeypatch):
    """Ray keeps a task that waits for a bundle pending while its group is RESCHEDULING (a dead node;
    here the group's state is reported so, since one local node cannot lose itself): the wait ends as
    infra_sandbox, and the waiting and running tasks are cancelled, so the bundle serves again."""
    import time

    from rayapp.actors import bundle_watch
    from rayapp.actors.pool_service import run_in_bundle
    from rayapp.core.termination import SandboxError
    from rayapp.types import BatchRequest

    quarter = Resource(gpu=0.25, cpu=0.5, memory_gb=0.25)
    request = BatchRequest(Resource(gpu=1.0, concurrency=4, cpu=2, memory_gb=1), quarter, 4, label="full")

    async def scenario():
        tokens = await pool.acquire_batch(request)
        try:
            assert len({(t.placement_group, t.bundle_index) for t in tokens}) == 1  # four quarters, one GPU
            # run_in_bundle reads the group's options in a thread before it submits: the waiting task goes
            # in only once the four busy ones hold the bundle's GPU (quarter tokens ask for GPU, not CPU),
            # or it could take a slot before them
            group_id = ray_session.util.get_placement_group(tokens[0].placement_group).id.hex()
            used = f"GPU_group_{tokens[0].bundle_index}_{group_id}"
            free = ray_session.available_resources
            for _ in range(300):  # the GCS's view of the new group's bundles may lag its creation
                if free().get(used) == 1.0:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"{used} never showed as free: {free()}")
            busy = [asyncio.create_task(run_in_bundle(t, time.sleep, 600, timeout_s=900)) for t in tokens]
            for _ in range(600):
                if free().get(used, 0.0) < 0.25:  # absent: all of it in use
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"the four busy tasks never held {used}: {free()}")
            waiting = asyncio.create_task(run_in_bundle(tokens[0], sum, [1, 2], timeout_s=900))
            await asyncio.sleep(3)
            assert not waiting.done()  # the bundle is full: Ray keeps it pending
            real = bundle_watch.read_group_states
            monkeypatch.setattr(bundle_watch.STATES, "read", lambda: {**real(), group_id: "RESCHEDULING"})
            for work in (waiting, *busy):
                with pytest.raises(SandboxError, match="is lost while work waited there"):
                    await asyncio.wait_for(work, 120)
            monkeypatch.setattr(bundle_watch.STATES, "read", real)
            await asyncio.sleep(2 * bundle_watch.LOST_POLL_S)  # the next reading sees the group CREATED
            # Nothing of the cancelled work holds the bundle: four quarters fit again at once.
            assert await asyncio.gather(*(run_in_bundle(t, sum, [1, 2], timeout_s=120) for t in tokens)) == [3] * 4
        finally:
            await pool.release_batch(tokens)

    asyncio.run(scenario())


def test_a_sandbox_host_that_cannot_start_in_a_removed_group_is_a_sandbox_fault():
    """Ray refuses to create a host whose bundle's group was removed after the sample looked it up
    (a pool replica restarting): that is the lost-bundle class, like every other."""
    from ray.exceptions import ActorUnschedulableError

    from rayapp.actors.sandbox import BundleSandbox
    from rayapp.core.termination import AbortReason, SandboxError, classify_abort
    from rayapp.envs.sandboxes import SandboxLimits

    async def refused():
        raise ActorUnschedulableError("Could not create the actor because its associated placement group was "
                                      "removed.")

    class Host:
        class start:  # an actor method's shape: start.remote(...)
            @staticmethod
            def remote(*args):
                return refused()

    box = BundleSandbox(Host(), SandboxLimits(wall_seconds=1, cpu_seconds=1), "bundle g[0] on n", "g")
    with pytest.raises(SandboxError, match=r"sandbox in bundle g\[0\] on n could not start") as info:
        asyncio.run(box.start())
    assert classify_abort(info.value) is AbortReason.INFRA_SANDBOX

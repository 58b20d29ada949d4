import asyncio
import logging

import msgspec
import pytest
from conftest import run

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import run_virtual
from rayapp.core.scheduler import DeadlockError, SchedulerConfig, StepState, TaskScheduler, interleave
from rayapp.envs.arithmetic import ArithmeticSource, arithmetic_spec, verify
from rayapp.trainers.converters import trainer_metadata
from rayapp.types import AgentResult, Batch, EvaluatorSpec, Resource, Sample, Status, StoppingCriteria, Task, TaskConfig


class Source:
    """A data source handing out the same fixed tasks on every fetch."""

    def __init__(self, tasks):
        self.tasks = tasks

    async def get_tasks(self, n):
        return list(self.tasks[:n])


ONE_NODE = '{"n0": {"gpus": [0], "cpu": 8, "memory_gb": 64}}'
TWO_NODES = '{"n0": {"gpus": [0, 1], "cpu": 8, "memory_gb": 64}, "n1": {"gpus": [0, 1], "cpu": 8, "memory_gb": 64}}'


def test_rollout_runs_every_task_and_returns_groups_in_fetch_order(make_pool):
    pool = make_pool(TWO_NODES)
    streamed = []
    sched = TaskScheduler([arithmetic_spec(batch_size=2)], ArithmeticSource(seed=3, n_samples=3), pool,
                          SchedulerConfig(rollout_batch_size=5, progress=False))

    async def stream(task, samples):
        streamed.append(task.task_id)

    result = run(sched.execute_rollout(0, on_task_done=stream))
    assert [g[0].task_id for g in result.groups] == [f"arithmetic-3-{i}" for i in range(5)]
    assert sorted(streamed) == sorted(g[0].task_id for g in result.groups)
    for group in result.groups:
        assert [s.index for s in group] == [0, 1, 2]
        for s in group:
            assert s.status is Status.COMPLETED
            as_verified = verify(s, AgentResult(tokens=[], response_length=0, response=s.response))
            assert s.reward["score"] == as_verified["score"]
            assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
            assert trainer_metadata(s)["_placement"]["node"] in {"n0", "n1"}
    assert result.metrics["rollout/success"] + result.metrics["rollout/wrong_answer"] == 15
    st = sched.status()
    assert st.tasks_done == st.tasks == 5 and st.samples_done == 15 and st.phase == "rollout done"
    assert st.state is StepState.DONE and st.as_dict()["phase"] == "rollout done"


def test_no_pool_means_ungated_batches():
    seen = []

    def run_fn(sample, ctx):
        seen.append(ctx.token)
        return AgentResult(tokens=[1, 2], response_length=1, response="x")

    spec = EvaluatorSpec("arithmetic", FunctionAgent(run_fn, lambda s, r: {"score": 1.0}))
    result = run(TaskScheduler([spec], ArithmeticSource(), None,
                               SchedulerConfig(rollout_batch_size=3, progress=False)).execute_rollout(1))
    assert len(result.groups) == 3 and seen == [None, None, None]


def test_deadlock_check_fails_fast_naming_the_spec_and_both_numbers(make_pool):
    pool = make_pool(ONE_NODE)  # one GPU: four quarter-GPU tokens at most
    spec = arithmetic_spec("arith", concurrency=8, batch_size=8, gpu=0.25)
    calls = []
    spec.handler.run_fn = lambda s, c: calls.append(s)
    source = ArithmeticSource(task_type="arith")
    sched = TaskScheduler([spec], source, pool, SchedulerConfig(rollout_batch_size=8, progress=False))
    with pytest.raises(DeadlockError, match=r"EvaluatorSpec 'arith' needs 8 placement tokens but the pool can "
                                            r"only provide 4"):
        run(sched.execute_rollout(0))
    assert calls == []  # nothing ran


def test_deadlock_check_counts_only_what_the_budget_asks_for(make_pool):
    # a budget of 4 tokens fits the 4-token pool, even though the batch has 8 samples
    pool = make_pool(ONE_NODE)
    sched = TaskScheduler([arithmetic_spec(concurrency=4, batch_size=8, gpu=0.25)], ArithmeticSource(), pool,
                          SchedulerConfig(rollout_batch_size=8, progress=False))
    assert len(run(sched.execute_rollout(0)).groups) == 8


def test_a_budget_that_admits_nothing_is_reported(make_pool):
    spec = EvaluatorSpec("arithmetic", None, resource=Resource(cpu=0), run_resource=Resource(cpu=1))
    sched = TaskScheduler([spec], ArithmeticSource(), make_pool(ONE_NODE), SchedulerConfig(progress=False))
    with pytest.raises(DeadlockError, match="admits no sample"):
        run(sched.execute_rollout(0))


def test_oversubscribed_batches_wait_and_are_admitted_when_others_release(make_pool):
    pool = make_pool(ONE_NODE)
    running, peak = [0], [0]

    async def run_fn(sample, ctx):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.02)
        running[0] -= 1
        return AgentResult(tokens=[1, 2], response_length=1, response=str(sample.label))

    # each batch's budget takes the whole GPU, so batches must run one after another
    spec = EvaluatorSpec("arithmetic", FunctionAgent(run_fn, verify), batch_size=4,
                         resource=Resource(gpu=1.0, concurrency=4, cpu=4, memory_gb=8),
                         run_resource=Resource(gpu=0.25, cpu=1, memory_gb=2))
    result = run(TaskScheduler([spec], ArithmeticSource(), pool,
                               SchedulerConfig(rollout_batch_size=12, progress=False)).execute_rollout(0))
    assert all(s.status is Status.COMPLETED and s.reward["score"] == 1.0 for g in result.groups for s in g)
    assert peak[0] == 4  # never more than one batch's worth at once


def test_one_failing_sample_never_fails_the_step(make_pool):
    def run_fn(sample, ctx):
        if sample.task_id.endswith("-1"):
            raise ConnectionResetError("engine went away")
        return AgentResult(tokens=[1, 2], response_length=1, response=str(sample.label))

    spec = EvaluatorSpec("arithmetic", FunctionAgent(run_fn, verify), resource=Resource(concurrency=2, cpu=2),
                         run_resource=Resource(cpu=1))
    result = run(TaskScheduler([spec], ArithmeticSource(), make_pool(ONE_NODE),
                               SchedulerConfig(rollout_batch_size=3, progress=False)).execute_rollout(0))
    statuses = [g[0].status for g in result.groups]
    assert statuses == [Status.COMPLETED, Status.ABORTED, Status.COMPLETED]
    assert trainer_metadata(result.groups[1][0])["_termination_reason"] == "infra_conn"
    assert result.metrics["rollout/infra_conn"] == 1


def test_a_failing_callback_fails_the_step_and_every_token_is_returned(make_pool):
    pool = make_pool(TWO_NODES)

    async def on_done(task, samples):
        raise RuntimeError("collector broke")

    sched = TaskScheduler([arithmetic_spec(batch_size=1)], ArithmeticSource(), pool,
                          SchedulerConfig(rollout_batch_size=6, progress=False), on_task_done=on_done)
    with pytest.raises(ExceptionGroup) as info:
        run(sched.execute_rollout(0))
    assert info.group_contains(RuntimeError, match="collector broke")
    assert sched.status().phase == "rollout failed"


def test_unknown_evaluator_id_warns_once_and_falls_back_to_the_first_spec(make_pool, caplog):
    tasks = [Task(f"t{i}", "What is 1 + 1?", TaskConfig("mystery"), label="2") for i in range(3)]

    class Source:
        async def get_tasks(self, n):
            return tasks[:n]

    sched = TaskScheduler([arithmetic_spec("first", error_rate=0), arithmetic_spec("second")], Source(),
                          make_pool(TWO_NODES), SchedulerConfig(rollout_batch_size=3, progress=False))
    with caplog.at_level(logging.WARNING):
        result = run(sched.execute_rollout(0))
    assert sum("no EvaluatorSpec 'mystery'" in r.message for r in caplog.records) == 1
    assert all(g[0].reward["score"] == 1.0 for g in result.groups)


def test_a_task_fetched_twice_gets_a_group_of_its_own():
    task = Task("same", "What is 2 + 2?", TaskConfig("arithmetic"), label="4")

    class Source:
        async def get_tasks(self, n):
            return [task, task]

    sched = TaskScheduler([arithmetic_spec(error_rate=0)], Source(), None, SchedulerConfig(progress=False))
    result = run(sched.execute_rollout(0))
    assert len(result.groups) == 2 and result.groups[0][0] is not result.groups[1][0]


def test_cascade_reaches_the_agent_and_a_bad_dataset_cfg_fails_before_anything_runs(make_pool):
    seen = []

    def run_fn(sample, ctx):
        seen.append((ctx.stopping.max_turns, ctx.stopping.max_context_len, ctx.sampling.temperature))
        return AgentResult(tokens=[1, 2], response_length=1)

    task = Task("t", "p", TaskConfig("arithmetic"), metadata={"_dataset_cfg": {"max_turns": 9}})
    spec = EvaluatorSpec("arithmetic", FunctionAgent(run_fn, lambda s, r: {"score": 0.0}),
                         default_stopping=StoppingCriteria(max_context_len=100))
    sched = TaskScheduler([spec], Source([task]), None,
                          SchedulerConfig(global_stopping=StoppingCriteria(max_turns=1, max_context_len=10),
                                          progress=False))
    run(sched.execute_rollout(0))
    assert seen == [(9, 100, None)]
    bad = msgspec.structs.replace(task, metadata={"_dataset_cfg": {"max_turns": "lots"}})
    sched.data_source = Source([bad])
    with pytest.raises(ValueError, match="max_turns"):
        run(sched.execute_rollout(1))
    assert len(seen) == 1


def test_interleave_is_round_robin():
    assert interleave([["a1", "a2", "a3"], ["b1"], ["c1", "c2"]]) == ["a1", "b1", "c1", "a2", "c2", "a3"]
    assert interleave([]) == []


def test_eval_interleaves_datasets_and_reports_accuracy_and_pass_at_k(make_pool):
    order = []

    def run_fn(sample, ctx):
        order.append(sample.metadata["_eval_dataset_name"])
        # right only on copy 0 for dataset "a"; always right for "b"; never for "c"
        name = sample.metadata["_eval_dataset_name"]
        good = name == "b" or (name == "a" and sample.index == 0)
        return AgentResult(tokens=[1, 2], response_length=1, response=str(sample.label) if good else "x")

    spec = EvaluatorSpec("arithmetic", FunctionAgent(run_fn, verify), resource=Resource(concurrency=1, cpu=1),
                         run_resource=Resource(cpu=1))
    datasets = {"a": ArithmeticSource(1).take(2), "b": ArithmeticSource(2).take(2),
                "c": ArithmeticSource(3).take(1)}
    sched = TaskScheduler([spec], None, make_pool(ONE_NODE),
                          SchedulerConfig(n_samples_per_eval_prompt=2, progress=False), eval_datasets=datasets)
    result = run(sched.execute_eval(5))
    assert order == ["a", "b", "c", "a", "b", "c", "a", "b", "a", "b"]  # ABCABC..., not AABBCC
    assert {k: len(v) for k, v in result.samples.items()} == {"a": 4, "b": 4, "c": 2}
    assert sorted((s.task_id, s.index) for s in result.samples["a"]) == sorted(
        (t.task_id, c) for t in datasets["a"] for c in range(2))
    m = result.metrics
    assert m["eval/a/accuracy"] == 0.5 and m["eval/a/pass@1"] == 0.5 and m["eval/a/pass@2"] == 1.0
    assert m["eval/b/accuracy"] == m["eval/b/pass@2"] == 1.0
    assert m["eval/c/accuracy"] == m["eval/c/pass@2"] == 0.0


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        TaskScheduler([])
    with pytest.raises(ValueError, match="share evaluator_id"):
        TaskScheduler([arithmetic_spec("x"), arithmetic_spec("x")])
    with pytest.raises(ValueError, match="needs a data_source"):
        run(TaskScheduler([arithmetic_spec()]).execute_rollout(0))
    with pytest.raises(ValueError, match="needs eval_datasets"):
        run(TaskScheduler([arithmetic_spec()]).execute_eval(0))


# ---- the step status records how the step ended ---------------------------------------------------

def _hours_spec(hours):
    """Episodes that sleep ``hours[task_id]`` hours (run in virtual time: ``core.clock``)."""

    async def run_fn(sample, ctx):
        await asyncio.sleep(hours[sample.task_id] * 3600)
        return AgentResult(tokens=[1, 2], response_length=1, response="x")

    return EvaluatorSpec("arithmetic", FunctionAgent(run_fn, lambda s, r: {"score": 1.0}), batch_size=1,
                         resource=Resource(concurrency=1, cpu=1), run_resource=Resource(cpu=1))


def test_a_step_whose_callback_raised_is_failed_every_time_whatever_finished_last(make_pool):
    tasks = [Task(f"t{i}", "p", TaskConfig("arithmetic")) for i in range(6)]
    spec = _hours_spec({t.task_id: i + 1 for i, t in enumerate(tasks)})  # t5 finishes last
    sched = TaskScheduler([spec], Source(tasks), make_pool(TWO_NODES),
                          SchedulerConfig(rollout_batch_size=6, progress=False))

    async def steps():
        phases = []
        for step in range(300):
            async def on_done(task, samples, bad=tasks[step % 6].task_id):
                if task.task_id == bad:  # every sixth step, the last task to finish
                    raise RuntimeError("collector broke")

            with pytest.raises(ExceptionGroup):
                await sched.execute_rollout(step, on_task_done=on_done)
            phases.append(sched.status().phase)
        return phases

    assert run_virtual(steps()) == ["rollout failed"] * 300


def test_a_cancelled_step_says_so(make_pool):
    sched = TaskScheduler([_hours_spec({"t0": 5})], Source([Task("t0", "p", TaskConfig("arithmetic"))]),
                          make_pool(ONE_NODE), SchedulerConfig(rollout_batch_size=1, progress=False))

    async def main():
        step = asyncio.ensure_future(sched.execute_rollout(0))
        await asyncio.sleep(3600)
        running = sched.status()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        return running, sched.status()

    running, ended = run_virtual(main())
    assert running.state is StepState.RUNNING and running.phase == "rollout" and running.batches_running == 1
    assert ended.state is StepState.CANCELLED and ended.phase == "rollout cancelled"
    assert ended.as_dict()["phase"] == "rollout cancelled" and ended.as_dict()["batches_running"] == 0
    assert TaskScheduler([_hours_spec({})]).status().as_dict()["phase"] == "idle"


# ---- groups by fetch index ------------------------------------------------------------------------

def test_groups_come_back_by_fetch_index_whatever_order_the_strategy_batches_in():
    a, b = (Task(t, "p", TaskConfig("arithmetic", n_samples=n)) for t, n in (("a", 1), ("b", 2)))
    streamed = []

    async def stream(task, samples):
        streamed.append((task.task_id, len(samples)))

    def reversed_batches(tasks, specs):  # a plugin strategy: one batch per task, last first
        return [Batch("arithmetic", [t]) for t in reversed(tasks)]

    sched = TaskScheduler([arithmetic_spec(error_rate=0)], Source([a, b, a, a]), None,
                          SchedulerConfig(rollout_batch_size=4, progress=False), batching_strategy=reversed_batches)
    result = run(sched.execute_rollout(0, on_task_done=stream))
    assert [(g[0].task_id, len(g)) for g in result.groups] == [("a", 1), ("b", 2), ("a", 1), ("a", 1)]
    assert len({id(g[0]) for g in result.groups}) == 4 and sorted(streamed) == [("a", 1)] * 3 + [("b", 2)]


@pytest.mark.parametrize(("strategy", "message"), [
    (lambda tasks, specs: [Batch("arithmetic", tasks[:1])], "2 of its tasks are in no batch"),
    (lambda tasks, specs: [Batch("arithmetic", tasks + tasks[:1])], "batch 0 holds a task that is not in its input"),
    (lambda tasks, specs: [Batch("arithmetic", [Task("x", "p", TaskConfig("arithmetic"))])], "not in its input"),
])
def test_a_strategy_whose_batches_do_not_partition_its_input_is_refused_before_anything_runs(strategy, message):
    calls = []
    spec = EvaluatorSpec("arithmetic", FunctionAgent(lambda s, c: calls.append(s), lambda s, r: {"score": 0.0}))
    sched = TaskScheduler([spec], ArithmeticSource(), None, SchedulerConfig(rollout_batch_size=3, progress=False),
                          batching_strategy=strategy)
    with pytest.raises(ValueError, match=message):
        run(sched.execute_rollout(0))
    assert calls == []


def test_a_step_log_skips_finished_groups_returns_them_in_place_and_hears_of_each_new_one_first():
    tasks = [Task(f"t{i}", "p", TaskConfig("arithmetic")) for i in range(3)]
    done_before = [Sample("t1", 0, "p", status=Status.COMPLETED, tokens=[7])]
    events, ran = [], []

    class Log:
        async def finished(self, fetched):
            assert [t.task_id for t in fetched] == [t.task_id for t in tasks]  # each with its group's id
            assert [t.metadata["_group_id"] for t in fetched] == ["0/0", "0/1", "0/2"]
            return {1: done_before}

        async def group_done(self, index, samples):
            events.append(("log", index, samples[0].task_id))

    async def on_done(task, samples):
        events.append(("callback", task.task_id))

    def run_fn(sample, ctx):
        ran.append(sample.task_id)
        return AgentResult(tokens=[1, 2], response_length=1)

    spec = EvaluatorSpec("arithmetic", FunctionAgent(run_fn, lambda s, r: {"score": 0.0}))
    sched = TaskScheduler([spec], Source(tasks), None, SchedulerConfig(rollout_batch_size=3, progress=False))
    result = run(sched.execute_rollout(0, on_task_done=on_done, step_log=Log()))
    assert sorted(ran) == ["t0", "t2"] and result.groups[1] is done_before
    assert [g[0].task_id for g in result.groups] == ["t0", "t1", "t2"]
    for i in (0, 2):
        assert events.index(("log", i, f"t{i}")) + 1 == events.index(("callback", f"t{i}"))
    assert sched.status().tasks == sched.status().tasks_done == 2

    class Beyond(Log):
        async def finished(self, fetched):
            return {3: done_before}

    with pytest.raises(ValueError, match=r"finished groups \[3\] beyond the 3 fetched"):
        run(sched.execute_rollout(1, step_log=Beyond()))


@pytest.mark.parametrize(("strategy", "message"), [
    (lambda ts, specs: [Batch("a", list(ts))], r"batch 0 mixes evaluators \['a', 'b'\]"),
    (lambda ts, specs: [*[Batch(t.config.task_type, [t]) for t in ts], Batch("a", [])], r"batch 2 is empty"),
])
def test_a_strategy_batch_that_is_empty_or_mixes_evaluators_is_refused_before_anything_runs(strategy, message):
    ran = []

    def agent(sample, ctx):
        ran.append(sample.task_id)
        return AgentResult(tokens=[1, 2], response_length=1)

    tasks = [Task("ta", "p", TaskConfig("a")), Task("tb", "p", TaskConfig("b"))]

    class Fixed:
        async def get_tasks(self, n):
            return tasks

    specs = [EvaluatorSpec(e, FunctionAgent(agent, verify)) for e in "ab"]
    sched = TaskScheduler(specs, Fixed(), None, SchedulerConfig(rollout_batch_size=2, progress=False),
                          batching_strategy=strategy)
    with pytest.raises(ValueError, match="batching strategy .*" + message):
        run(sched.execute_rollout(0))
    assert ran == []


class PlainSource:
    def get_tasks(self, n):  # a plain def: the scheduler awaits it
        return []


class AsyncIteration:
    async def rollout_state(self, rollout_id):
        return {}

    def eval_state(self, rollout_id):
        return {}


class HalfPool:
    async def acquire_batch(self, request): ...

    def release_batch(self, tokens): ...

    async def max_tokens_for(self, per_sample): ...


def plain_callback(task, samples):
    return None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"data_source": PlainSource()}, r"^data_source PlainSource\.get_tasks: a plain function; it must be a coroutine "
                                     r"function: async def get_tasks\(self, n: int\) -> list\[Task\]$"),
    ({"data_source": object()}, r"^data_source object\.get_tasks: missing; it must be a coroutine function"),
    ({"on_task_done": plain_callback}, r"^on_task_done plain_callback: a plain function; it must be a coroutine "
                                       r"function: async \(task, samples\) -> None$"),
    ({"pool": HalfPool()},
     r"^pool HalfPool\.release_batch: a plain function; it must be a coroutine function"),
    ({"iteration": AsyncIteration()}, r"^iteration AsyncIteration\.rollout_state: not a plain function; it must be "
                                      r"def rollout_state\(self, rollout_id: int\) -> Iteration"),
])
def test_an_object_of_the_wrong_kind_is_one_error_at_construction_naming_object_method_and_protocol(kwargs, message):
    with pytest.raises(TypeError, match=message):
        TaskScheduler([arithmetic_spec()], **kwargs)


def test_an_on_task_done_of_the_wrong_kind_is_refused_before_the_step_fetches():
    fetched = []

    class Counting(Source):
        async def get_tasks(self, n):
            fetched.append(n)
            return await super().get_tasks(n)

    sched = TaskScheduler([arithmetic_spec()], Counting([Task("t", "p", TaskConfig("arithmetic"))]))
    with pytest.raises(TypeError, match=r"^execute_rollout's on_task_done plain_callback: a plain function"):
        run(sched.execute_rollout(0, plain_callback))
    assert fetched == []


def test_a_carried_tasks_samples_keep_their_group_index_and_resume_point():
    from rayapp.core.evaluator import TaskRun
    from rayapp.record import CarriedRun, ResumePoint
    from rayapp.types import Task, TaskConfig

    point = ResumePoint(1, [1, 2], 1, [1], [0.0])
    task = Task("t", "p", TaskConfig("x", n_samples=2), carried=CarriedRun([1, 3], [None, point]))
    samples = TaskRun.samples_of(4, task)
    assert [s.index for s in samples] == [1, 3] and [s.episode.start for s in samples] == [None, point]
    assert all(s.metadata == {"_rollout_id": 4} for s in samples)
    bad = Task("t", "p", TaskConfig("x", n_samples=3), carried=CarriedRun([1, 3]))
    with pytest.raises(ValueError, match=r"^task 't': its carried run names 2 samples and 2 resume points for "
                                         r"n_samples=3$"):
        TaskRun.samples_of(4, bad)

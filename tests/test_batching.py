import pytest
from conftest import run

from rayapp.core.agent import FunctionAgent
from rayapp.core.batching import budget_batching, fifo_batching, longest_first_batching
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.envs.arithmetic import verify
from rayapp.envs.plugin_import import PluginError, load_strategy
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Task, TaskConfig


def task(i, ttype="a", n=1, expected_len=None):
    return Task(f"{ttype}{i}", "p", TaskConfig(ttype, n_samples=n, expected_len=expected_len))


def spec(sid, batch_size=None, concurrency=8):
    """A budget of ``concurrency`` one-cpu samples."""
    return EvaluatorSpec(sid, handler=None, batch_size=batch_size,
                         resource=Resource(concurrency=concurrency, cpu=concurrency), run_resource=Resource(cpu=1))


def ids(batches):
    return [[t.task_id for t in b.tasks] for b in batches]


def test_fifo_groups_by_type_in_encounter_order_and_seals_at_batch_size():
    tasks = [task(0, "a"), task(0, "b"), task(1, "a"), task(2, "a"), task(1, "b"), task(0, "c")]
    batches = fifo_batching(tasks, {"a": spec("a", batch_size=2), "b": spec("b")})
    assert ids(batches) == [["a0", "a1"], ["b0", "b1"], ["a2"], ["c0"]]
    assert [b.task_type for b in batches] == ["a", "b", "a", "c"]


def test_fifo_without_a_spec_or_batch_size_makes_one_batch_per_type():
    tasks = [task(i, "x") for i in range(5)]
    assert ids(fifo_batching(tasks, {})) == [[f"x{i}" for i in range(5)]]
    assert fifo_batching([], {}) == []


def test_longest_first_puts_long_episodes_in_the_first_batches():
    lens = [1, 50, 3, None, 20, 7]
    tasks = [task(i, "a", expected_len=n) for i, n in enumerate(lens)]
    specs = {"a": spec("a", batch_size=2)}
    assert ids(fifo_batching(tasks, specs)) == [["a0", "a1"], ["a2", "a3"], ["a4", "a5"]]
    # what it changes: the 50- and 20-step episodes start together in the first wave
    assert ids(longest_first_batching(tasks, specs)) == [["a1", "a4"], ["a5", "a2"], ["a0", "a3"]]


def test_budget_batching_packs_each_batch_to_what_the_budget_admits_at_once():
    tasks = [task(i, "a", n=2) for i in range(5)]
    specs = {"a": spec("a", concurrency=5)}  # five 1-cpu tokens at once
    assert ids(fifo_batching(tasks, specs)) == [[f"a{i}" for i in range(5)]]  # one batch of 10 samples
    packed = budget_batching(tasks, specs)
    assert ids(packed) == [["a0", "a1"], ["a2", "a3"], ["a4"]]  # 4 + 4 + 2 samples, each <= 5
    assert all(b.n_samples <= 5 for b in packed)


def test_budget_batching_gives_an_oversized_group_its_own_batch_and_respects_batch_size():
    tasks = [task(0, "a", n=1), task(1, "a", n=9), task(2, "a", n=1), task(3, "a", n=1)]
    specs = {"a": spec("a", concurrency=4, batch_size=1)}
    assert ids(budget_batching(tasks, specs)) == [["a0"], ["a1"], ["a2"], ["a3"]]
    specs = {"a": spec("a", concurrency=4)}
    assert ids(budget_batching(tasks, specs)) == [["a0"], ["a1"], ["a2", "a3"]]


@pytest.mark.parametrize("strategy", [fifo_batching, longest_first_batching, budget_batching])
def test_every_strategy_keeps_each_task_once_and_one_type_per_batch(strategy):
    tasks = [task(i, t, n=1 + i % 3, expected_len=i % 4) for i in range(12) for t in "abc"]
    batches = strategy(tasks, {"a": spec("a", batch_size=3), "b": spec("b", concurrency=4)})
    flat = [t for b in batches for t in b.tasks]
    assert sorted(map(id, flat)) == sorted(map(id, tasks))
    assert all({t.config.task_type for t in b.tasks} == {b.task_type} for b in batches)


def test_load_strategy_by_short_name_or_import_path_like_every_plugin():
    assert load_strategy("fifo") is fifo_batching
    assert load_strategy("rayapp.core.batching.budget_batching") is budget_batching
    assert load_strategy("rayapp.core.batching:longest_first_batching") is longest_first_batching
    for bad, why in [
        ("nope", "batching strategy 'nope': not one of ['budget', 'fifo', 'longest_first'] nor an import path"),
        ("rayapp.core.batching:nope", "batching strategy 'rayapp.core.batching:nope': module 'rayapp.core.batching' "
                                      "has no attribute 'nope'"),
        ("no_such_module.fn", "batching strategy 'no_such_module.fn': no module named 'no_such_module' (is its "
                              "package on PYTHONPATH where the manager runs?)"),
        ("rayapp.core.batching:STRATEGIES", "batching strategy 'rayapp.core.batching:STRATEGIES': a dict is not "
                                            "callable; expected strategy(tasks: list[Task], specs: "
                                            "dict[str, EvaluatorSpec]) -> list[Batch]"),
        ("rayapp.core.clock:loop_time", "batching strategy 'rayapp.core.clock:loop_time': takes () -> 'float', "
                                        "expected strategy(tasks: list[Task], specs: dict[str, EvaluatorSpec]) "
                                        "-> list[Batch]"),
    ]:
        with pytest.raises(PluginError) as e:
            load_strategy(bad)
        assert str(e.value).startswith(why) and "\n" not in str(e.value), str(e.value)


def test_strategies_group_and_size_by_evaluator_id_not_task_type():
    # task_type "a" routed to evaluator "b" (and the other way round): each batch holds one evaluator's
    # tasks and is sealed at that evaluator's batch_size
    tasks = [Task(f"t{i}", "p", TaskConfig("a", evaluator_id="b" if i % 2 else "a")) for i in range(6)]
    specs = {"a": spec("a", batch_size=3), "b": spec("b", batch_size=2)}
    for strategy in (fifo_batching, budget_batching, longest_first_batching):
        batches = strategy(tasks, specs)
        assert all(len({t.evaluator_id for t in b.tasks}) == 1 for b in batches)
        assert sorted(len(b.tasks) for b in batches) == [1, 2, 3]
        assert {b.evaluator_id: len(b.tasks) for b in batches if len(b.tasks) > 1} == {"a": 3, "b": 2}


class Source:
    def __init__(self, tasks):
        self.tasks = tasks

    async def get_tasks(self, n):
        return list(self.tasks[:n])


def test_batching_and_spec_resolution_agree_on_evaluator_id():
    # one task_type, two evaluators: every sample runs under its own evaluator's handler, in batches its
    # own spec sizes; an unknown evaluator is batched by the fallback spec it runs under
    ran = []

    def handler(name):
        def agent(sample, ctx):
            ran.append((name, sample.task_id))
            return AgentResult(tokens=[1, 2], response_length=1)
        return FunctionAgent(agent, lambda s, r: {"score": 1.0})

    eids = ["A", "B", "A", "B", "B", "zzz"]
    tasks = [Task(f"t{i}-{e}", "p", TaskConfig("shared", evaluator_id=e)) for i, e in enumerate(eids)]
    seen_batches = []

    def strategy(ts, specs):
        batches = fifo_batching(ts, specs)
        seen_batches.extend([t.task_id for t in b.tasks] for b in batches)
        return batches

    specs = [EvaluatorSpec("A", handler("A"), batch_size=5), EvaluatorSpec("B", handler("B"), batch_size=2)]
    sched = TaskScheduler(specs, Source(tasks), None, SchedulerConfig(rollout_batch_size=6, progress=False),
                          batching_strategy=strategy)
    run(sched.execute_rollout(0))
    assert sorted(ran) == sorted((e if e != "zzz" else "A", t.task_id) for e, t in zip(eids, tasks, strict=True))
    assert seen_batches == [["t0-A", "t2-A"], ["t1-B", "t3-B"], ["t4-B"], ["t5-zzz"]]


@pytest.mark.parametrize(("strategy", "message"), [
    (lambda ts, specs: 1 / 0, r"failed: ZeroDivisionError"),
    (lambda ts, specs: [list(ts)], r"batch 0 is a list, not a Batch"),
])
def test_a_strategy_that_raises_or_returns_no_batches_is_one_error_naming_it(strategy, message):
    tasks = [Task("ta", "p", TaskConfig("a"))]
    specs = [EvaluatorSpec("a", FunctionAgent(lambda s, c: AgentResult(tokens=[1, 2], response_length=1), verify))]
    sched = TaskScheduler(specs, Source(tasks), None, SchedulerConfig(rollout_batch_size=1, progress=False),
                          batching_strategy=strategy)
    with pytest.raises(ValueError, match="batching strategy <function <lambda>.*" + message):
        run(sched.execute_rollout(0))

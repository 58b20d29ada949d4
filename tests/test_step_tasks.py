"""Tasks the trainer chooses (``StepRunner.rollout(rollout_id, tasks)``): the step runs exactly those as
its groups, in order, leaves the data source where it was, and stays idempotent: the same id with the
same tasks is served again (after a restart too), with other tasks refused before anything runs."""

import asyncio

import msgspec
import pytest
from conftest import run

from rayapp.core.agent import FunctionAgent
from rayapp.core.convert import InputError
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.envs.arithmetic import ArithmeticSource, arithmetic_spec
from rayapp.envs.datasets.files import FieldMap
from rayapp.envs.datasets.source import DatasetSpec, MultiDataSource
from rayapp.record import CarriedRun
from rayapp.steps.checkpoint import RolloutCheckpoint
from rayapp.steps.filters import RejectionFilter
from rayapp.steps.partial import PartialConfig
from rayapp.steps.reuse import ReusePolicy
from rayapp.steps.runner import StepRunner
from rayapp.trainers.step_tasks import step_tasks, tasks_digest, tasks_from_rows
from rayapp.types import AgentResult, Task, TaskConfig, TaskKey

ONE_NODE = '{"n0": {"gpus": [0], "cpu": 8, "memory_gb": 64}}'
GROUP = TaskKey.GROUP_ID.value


class Agent:
    """Logs every sample it runs; its response is how many ran before, so a re-run shows. A task
    labelled "mixed" scores its sample 0 as 1 and the others 0; any other label scores all 1.
    Samples of the tasks in ``hold`` wait for ``release``."""

    def __init__(self, hold=()):
        self.log, self.hold, self.release = [], set(hold), asyncio.Event()

    async def run(self, sample, ctx):
        self.log.append((ctx.rollout_id, sample.task_id, sample.index))
        if sample.task_id in self.hold:
            await self.release.wait()
        return AgentResult(tokens=[1, 2], response_length=1, response=str(len(self.log)), termination_reason="stop")

    def verify(self, sample, result):
        return {"score": float(sample.index == 0) if sample.label == "mixed" else 1.0}


def runner(make_pool, agent, **kw):
    spec = arithmetic_spec(batch_size=4)
    spec.handler = FunctionAgent(agent.run, agent.verify)
    source = MultiDataSource([DatasetSpec("a", ArithmeticSource(seed=1).take(40), n_samples_per_prompt=2)], seed=3)
    return StepRunner(TaskScheduler([spec], source, make_pool(ONE_NODE),
                                    SchedulerConfig(rollout_batch_size=4, progress=False)), **kw)


def mine(*labels, n=(1, 3, 2)):
    return [Task(f"mine-{i}", f"prompt {i}", TaskConfig("arithmetic", n_samples=n[i % len(n)]), label=label,
                 metadata={"row": i}) for i, label in enumerate(labels)]


def shape(result):
    return [[(s.task_id, s.index, s.label, s.metadata[GROUP], s.metadata["row"]) for s in g] for g in result.groups]


def responses(result):
    return [s.response for g in result.groups for s in g]


def test_the_step_runs_exactly_the_trainers_tasks_in_order_and_the_data_source_stays_where_it_was(make_pool):
    agent = Agent()
    steps = runner(make_pool, agent)
    source = steps.scheduler.data_source
    before = source.state_dict()
    result = run(steps.rollout(7, mine("x", "y", "z", "w")))
    assert shape(result) == [[("mine-0", 0, "x", "7/0", 0)],
                             [("mine-1", k, "y", "7/1", 1) for k in range(3)],
                             [("mine-2", k, "z", "7/2", 2) for k in range(2)],
                             [("mine-3", 0, "w", "7/3", 3)]]
    assert sorted((t, i) for _, t, i in agent.log) == sorted((s[0], s[1]) for g in shape(result) for s in g)
    assert source.state_dict() == before
    # the data source's next step fetches what it would have fetched without the trainer's step
    fetched = run(steps.rollout(8))
    alone = run(runner(make_pool, Agent()).rollout(8))
    assert [g[0].task_id for g in fetched.groups] == [g[0].task_id for g in alone.groups]


def test_dicts_go_through_the_door_and_a_bad_task_is_one_error_naming_its_index_and_field(make_pool):
    agent = Agent()
    steps = runner(make_pool, agent)
    as_dicts = [msgspec.to_builtins(t) for t in mine("x", "y")]
    assert shape(run(steps.rollout(0, as_dicts))) == shape(run(runner(make_pool, Agent()).rollout(0, mine("x", "y"))))
    ran = len(agent.log)
    bad = [
        ([as_dicts[0], {"task_id": "t", "prompt": "p"}], r"rollout 1: tasks\[1\]: \$\.config: missing required field"),
        ([{**as_dicts[0], "config": {"task_type": "arithmetic", "n_samples": 0}}],
         r"rollout 1: tasks\[0\]: \$\.config\.n_samples: expected int >= 1 and <= 1000000, got 0"),
        ([{**as_dicts[0], "label": object()}], r"rollout 1: tasks\[0\]: \$\.label: not plain data"),
        ([as_dicts[0], "What is 2+2?"], r"rollout 1: tasks\[1\]: \$: expected a Task or a dict of its fields, got str"),
        ([msgspec.structs.replace(mine("x")[0], carried=CarriedRun([0]))], r"tasks\[0\]: \$\.carried: set by partial"),
        ([{**as_dicts[0], "metadata": {GROUP: "x"}}], r"tasks\[0\]: \$\.metadata\._group_id: the step names"),
    ]
    for tasks, message in bad:
        with pytest.raises(InputError, match=message):
            run(steps.rollout(1, tasks))
    with pytest.raises(ValueError, match="rollout 1: tasks is empty"):
        run(steps.rollout(1, []))
    with pytest.raises(TypeError, match="rollout 1: tasks must be a list"):
        run(steps.rollout(1, "What is 2+2?"))
    with pytest.raises(ValueError, match="rollout_id must be an int"):
        run(steps.rollout(-1, mine("x")))
    assert len(agent.log) == ran and not steps.busy
    assert run(steps.rollout(1)).groups  # the id is free: nothing was kept of the refused requests


def test_the_same_id_with_the_same_tasks_is_served_and_with_other_tasks_refused(make_pool):
    agent = Agent()
    steps = runner(make_pool, agent)
    first = run(steps.rollout(3, mine("x", "y")))
    ran = len(agent.log)
    again = [dict(reversed(msgspec.to_builtins(t).items())) for t in mine("x", "y")]  # as dicts, keys reordered
    assert run(steps.rollout(3, again)) is first and len(agent.log) == ran
    for other, message in ((mine("x", "z"), "trainer-chosen tasks"), (None, "the data source's tasks")):
        with pytest.raises(ValueError, match=r"rollout 3 ran with trainer-chosen tasks \(digest [0-9a-f]{12}\), and is "
                                             rf"now asked for with {message}"):
            run(steps.rollout(3, other))
    run(steps.rollout(4))
    with pytest.raises(ValueError, match=r"rollout 4 ran with the data source's tasks, and is now asked for with "
                                         r"trainer-chosen"):
        run(steps.rollout(4, mine("x")))
    assert len(agent.log) == ran + 8


def test_a_step_in_flight_with_other_tasks_refuses_the_request_and_serves_the_same(make_pool):
    async def scenario():
        agent = Agent(hold={"mine-0"})
        steps = runner(make_pool, agent)
        first = asyncio.create_task(steps.rollout(2, mine("x")))
        while not agent.log:
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match=r"rollout 2 is running with trainer-chosen tasks"):
            await steps.rollout(2, mine("y"))
        same = asyncio.create_task(steps.rollout(2, mine("x")))
        agent.release.set()
        assert await first is await same and len(agent.log) == 1

    run(scenario())


def test_after_a_restart_the_same_tasks_are_served_from_the_checkpoint_folder_and_others_refused(make_pool, tmp_path):
    agent = Agent()
    first = run(runner(make_pool, agent, checkpoint=RolloutCheckpoint(tmp_path)).rollout(0, mine("x", "y")))
    ran = len(agent.log)
    restarted = runner(make_pool, agent, checkpoint=RolloutCheckpoint(tmp_path))  # a new process, same folder
    assert shape(run(restarted.rollout(0, mine("x", "y")))) == shape(first)
    assert responses(run(restarted.rollout(0, mine("x", "y")))) == responses(first) and len(agent.log) == ran
    for other in (mine("y", "x"), None):
        fresh = runner(make_pool, agent, checkpoint=RolloutCheckpoint(tmp_path))
        with pytest.raises(ValueError, match="rollout 0 was saved with trainer-chosen tasks"):
            run(fresh.rollout(0, other))
    assert len(agent.log) == ran


def test_a_step_cut_short_resumes_only_with_the_same_tasks(make_pool, tmp_path):
    tasks = mine("a", "b", "c", "d", n=(1,))

    async def cut_short():
        agent = Agent(hold={"mine-3"})
        steps = runner(make_pool, agent, checkpoint=RolloutCheckpoint(tmp_path))
        step = asyncio.create_task(steps.rollout(5, tasks))
        while steps.scheduler.status().tasks_done < 3:
            await asyncio.sleep(0.01)
        step.cancel()  # what the checkpoint sees of a killed process: no FINISHED record
        with pytest.raises(asyncio.CancelledError):
            await step

    run(cut_short())
    agent = Agent()
    with pytest.raises(ValueError, match=r"rollout 5: its unfinished checkpoint .* began with trainer-chosen "
                                         r"tasks \(digest [0-9a-f]{12}\), and the step is now asked for with the data "
                                         r"source"):
        run(runner(make_pool, agent, checkpoint=RolloutCheckpoint(tmp_path)).rollout(5))
    with pytest.raises(ValueError, match=r"began with trainer-chosen tasks \(digest .*\), and the step is now asked "
                                         r"for with trainer-chosen tasks"):
        run(runner(make_pool, agent, checkpoint=RolloutCheckpoint(tmp_path)).rollout(5, mine("a", "b", "c", "e")))
    assert agent.log == []
    result = run(runner(make_pool, agent, checkpoint=RolloutCheckpoint(tmp_path)).rollout(5, tasks))
    assert agent.log == [(5, "mine-3", 0)]  # only the group cut short ran again
    assert [g[0].metadata[GROUP] for g in result.groups] == ["5/0", "5/1", "5/2", "5/3"]


def test_filters_apply_and_each_survivor_names_its_task_index(make_pool):
    steps = runner(make_pool, Agent(), filters=[RejectionFilter()])
    result = run(steps.rollout(0, mine("same", "mixed", "same", "mixed", n=(2,))))
    assert [g[0].metadata[GROUP] for g in result.groups] == ["0/1", "0/3"]
    assert result.metrics["filter/input_groups"] == 4.0 and result.metrics["filter/kept_groups"] == 2.0


def test_partial_rollouts_and_reused_trajectories_refuse_the_trainers_tasks_before_anything_runs(make_pool, tmp_path):
    agent = Agent()
    with pytest.raises(ValueError, match="rollout 0: partial rollouts choose a step's groups themselves"):
        run(runner(make_pool, agent, partial=PartialConfig()).rollout(0, mine("x")))
    steps = runner(make_pool, agent, trajectory_dir=tmp_path, reuse=ReusePolicy())
    run(steps.rollout(0, mine("x")))  # the first iteration runs fresh and saves its trajectories
    ran = len(agent.log)
    with pytest.raises(ValueError, match=r"rollout 1: the reuse policy would load .* \(auto-reuse\) instead of running "
                                         r"the trainer's tasks"):
        run(steps.rollout(1, mine("y")))
    assert len(agent.log) == ran
    fresh = runner(make_pool, agent, trajectory_dir=tmp_path, reuse=ReusePolicy(force_fresh=True))
    assert [g[0].label for g in run(fresh.rollout(1, mine("y"))).groups] == ["y"]


def test_the_digest_is_the_tasks_whatever_the_order_of_a_dicts_keys():
    tasks = step_tasks(0, mine("x", "y"))
    reordered = step_tasks(0, [dict(reversed(msgspec.to_builtins(t).items())) for t in mine("x", "y")])
    assert tasks_digest(tasks) == tasks_digest(reordered)
    assert tasks_digest(tasks) != tasks_digest(step_tasks(0, mine("x", "z")))
    assert tasks_digest(tasks) != tasks_digest(tasks[::-1])


def test_tasks_from_rows_maps_a_trainers_columns():
    rows = [{"question": "What is 2+2?", "answer": "4", "source": "gsm", "kind": "arithmetic", "image": object()},
            {"question": [{"role": "user", "content": "3*3?"}], "answer": 9, "source": "mine", "kind": "math"}]
    fields = FieldMap(prompt="question", label="answer", task_type="kind", metadata=["source"])
    tasks = tasks_from_rows(rows, task_type="unused", n_samples=4, fields=fields)
    assert tasks == [
        Task("trainer-0", "What is 2+2?", TaskConfig("arithmetic", n_samples=4), label="4", metadata={"source": "gsm"}),
        Task("trainer-1", [{"role": "user", "content": "3*3?"}], TaskConfig("math", n_samples=4), label=9,
             metadata={"source": "mine"})]
    with pytest.raises(InputError, match=r"^trainer rows\[1\]: \$\.question: missing required field$"):
        tasks_from_rows([rows[0], {"answer": "1", "kind": "math"}], task_type="arithmetic", fields=fields)
    plain = tasks_from_rows([{"prompt": "p", "label": 1, "extra": 2}], task_type="arithmetic")
    assert plain == [Task("trainer-0", "p", TaskConfig("arithmetic"), label=1)]
    with pytest.raises(ValueError, match="n_samples must be an int >= 1"):
        tasks_from_rows(rows, task_type="arithmetic", n_samples=0)

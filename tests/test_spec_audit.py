"""The spec audit's findings (issue 32, point 3): each one as a user would meet it."""

import msgspec
from conftest import run

from rayapp.core.agent import FunctionAgent
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.envs.arithmetic import ArithmeticSource, verify
from rayapp.types import AgentResult, EvaluatorSpec, Resource

ONE_NODE = '{"n0": {"gpus": [0], "cpu": 8, "memory_gb": 64}}'


def test_pass_at_k_keeps_two_prompts_that_share_a_task_id_apart(make_pool):
    def run_fn(sample, ctx):  # the first prompt always right, the second never
        good = sample.label == 1
        return AgentResult(tokens=[1, 2], response_length=1, response=str(sample.label) if good else "x")

    tasks = ArithmeticSource(1).take(2)
    tasks = [msgspec.structs.replace(t, task_id="same", label=1 if i == 0 else 2) for i, t in enumerate(tasks)]
    spec = EvaluatorSpec("arithmetic", FunctionAgent(run_fn, verify), resource=Resource(concurrency=1, cpu=1),
                         run_resource=Resource(cpu=1))
    sched = TaskScheduler([spec], None, make_pool(ONE_NODE),
                          SchedulerConfig(n_samples_per_eval_prompt=2, progress=False), eval_datasets={"a": tasks})
    m = run(sched.execute_eval(3)).metrics
    assert m["eval/a/accuracy"] == 0.5
    assert m["eval/a/pass@2"] == 0.5  # one prompt of two solved; pooled by task_id it read 0.83

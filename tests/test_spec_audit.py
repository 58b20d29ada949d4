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


def test_a_recipe_without_dagger_publishes_its_rollout_id(monkeypatch):
    import os

    import yaml

    from rayapp.cli import ROOT
    from rayapp.recipe import build_scheduler, parse_recipe

    for name in ("STACX_ROLLOUT_ID", "STACX_DAGGER_BETA", "STACX_DAGGER_T_MAX"):
        monkeypatch.delenv(name, raising=False)

    async def not_called(*a, **kw):
        raise AssertionError("the wiring must not run or open anything")

    args = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())["applications"][0]["args"]
    cfg = parse_recipe(args)
    assert cfg.dagger is None
    sched = build_scheduler(cfg, {"student": object()}, None, executor=not_called, open_sandbox=not_called)
    assert sched.iteration.rollout_state(7).rollout_id == 7
    assert os.environ["STACX_ROLLOUT_ID"] == "7"
    assert "STACX_DAGGER_BETA" not in os.environ and "STACX_DAGGER_T_MAX" not in os.environ
    sched.iteration.eval_state(7)  # an eval step without DAgger writes and removes nothing
    assert os.environ["STACX_ROLLOUT_ID"] == "7" and "STACX_DAGGER_BETA" not in os.environ

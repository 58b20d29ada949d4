"""A fault every sample meets says what it is (issue 32, point 11): the step logs its first abort's
error once, and the train and eval summaries hold it."""

import json
import logging

from conftest import run

from rayapp.core.agent import FunctionAgent
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.envs.arithmetic import ArithmeticSource, arithmetic_spec
from rayapp.steps.artifacts import EvalDetailsWriter
from rayapp.steps.runner import StepRunner
from rayapp.types import AgentResult

ONE_NODE = '{"n0": {"gpus": [0], "cpu": 8, "memory_gb": 64}}'


def _runner(make_pool, tmp_path):
    def run_fn(sample, ctx):
        return AgentResult(tokens=[1, 2], response_length=1, response="x")

    def float_verifier(sample, result):  # the mistake: a bare score, not {"score": ...}
        return 1.0

    spec = arithmetic_spec(batch_size=2)
    spec.handler = FunctionAgent(run_fn, float_verifier)
    sched = TaskScheduler([spec], ArithmeticSource(seed=3, n_samples=2), make_pool(ONE_NODE),
                          SchedulerConfig(rollout_batch_size=2, progress=False),
                          eval_datasets={"arith": ArithmeticSource(seed=9).take(2)})
    return StepRunner(sched, details=EvalDetailsWriter(tmp_path))


def test_every_sample_aborting_logs_the_first_error_once_per_step(make_pool, tmp_path, caplog):
    runner = _runner(make_pool, tmp_path)
    with caplog.at_level(logging.WARNING, logger="rayapp.steps.runner"):
        result = run(runner.rollout(0))
        run(runner.evaluate(0))
    assert sum(len(g) for g in result.groups) == 4
    lines = [r.getMessage() for r in caplog.records if r.name == "rayapp.steps.runner"]
    assert len(lines) == 2, lines  # once for the rollout step, once for the eval step
    assert lines[0].startswith("rollout 0: 4 of 4 samples aborted (infra_other 4); the first, task ")
    assert "in its verify phase: AgentOutputError: handler.evaluate returned 1.0, not a dict with a 'score'" in lines[0]
    assert lines[1].startswith("eval 0: 2 of 2 samples aborted")
    for name in ("train_0.summary.json", "0.summary.json"):
        aborts = json.loads((tmp_path / "eval_details" / name).read_text())["aborts"]
        assert aborts["by_reason"] == {"infra_other": aborts["n_aborted"]}
        assert "handler.evaluate returned 1.0" in aborts["first"]["error"]


def test_eval_details_carry_the_token_data_when_asked(make_pool, tmp_path):
    from rayapp.steps.artifacts import read_jsonl

    def run_fn(sample, ctx):
        return AgentResult(tokens=[5, 6, 7], response_length=2, response=str(sample.label),
                           loss_mask=[1, 1], rollout_log_probs=[-0.5, -0.25])

    spec = arithmetic_spec(batch_size=2)
    spec.handler = FunctionAgent(run_fn, spec.handler.verify_fn)
    sched = TaskScheduler([spec], None, make_pool(ONE_NODE), SchedulerConfig(progress=False),
                          eval_datasets={"arith": ArithmeticSource(seed=9).take(2)})
    run(StepRunner(sched, details=EvalDetailsWriter(tmp_path, tokens=True)).evaluate(1))
    rows = read_jsonl(tmp_path / "eval_details" / "1.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert (row["tokens"], row["loss_mask"], row["rollout_log_probs"]) == ([5, 6, 7], [1, 1], [-0.5, -0.25])
    plain = tmp_path / "plain"
    run(StepRunner(sched, details=EvalDetailsWriter(plain)).evaluate(1))
    assert not {"tokens", "loss_mask", "rollout_log_probs"} & set(read_jsonl(plain / "eval_details" / "1.jsonl")[0])

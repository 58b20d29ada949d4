"""The scheduler publishes each iteration's DAgger state before fetching: agents get it typed
(``ctx.iteration``), code reading STACX_* sees it in the environment (written by the one observer,
``StacxEnv``), results carry it back; eval runs at beta 0 unless
STACX_DAGGER_EVAL_BETA re-injects it."""

import os

import pytest
from conftest import run

from rayapp.core.agent import FunctionAgent
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.envs.arithmetic import ArithmeticSource, verify
from rayapp.recipe.environment import read_environment
from rayapp.record import Iteration
from rayapp.steps.dagger_schedule import DAggerIterations, DAggerSchedule
from rayapp.steps.stacx_env import StacxEnv
from rayapp.types import AgentResult, EvaluatorSpec


@pytest.fixture
def clean_env(monkeypatch):
    for name in ["STACX_DAGGER_BETA", "STACX_DAGGER_T_MAX", "STACX_DAGGER_EVAL_BETA", "STACX_ROLLOUT_ID"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def scheduler(seen, schedule):
    class Source(ArithmeticSource):
        async def get_tasks(self, n):  # the fetch sees what was published before it
            seen.append(("fetch", os.environ.get("STACX_DAGGER_BETA")))
            return await super().get_tasks(n)

    def run_fn(sample, ctx):
        seen.append(("agent", ctx.iteration.beta, ctx.iteration.t_max,
                     os.environ.get("STACX_DAGGER_BETA"), os.environ.get("STACX_DAGGER_T_MAX")))
        return AgentResult(tokens=[1, 2], response_length=1, response=str(sample.label))

    spec = EvaluatorSpec("arithmetic", FunctionAgent(run_fn, verify))
    env = read_environment(os.environ)  # the user-set variables, read as the recipe's build reads them
    return TaskScheduler([spec], Source(), None, SchedulerConfig(rollout_batch_size=2, progress=False),
                         eval_datasets={"a": ArithmeticSource(9).take(1)},
                         iteration=DAggerIterations(schedule, env.eval_beta, env.static_t_max,
                                                   observers=[StacxEnv()]))


def test_rollout_publishes_state_before_the_fetch_and_returns_it(clean_env):
    seen: list = []
    schedule = DAggerSchedule(beta_schedule="linear", beta_start=1.0, beta_end=0.0, decay_iters=4,
                              t_max_start=2, t_max_end=8, t_max_step=2)
    result = run(scheduler(seen, schedule).execute_rollout(2))
    assert seen[0] == ("fetch", "0.5")
    assert seen[1:] == [("agent", 0.5, 6, "0.5", "6")] * 2
    assert result.iteration == Iteration(rollout_id=2, beta=0.5, t_max=6, t_max_step=2)


def test_a_static_tail_length_is_not_clobbered_when_the_ramp_is_off(clean_env):
    clean_env.setenv("STACX_DAGGER_T_MAX", "17")
    seen: list = []
    run(scheduler(seen, DAggerSchedule(decay_iters=2)).execute_rollout(1))
    assert seen[1][4] == "17" and seen[1][1] == 0.5 and seen[1][2] == 17  # agents get it typed too


@pytest.mark.parametrize(("eval_beta", "expected"), [(None, 0.0), ("0.3", 0.3)])
def test_eval_runs_student_only_unless_re_injected(clean_env, eval_beta, expected):
    if eval_beta is not None:
        clean_env.setenv("STACX_DAGGER_EVAL_BETA", eval_beta)
    seen: list = []
    sched = scheduler(seen, DAggerSchedule(decay_iters=10))
    run(sched.execute_rollout(0))  # publishes beta 1.0
    result = run(sched.execute_eval(0))
    assert seen[-1][1] == expected and result.iteration.beta == expected
    assert os.environ.get("STACX_DAGGER_BETA") == (None if eval_beta is None else eval_beta)


def test_without_the_observer_nothing_is_written_to_the_environment(clean_env):
    seen: list = []
    sched = scheduler(seen, DAggerSchedule(decay_iters=4))
    sched.iteration.observers.clear()
    result = run(sched.execute_rollout(1))
    assert seen[1][:4] == ("agent", 0.75, 0, None) and result.iteration.beta == 0.75
    assert not {k for k in os.environ if k.startswith("STACX_")}

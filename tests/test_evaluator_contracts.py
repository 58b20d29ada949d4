"""The agent's side of the evaluator's contract: whatever an agent raises or returns aborts only its
sample, classified; plain-function agents run off the loop so their time limit holds."""
import asyncio
import threading

import pytest
from conftest import run
from test_evaluator import make_groups, ok_result, spec, tokens

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import run_virtual
from rayapp.core.contracts import StepContext
from rayapp.core.evaluator import Evaluator
from rayapp.trainers.converters import trainer_metadata
from rayapp.types import AgentResult, Status, StoppingCriteria

# ---- an agent's own BaseExceptions, blocking agents ----------------------------------------------

@pytest.mark.parametrize("exc", [asyncio.CancelledError("mine"), SystemExit(3), KeyboardInterrupt(), GeneratorExit()])
@pytest.mark.parametrize("phase", ["run", "verify"])
def test_an_agent_raising_a_base_exception_aborts_only_its_sample(exc, phase):
    running, peak = [0], [0]

    async def run_fn(sample, ctx):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(1 + sample.index)
        running[0] -= 1
        if phase == "run" and sample.task_id == "t0" and sample.index == 0:
            raise exc
        return ok_result()

    async def verify(sample, result):
        if phase == "verify" and sample.task_id == "t0" and sample.index == 0:
            raise exc
        return {"score": 1.0}

    groups = make_groups(2, 2)
    ev = Evaluator(spec(FunctionAgent(run_fn, verify), concurrency=2), StepContext(0), tokens=tokens(2))
    run_virtual(ev.run(groups))
    bad = groups[0].samples[0]
    assert bad.status is Status.ABORTED and bad.remove_sample
    assert trainer_metadata(bad)["_termination_reason"] == "infra_other"
    assert trainer_metadata(bad)["_abort"]["error"].startswith(type(exc).__name__)
    assert all(s.status is Status.COMPLETED for g in groups for s in g.samples if s is not bad)
    assert peak[0] <= 2 and len(ev._local) == 2


def test_a_blocking_synchronous_agent_still_times_out():
    gate = threading.Event()

    class Blocking:
        def run(self, sample, ctx):  # plain def that blocks its thread
            gate.wait(30)
            return ok_result()

        def evaluate(self, sample, result, ctx):
            return {"score": 1.0}

    groups = make_groups(1, 1, StoppingCriteria(timeout_s=0.05))

    async def main():
        try:
            await Evaluator(spec(Blocking()), StepContext(0), tokens=tokens(1)).run(groups)
        finally:
            gate.set()

    run(main())
    [s] = groups[0].samples
    assert s.status is Status.ABORTED and trainer_metadata(s)["_termination_reason"] == "agent_timeout"


def test_a_plain_function_agent_runs_off_the_loop():
    loop_thread = threading.get_ident()
    seen = []

    def run_fn(sample, ctx):
        seen.append(threading.get_ident())
        return ok_result()

    def verify(sample, result):
        seen.append(threading.get_ident())
        return {"score": 1.0}

    groups = make_groups(1, 2)
    run(Evaluator(spec(FunctionAgent(run_fn, verify)), StepContext(0), tokens=tokens(2)).run(groups))
    assert len(seen) == 4 and loop_thread not in seen
    assert all(s.status is Status.COMPLETED for s in groups[0].samples)


# ---- agent output validated before it reaches a sample --------------------------------------------

@pytest.mark.parametrize("field, result", [
    ("tokens", AgentResult(tokens=[1, -2, 5], response_length=1, rollout_log_probs=[-0.1], loss_mask=[1])),
    ("tokens", AgentResult(tokens=[1, 2.5, 5], response_length=1)),
    ("tokens", AgentResult(tokens=[1, True, 5], response_length=1)),
    ("rollout_log_probs", AgentResult(tokens=[1, 5], response_length=1, rollout_log_probs=[float("nan")])),
    ("rollout_log_probs", AgentResult(tokens=[1, 5], response_length=1, rollout_log_probs=[0.5])),
    ("rollout_log_probs", AgentResult(tokens=[1, 5], response_length=1, rollout_log_probs=[float("-inf")])),
    ("loss_mask", AgentResult(tokens=[1, 5], response_length=1, loss_mask=[2])),
    ("loss_mask", AgentResult(tokens=[1, 5], response_length=1, loss_mask=[-1])),
])
def test_garbage_token_data_aborts_the_sample_naming_the_field(field, result):
    groups = make_groups(1, 1)
    agent = FunctionAgent(lambda s, c: result, lambda s, r: {"score": 1.0})
    run_virtual(Evaluator(spec(agent), StepContext(0), tokens=tokens(1)).run(groups))
    [s] = groups[0].samples
    assert s.status is Status.ABORTED and trainer_metadata(s)["_termination_reason"] == "infra_other"
    assert field in trainer_metadata(s)["_abort"]["error"]
    assert s.tokens == [0, 0] and s.reward == {"score": 0.0}


@pytest.mark.parametrize("reward", [{"score": float("nan")}, {"score": True}, {"score": "1"},
                                    {"score": 1.0, "bonus": float("inf")}, {"score": 10**400}])
def test_a_reward_that_is_not_a_finite_number_aborts_the_sample_naming_the_entry(reward):
    groups = make_groups(1, 1)
    agent = FunctionAgent(lambda s, c: ok_result(), lambda s, r: reward)
    run_virtual(Evaluator(spec(agent), StepContext(0), tokens=tokens(1)).run(groups))
    [s] = groups[0].samples
    assert s.status is Status.ABORTED and trainer_metadata(s)["_termination_reason"] == "infra_other"
    assert "reward[" in trainer_metadata(s)["_abort"]["error"] and s.reward == {"score": 0.0}

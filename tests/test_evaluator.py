import asyncio

import pytest
from conftest import run

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import run_virtual
from rayapp.core.contracts import StepContext
from rayapp.core.evaluator import Evaluator, TaskRun
from rayapp.record import TerminationReason
from rayapp.trainers.converters import trainer_metadata
from rayapp.types import (
    AgentResult,
    EvaluatorSpec,
    Resource,
    Sample,
    SamplingParams,
    Status,
    StoppingCriteria,
    Task,
    TaskConfig,
    Token,
)


def make_groups(n_tasks, n_samples, stopping=StoppingCriteria()):
    groups = []
    for i in range(n_tasks):
        task = Task(f"t{i}", "p", TaskConfig("x", n_samples=n_samples), label="1")
        samples = [Sample(task.task_id, j, "p", "1") for j in range(n_samples)]
        groups.append(TaskRun(task, samples, stopping, SamplingParams()))
    return groups


def tokens(n):
    return [Token(i, f"node{i % 2}", (i,), 0.5, 1.0, 2.0) for i in range(n)]


def ok_result(n_resp=3):
    return AgentResult(tokens=[1, 2] + [5] * n_resp, response_length=n_resp, response="1",
                       rollout_log_probs=[-0.1] * n_resp, loss_mask=[1] * n_resp, termination_reason="stop")


class Recorder:
    """An agent that checks the one-token-per-running-sample rule while it runs."""

    def __init__(self, delay=0.01):
        self.delay, self.running, self.peak, self.in_use, self.seen = delay, 0, 0, set(), {}

    async def run(self, sample, ctx):
        key = (sample.task_id, sample.index)
        tid = ctx.token.token_id if ctx.token else None
        assert tid not in self.in_use, "two running samples share a token"
        self.in_use.add(tid)
        self.seen[key] = tid
        self.running += 1
        self.peak = max(self.peak, self.running)
        await asyncio.sleep(self.delay)
        self.running -= 1
        return ok_result()

    async def evaluate(self, sample, result, ctx):
        # the same token is still held in the eval phase
        assert (ctx.token.token_id if ctx.token else None) == self.seen[(sample.task_id, sample.index)]
        await asyncio.sleep(self.delay)
        self.in_use.discard(ctx.token.token_id if ctx.token else None)
        return {"score": 1.0}


def spec(handler, concurrency=2, eval_timeout_s=5.0):
    return EvaluatorSpec("x", handler=handler, resource=Resource(concurrency=concurrency),
                         eval_timeout_s=eval_timeout_s)


def test_concurrency_ceiling_and_one_token_held_across_run_and_eval():
    agent = Recorder()
    ev = Evaluator(spec(agent, concurrency=3), StepContext(0), tokens=tokens(3))
    groups = make_groups(4, 3)
    run(ev.run(groups))
    assert agent.peak == 3
    assert len(ev._local) == 3  # every token back in the local pool
    for g in groups:
        for s in g.samples:
            assert s.status is Status.COMPLETED and s.reward == {"score": 1.0}
            assert s.tokens == [1, 2, 5, 5, 5] and s.response_length == 3
            assert s.loss_mask == [1, 1, 1] and s.rollout_log_probs == [-0.1] * 3
            assert trainer_metadata(s)["_placement"]["node"] in {"node0", "node1"}
            assert not s.remove_sample


def test_fewer_tokens_than_concurrency_limits_running_samples_to_the_tokens():
    agent = Recorder()
    run(Evaluator(spec(agent, concurrency=4), StepContext(0), tokens=tokens(2)).run(make_groups(3, 2)))
    assert agent.peak == 2


def test_on_task_done_fires_per_task_as_it_finishes_not_at_the_end():
    async def scenario():
        gate = asyncio.Event()
        done = []

        async def run_fn(sample, ctx):
            if sample.task_id == "t1":  # the slow task only ends after t0 was reported
                await asyncio.wait_for(gate.wait(), 5)
            return ok_result()

        groups = make_groups(2, 2)

        async def on_done(k):
            done.append(groups[k].task.task_id)
            assert all(s.status is Status.COMPLETED for s in groups[k].samples)
            gate.set()

        agent = FunctionAgent(run_fn, lambda s, r: {"score": 1.0})
        await Evaluator(spec(agent, concurrency=4), StepContext(0), tokens=None).run(groups, on_done)
        return done

    assert run(scenario()) == ["t0", "t1"]


def failing_agent(exc, phase="run", reason_before=TerminationReason.STOP):
    async def run_fn(sample, ctx):
        ctx.record.termination_reason = reason_before  # the agent keeps its progress current
        ctx.record.turns = 4
        if phase == "run":
            raise exc
        return ok_result()

    def verify(sample, result):
        raise exc

    return FunctionAgent(run_fn, verify)


@pytest.mark.parametrize(("exc", "phase", "reason"), [
    (ConnectionRefusedError("engine down"), "run", "infra_conn"),
    (RuntimeError("sandbox crashed"), "eval", "infra_sandbox"),
    (KeyError("x"), "run", "infra_other"),
])
def test_a_failing_sample_becomes_a_classified_aborted_dummy(exc, phase, reason):
    groups = make_groups(1, 2)
    toks = tokens(2)
    ev = Evaluator(spec(failing_agent(exc, phase)), StepContext(7), tokens=toks)
    run(ev.run(groups))
    for s in groups[0].samples:
        assert s.status is Status.ABORTED
        assert s.reward == {"score": 0.0}
        assert s.tokens == [0, 0] and s.response_length == 1 and s.loss_mask == [0]
        assert s.remove_sample
        assert trainer_metadata(s)["_termination_reason"] == reason
        assert trainer_metadata(s)["_termination_reason_agent"] == "stop"
        diag = trainer_metadata(s)["_abort"]
        assert diag["phase"] == phase and diag["node"] in {"node0", "node1"}
        assert s.episode.abort.phase == {"run": "run", "eval": "verify"}[phase]  # the trainer's word for verify: eval
        assert diag["turns"] == (4 if phase == "run" else 1)  # the agent's progress, or its result's
        assert diag["window"][0] <= diag["window"][1]
    assert len(ev._local) == 2


def test_run_phase_timeout_from_stopping_criteria_is_an_agent_timeout():
    async def slow(sample, ctx):
        await asyncio.sleep(10)

    groups = make_groups(1, 1, StoppingCriteria(timeout_s=0.05))
    run(Evaluator(spec(FunctionAgent(slow, lambda s, r: {"score": 1.0})), StepContext(0), tokens=None).run(groups))
    s = groups[0].samples[0]
    assert s.status is Status.ABORTED and trainer_metadata(s)["_termination_reason"] == "agent_timeout"
    assert "_termination_reason_agent" not in trainer_metadata(s)
    assert "run phase ran past its 0.05s limit" in trainer_metadata(s)["_abort"]["error"]


def test_a_timeout_the_agent_raises_itself_is_not_blamed_on_the_phase_clock():
    async def inner_timeout(sample, ctx):
        raise TimeoutError("tool call timed out")

    groups = make_groups(1, 1, StoppingCriteria(timeout_s=30))
    run(Evaluator(spec(FunctionAgent(inner_timeout, lambda s, r: {"score": 1.0})), StepContext(0),
                  tokens=None).run(groups))
    diag = trainer_metadata(groups[0].samples[0])["_abort"]
    assert diag["error"] == "TimeoutError: tool call timed out"


@pytest.mark.parametrize(("result", "reward"), [
    (AgentResult(tokens=[1, 2], response_length=3), {"score": 1.0}),
    (AgentResult(tokens=[1, 2, 3], response_length=2, loss_mask=[1]), {"score": 1.0}),
    (AgentResult(tokens=[1, 2, 3], response_length=2, rollout_log_probs=[0.0]), {"score": 1.0}),
    ({"tokens": [1]}, {"score": 1.0}),
    (AgentResult(tokens=[1, 2, 3], response_length=2), {"reward": 1.0}),
])
def test_malformed_results_abort_as_infra_other(result, reward):
    groups = make_groups(1, 1)
    agent = FunctionAgent(lambda s, c: result, lambda s, r: reward)
    run(Evaluator(spec(agent), StepContext(0), tokens=None).run(groups))
    s = groups[0].samples[0]
    assert s.status is Status.ABORTED and trainer_metadata(s)["_termination_reason"] == "infra_other"


def test_truncated_episode_and_default_loss_mask():
    res = AgentResult(tokens=[1, 2, 3, 4], response_length=2, truncated=True, termination_reason="max_turns")
    groups = make_groups(1, 1)
    run(Evaluator(spec(FunctionAgent(lambda s, c: res, lambda s, r: {"score": 0})), StepContext(0),
                  tokens=None).run(groups))
    s = groups[0].samples[0]
    assert s.status is Status.TRUNCATED and s.loss_mask == [1, 1] and s.reward == {"score": 0.0}
    assert trainer_metadata(s)["_termination_reason"] == "max_turns"


def test_an_evaluator_runs_one_batch_once():
    ev = Evaluator(spec(Recorder()), StepContext(0), tokens=tokens(1))
    run(ev.run(make_groups(1, 1)))
    with pytest.raises(RuntimeError, match="run\\(\\) once per batch"):
        run(ev.run(make_groups(1, 1)))


@pytest.mark.parametrize("bad", [
    AgentResult(tokens=["a", "b"], response_length=1),  # token ids that are not ints
    AgentResult(tokens=[1, 2], response_length=1, turns="three"),  # turns that are not a count
])
def test_an_agent_result_that_breaks_its_type_aborts_the_sample(bad):
    groups = make_groups(1, 1)
    run(Evaluator(spec(FunctionAgent(lambda s, c: bad, lambda s, r: {"score": 1})), StepContext(0),
                  tokens=None).run(groups))
    s = groups[0].samples[0]
    assert s.status is Status.ABORTED and trainer_metadata(s)["_termination_reason"] == "infra_other"
    assert s.tokens == [0, 0] and s.remove_sample


def test_a_gated_batch_without_tokens_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        Evaluator(spec(Recorder()), StepContext(0), tokens=[])


def test_an_unknown_termination_reason_aborts_naming_it():
    res = AgentResult(tokens=[1, 2, 3], response_length=1, termination_reason="max_context")
    groups = make_groups(1, 1)
    run(Evaluator(spec(FunctionAgent(lambda s, c: res, lambda s, r: {"score": 1})), StepContext(0),
                  tokens=None).run(groups))
    s = groups[0].samples[0]
    assert s.status is Status.ABORTED and trainer_metadata(s)["_termination_reason"] == "infra_other"
    assert '$.termination_reason: expected "stop" or "max_turns" or "max_context_len" or "length", got ' \
           '"max_context"' in trainer_metadata(s)["_abort"]["error"]


def test_a_plain_string_reason_becomes_the_enum_and_the_metadata_holds_plain_values():
    res = AgentResult(tokens=[1, 2, 3], response_length=1, termination_reason="length", turns=2)
    groups = make_groups(1, 1)
    verified = []

    def verify(s, r):
        verified.append(r)
        return {"score": 0}

    run(Evaluator(spec(FunctionAgent(lambda s, c: res, verify)), StepContext(0), tokens=tokens(1)).run(groups))
    meta = trainer_metadata(groups[0].samples[0])
    assert verified[0].termination_reason is TerminationReason.LENGTH  # the verifier sees the checked result
    timing = meta.pop("_timing")
    assert meta == {"_placement": {"node": "node0", "gpu_ids": [0], "gpu": 0.5}, "_turns": 2,
                    "_termination_reason": "length"}
    assert type(meta["_termination_reason"]) is str
    assert set(timing) == {"started", "run_s", "verify_s", "ended"}  # ungated by a scheduler: no admission
    assert timing["started"] <= timing["started"] + timing["run_s"] + timing["verify_s"] <= timing["ended"]


class Kept:
    def __init__(self):
        self.closed = 0

    async def close(self):
        self.closed += 1


@pytest.mark.parametrize("outcome", ["verified", "run_fails", "verify_fails"])
def test_what_the_agent_keeps_in_the_context_is_closed_once_whatever_happens(outcome):
    kept = Kept()

    async def run_fn(sample, ctx):
        ctx.keep("thing", kept, kept.close)
        if outcome == "run_fails":
            raise RuntimeError("boom")
        return ok_result()

    async def verify(sample, result):
        assert kept.closed == 0  # still open for the verifier
        if outcome == "verify_fails":
            raise RuntimeError("boom")
        return {"score": 1.0}

    groups = make_groups(1, 1)
    run(Evaluator(spec(FunctionAgent(run_fn, verify)), StepContext(0), tokens=tokens(1)).run(groups))
    assert kept.closed == 1
    assert groups[0].samples[0].status is (Status.COMPLETED if outcome == "verified" else Status.ABORTED)


def test_a_failing_close_aborts_the_sample_and_the_token_comes_back():
    async def run_fn(sample, ctx):
        async def close():
            raise ConnectionError("sandbox gone")
        ctx.keep("thing", object(), close)
        return ok_result()

    groups = make_groups(1, 1)
    ev = Evaluator(spec(FunctionAgent(run_fn, lambda s, r: {"score": 1.0})), StepContext(0), tokens=tokens(1))
    run(ev.run(groups))
    s = groups[0].samples[0]
    assert s.status is Status.ABORTED and trainer_metadata(s)["_termination_reason"] == "infra_conn"
    assert len(ev._local) == 1


def test_a_verify_phase_past_its_limit_aborts_at_the_limit_and_others_are_untouched():
    async def verify(sample, result):
        await asyncio.sleep(100 if sample.index == 1 else 1)
        return {"score": 1.0}

    groups = make_groups(1, 3)
    ev = Evaluator(spec(FunctionAgent(lambda s, c: ok_result(), verify), concurrency=3, eval_timeout_s=30),
                   StepContext(0), tokens=tokens(3))
    run_virtual(ev.run(groups))
    s0, s1, s2 = groups[0].samples
    assert s0.status is s2.status is Status.COMPLETED
    assert s1.status is Status.ABORTED and trainer_metadata(s1)["_termination_reason"] == "agent_timeout"
    assert trainer_metadata(s1)["_abort"]["window"] == [0.0, 30.0]
    assert trainer_metadata(s1)["_abort"]["error"] == "AgentTimeout: verify phase ran past its 30s limit"
    assert len(ev._local) == 3 and ev._deadlines._timer is None  # nothing left armed


def test_a_callback_that_raises_cancels_the_batch_and_every_token_comes_back():
    started = []

    async def run_fn(sample, ctx):
        started.append(sample.task_id)
        await asyncio.sleep(0 if sample.task_id == "t0" else 3600)
        return ok_result()

    async def on_done(k):
        raise RuntimeError("collector broke")

    groups = make_groups(3, 2)
    ev = Evaluator(spec(FunctionAgent(run_fn, lambda s, r: {"score": 1.0}), concurrency=6), StepContext(0),
                   tokens=tokens(6))
    with pytest.raises(ExceptionGroup) as info:
        run_virtual(ev.run(groups, on_done))
    assert info.group_contains(RuntimeError, match="collector broke")
    assert sorted(started) == ["t0", "t0", "t1", "t1", "t2", "t2"]
    assert all(s.status is Status.PENDING for g in groups[1:] for s in g.samples)  # cancelled, not finished
    assert len(ev._local) == 6


def test_the_running_episode_is_named_for_the_work_it_starts_threads_included():
    from rayapp.episode import EPISODE

    seen = []

    async def run_fn(s, c):
        seen.append(("run", EPISODE.get()))
        return AgentResult(tokens=[1, 2], response_length=1)

    def verify(s, r):  # a plain function: it runs in a thread, which inherits the name
        seen.append(("verify", EPISODE.get()))
        return {"score": 1.0}

    groups = make_groups(1, 2)
    run(Evaluator(spec(FunctionAgent(run_fn, verify)), StepContext(3), tokens=tokens(2)).run(groups))
    names = {f"rollout3/{s.task_id}#{s.index}" for s in groups[0].samples}
    assert {n for _, n in seen} == names and len(seen) == 4
    assert EPISODE.get() is None  # nothing leaks out of the episode

"""Partial rollouts mid-turn, on the real hf engine: a turn cut short while the engine generates is
aborted there, the tokens it had made are kept (``ResumePoint.partial``), and the resumed episode
goes on from them. Under greedy decoding, any number of cuts at any moments gives exactly the
episode that was never cut: the same tokens, mask and (to float tolerance) log-probs."""

import asyncio

import msgspec
import pytest
from agent_helpers import sample
from conftest import run

from rayapp.envs.agents.chat import ChatAgent
from rayapp.envs.agents.multiturn import ToolAgent
from rayapp.envs.arithmetic import verify
from rayapp.episode import EpisodeContext
from rayapp.inference.client import FinishReason, GenerateRequest, GenerationCut, generate_abortable
from rayapp.trainers.converters import trainer_metadata
from rayapp.types import SamplingParams, StoppingCriteria


@pytest.fixture(scope="module")
def backend(model_dir):
    from rayapp.inference.hf import HFBackend

    b = HFBackend(str(model_dir), seed=0, steps_per_call=1)  # one token per step: cuts land mid-turn
    yield b
    b.shutdown()


class Local:
    """The engine client's shape, in process, over the real backend; it counts aborts."""

    def __init__(self, backend, version=0):
        self.backend, self.version, self.aborts = backend, version, 0

    async def info(self):
        return self.backend.info()

    async def generate(self, req, timeout_s=None):
        out = await self.backend.generate(req)
        return msgspec.structs.replace(out, weight_version=self.version)

    async def abort(self, request_id=None):
        self.aborts += 1
        return await self.backend.abort(request_id)


def context():
    return EpisodeContext(0, None, StoppingCriteria(max_turns=3, max_context_len=400),
                          SamplingParams(temperature=0, max_new_tokens=24))


def generated(backend):
    """Tokens the request in flight has generated so far (0 when none is)."""
    return max((len(r.output_ids) for r in list(backend._requests.values())), default=0)


def cut_after(agent, s, backend, tokens):
    """Run ``agent`` on ``s`` until its request in flight has made ``tokens`` tokens, then cancel
    it as a partial step does; the episode's context (with its resume point) comes back, or None
    when the episode ended before that."""
    c = context()

    async def go():
        task = asyncio.create_task(agent.run(s, c))
        while not task.done() and generated(backend) < tokens:
            await asyncio.sleep(0)
        if task.done():
            return None
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return c

    return run(asyncio.wait_for(go(), 120))


def resumed(point):
    s = sample()
    s.episode.start = point
    return s


@pytest.mark.parametrize("make", [lambda e: ChatAgent(e, verify), lambda e: ToolAgent(e, verify)],
                         ids=["chat", "tool"])
@pytest.mark.parametrize("cuts", [[1], [3], [2, 2], [1, 1, 1]])
def test_cut_turns_go_on_from_their_kept_tokens(backend, make, cuts):
    whole = run(asyncio.wait_for(make(Local(backend)).run(sample(), context()), 120))
    s, versions = sample(), []
    for n, tokens in enumerate(cuts):
        engine = Local(backend, version=n)
        c = cut_after(make(engine), s, backend, tokens)
        if c is None:
            break
        point = c.record.resume
        assert engine.aborts == 1  # aborted at the engine, not left to run
        assert point is not None and point.partial >= 1
        assert len(point.loss_mask) == len(point.rollout_log_probs) == len(point.tokens) - point.prompt_len
        assert point.tokens == whole.tokens[:len(point.tokens)]  # greedy: what it kept is the uncut episode's
        versions.append(n)
        s = resumed(point)
    assert versions, "no cut landed: the episode ended before its first cut"
    c = context()
    result = run(asyncio.wait_for(make(Local(backend, version=99)).run(s, c), 120))
    assert result.tokens == whole.tokens and result.loss_mask == whole.loss_mask
    assert result.response_length == whole.response_length and result.response == whole.response
    assert result.rollout_log_probs == pytest.approx(whole.rollout_log_probs, abs=1e-4)
    assert result.turns == whole.turns and result.termination_reason == whole.termination_reason
    # every weight that produced a token of the episode is named on a turn record (the staleness)
    assert {r.weight_version for r in c.record.turn_records} >= {*versions, 99}


def test_a_cut_without_an_engine_abort_keeps_nothing_and_the_turn_runs_again(backend):
    class NoAbort(Local):
        abort = None  # an engine client that cannot abort

    c = cut_after(ChatAgent(NoAbort(backend), verify), sample(), backend, 2)
    assert c is not None and c.record.resume is None


def test_generate_abortable_returns_what_the_engine_made_and_bounds_the_wait(backend):
    async def go():
        req = GenerateRequest([1, 5, 6, 7], SamplingParams(temperature=0, max_new_tokens=64), ignore_eos=True)
        task = asyncio.create_task(generate_abortable(Local(backend), req))
        while generated(backend) < 2:
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(GenerationCut) as cut:
            await task
        out = cut.value.output
        assert out.finish_reason is FinishReason.ABORT and 2 <= len(out.output_ids) < 64
        assert len(out.logprobs) == len(out.output_ids)
        assert not backend._requests  # nothing left running at the engine

        class Deaf(Local):  # the abort reaches no one: the request runs on
            async def abort(self, request_id=None):
                return 0

        slow = asyncio.create_task(generate_abortable(Deaf(backend), req, abort_timeout_s=0.01))
        while generated(backend) < 1:
            await asyncio.sleep(0)
        slow.cancel()
        with pytest.raises(GenerationCut) as cut:
            await slow
        assert cut.value.output is None
        for _ in range(100):  # the request was cancelled at the engine too
            if not backend._requests:
                break
            await asyncio.sleep(0.01)
        assert not backend._requests

    run(asyncio.wait_for(go(), 60))


def test_partial_steps_on_the_real_engine_return_what_an_uncut_run_would(backend, make_pool):
    # partial rollouts through the scheduler, evaluator and pool with the chat agent on the hf
    # engine: a step returns after one of four groups; the three cut short are aborted at the engine
    # mid-turn and go on in the next step from the tokens they kept. Greedy, every returned sample
    # is exactly the uncut episode of its prompt, and a resumed turn names both steps' weights.
    from rayapp.core.contracts import SchedulerConfig
    from rayapp.core.scheduler import TaskScheduler
    from rayapp.steps.partial import PartialConfig, PartialRollouts
    from rayapp.types import EvaluatorSpec, Resource, Task, TaskConfig

    class Prompts:
        def __init__(self):
            self.cursor = 0

        async def get_tasks(self, n):
            out = [Task(f"t{self.cursor + i}", f"What is {self.cursor + i} + 2?", TaskConfig("x", n_samples=1))
                   for i in range(n)]
            self.cursor += n
            return out

    agent = ChatAgent(Local(backend, version=None), verify)  # no version from the engine: the step's is stamped
    spec = EvaluatorSpec("x", agent, batch_size=1, resource=Resource(gpu=4, concurrency=4),
                         run_resource=Resource(gpu=1),
                         default_stopping=StoppingCriteria(max_turns=1, max_context_len=400),
                         default_sampling=SamplingParams(temperature=0, max_new_tokens=24))
    sched = TaskScheduler([spec], Prompts(), make_pool('{"n0": [0, 1, 2, 3]}'),
                          SchedulerConfig(rollout_batch_size=1, progress=False))
    partial = PartialRollouts.over(sched, PartialConfig(over_provision=4.0, policy="resume"))
    steps = [run(asyncio.wait_for(partial.execute_rollout(k), 120)) for k in range(4)]
    returned = [g[0] for r in steps for g in r.groups]
    assert len(returned) == 4 and len({s.task_id for s in returned}) == 4

    async def uncut(prompt):
        c = context()
        c.sampling = SamplingParams(temperature=0, max_new_tokens=24)
        return await ChatAgent(Local(backend), verify).run(sample_of(prompt), c)

    resumed = 0
    for s in returned:
        whole = run(asyncio.wait_for(uncut(s.prompt), 60))
        assert s.tokens == whole.tokens and s.loss_mask == whole.loss_mask and s.response == whole.response
        assert s.rollout_log_probs == pytest.approx(whole.rollout_log_probs, abs=1e-4)
        versions = [r["weight_version"] for r in trainer_metadata(s)["_turn_placement"]]
        if len(versions) > 1:
            resumed += 1
            assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert resumed > 0, "no returned sample had a turn cut short and resumed"


def sample_of(prompt):
    from rayapp.types import Sample

    return Sample("u", 0, prompt, "")

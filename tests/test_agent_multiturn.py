"""The multi-turn tool-calling agent: token-data invariants (property-tested against a scripted
engine that speaks through the real tiny tokenizer), stopping, malformed calls, and one episode on
the real hf engine."""

import asyncio

import pytest
from agent_helpers import CALL, InProcessEngine, ScriptedEngine, ctx, recording, sample
from conftest import run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rayapp.core.clock import run_virtual
from rayapp.envs.agents.chat import ChatAgent
from rayapp.envs.agents.multiturn import ToolAgent
from rayapp.envs.agents.tools import calculator, parse_tool_call
from rayapp.envs.arithmetic import verify
from rayapp.episode import EpisodeContext
from rayapp.inference.client import FinishReason, GenerateOutput
from rayapp.record import Iteration
from rayapp.trainers.converters import episode_metadata
from rayapp.types import AgentResult, SamplingParams, StoppingCriteria, Token

TURNS = st.sampled_from([CALL, "<tool_call>{not json</tool_call>", '<tool_call>{"name": "rm"}</tool_call>',
                         "The answer is 4.", "Let me think. " * 3])


def check_invariants(tok, result: AgentResult, engine: ScriptedEngine, limit):
    n = result.response_length
    assert len(result.loss_mask) == len(result.rollout_log_probs) == n <= len(result.tokens)
    response = result.tokens[-n:] if n else []
    model = [t for t, m in zip(response, result.loss_mask, strict=True) if m == 1]
    env_logprobs = [lp for lp, m in zip(result.rollout_log_probs, result.loss_mask, strict=True) if m == 0]
    assert all(lp == 0.0 for lp in env_logprobs)  # no environment token carries loss or a log-prob
    model_logprobs = [lp for lp, m in zip(result.rollout_log_probs, result.loss_mask, strict=True) if m == 1]
    assert model_logprobs == [lp for r in engine.logprobs for lp in r]  # the engine's own, unchanged
    # the model's tokens are exactly what the engine produced, turn after turn
    produced = [i for r in engine.outputs for i in r]
    assert model == produced
    for ids, text in zip(engine.outputs, engine.texts, strict=True):  # the text, up to a stop string
        assert tok.decode(ids, skip_special_tokens=True).startswith(text)
    for req in engine.sent:
        assert "</tool_call>" in req.sampling.stop  # every turn pauses at its tool call
    if limit is not None:
        prompt_len = len(result.tokens) - n
        # a prompt longer than the context gets no response at all; otherwise the context holds
        assert (n == 0 and result.termination_reason == "max_context_len") if prompt_len >= limit \
            else len(result.tokens) <= limit


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=st.lists(TURNS, min_size=1, max_size=6), max_turns=st.integers(1, 5),
       limit=st.one_of(st.none(), st.integers(60, 400)))
def test_token_data_invariants_hold_for_every_episode(tok, model_dir, script, max_turns, limit):
    engine = recording(ScriptedEngine(tok, model_dir, script))
    agent = ToolAgent(engine, verify, tools=["calculator"])
    s = sample()
    result = run(agent.run(s, ctx(max_turns, limit)))
    check_invariants(tok, result, engine, limit)
    assert result.turns == len(engine.outputs) <= max_turns
    assert result.termination_reason in {"stop", "max_turns", "max_context_len", "length"}
    assert result.truncated == (result.termination_reason != "stop")


def taking(engine, seconds):
    """``engine``, each call of which first takes the next of ``seconds`` on the loop's clock."""
    real, left = engine.generate, list(seconds)

    async def generate(req, timeout_s=None):
        await asyncio.sleep(left.pop(0))
        return await real(req, timeout_s)

    engine.generate = generate
    return engine


def test_a_tool_call_round_trip_and_the_final_answer(tok, model_dir):
    engine = recording(taking(ScriptedEngine(tok, model_dir, [CALL, "The answer is 4."]), [2.5, 0.75]))
    s = sample()
    token = Token(3, "node-a", (1,), 0.25, 1.0, 1.0)
    c = ctx(token=token)
    result = run_virtual(ToolAgent(engine, verify).run(s, c))  # virtual time: each turn's engine time is exact
    assert result.termination_reason == "stop" and not result.truncated and result.turns == 2
    assert verify(s, result) == {"score": 1.0}
    # the second request saw the tool's answer, as environment tokens
    second_prompt = tok.decode(engine.requests[1].input_ids)
    assert '"result": "4"' in second_prompt and "<|tool|>" in second_prompt
    assert [t.node for t in c.record.turn_records] == ["node-a", "node-a"]
    assert episode_metadata(c.record)["_turn_placement"] == [
        {"turn": i, "engine": "scripted", "node": "node-a", "gpu_ids": [1], "engine_s": t}
        for i, t in ((1, 2.5), (2, 0.75))]


def test_a_turn_ends_at_its_tool_call_so_nothing_after_it_is_trained_on(tok, model_dir):
    # the model would go on past its call, making up the tool's answer; the stop string ends the turn there
    made_up = '<|tool|>{"name": "calculator", "result": "5"}<|eos|><|assistant|>The answer is 5.'
    engine = recording(ScriptedEngine(tok, model_dir, [CALL + made_up, "The answer is 4."]))
    s = sample()
    result = run(ToolAgent(engine, verify).run(s, ctx(stop=["###"])))
    assert [r.sampling.stop for r in engine.requests] == [["###", "</tool_call>"]] * 2  # the user's first
    first = engine.outputs[0]
    assert tok.decode(first, skip_special_tokens=True) == CALL  # the turn ends with the call's closing tag
    response = result.tokens[-result.response_length:]
    trained = tok.decode([t for t, m in zip(response, result.loss_mask, strict=True) if m == 1],
                         skip_special_tokens=True)
    assert trained == CALL + "The answer is 4."
    assert "5" not in tok.decode(response, skip_special_tokens=True)
    assert result.termination_reason == "stop" and verify(s, result) == {"score": 1.0}


def test_a_malformed_call_is_an_observation_not_a_crash(tok, model_dir):
    engine = recording(ScriptedEngine(tok, model_dir, ["<tool_call>{oops</tool_call>", "The answer is 4."]))
    result = run(ToolAgent(engine, verify).run(sample(), ctx()))
    assert result.termination_reason == "stop"
    assert "malformed tool call" in tok.decode(engine.requests[1].input_ids)


def test_max_turns_and_max_context_len_stop_cleanly(tok, model_dir):
    engine = recording(ScriptedEngine(tok, model_dir, [CALL] * 5))
    result = run(ToolAgent(engine, verify).run(sample(), ctx(max_turns=2)))
    assert (result.termination_reason, result.turns, result.truncated) == ("max_turns", 2, True)
    engine = recording(ScriptedEngine(tok, model_dir, [CALL] * 5))
    result = run(ToolAgent(engine, verify).run(sample(), ctx(max_turns=10, max_context_len=160)))
    assert result.termination_reason == "max_context_len" and len(result.tokens) <= 160
    check_invariants(tok, result, engine, 160)


def test_tool_parsing_and_the_calculator():
    assert parse_tool_call("no call here").final
    assert parse_tool_call(CALL).call.arguments == {"expression": "2 + 2"}
    assert "malformed" in parse_tool_call("<tool_call>[1, 2]</tool_call>").error
    assert run(calculator({"expression": "(3 + 4) * 5 - 10 // 3"})) == "32"
    assert run(calculator({"expression": "__import__('os')"})).startswith("error")
    assert run(calculator({"expression": "1 / 0"})).startswith("error")
    with pytest.raises(ValueError, match="unknown tools"):
        ToolAgent(None, verify, tools=["teleport"])
    with pytest.raises(ValueError, match="need a sandbox_factory"):
        ToolAgent(None, verify, tools=["bash"])


def test_an_episode_on_the_real_hf_engine(tok, model_dir):
    from rayapp.inference.hf import HFBackend

    backend = HFBackend(str(model_dir), seed=0)

    def episode(c):
        engine = recording(InProcessEngine(backend))
        return engine, run(asyncio.wait_for(ToolAgent(engine, verify).run(sample(), c), 120))

    try:
        engine, result = episode(ctx(max_turns=3, max_context_len=300))
        check_invariants(tok, result, engine, 300)
        assert result.termination_reason in {"stop", "max_turns", "max_context_len", "length"}
        # the stop strings reach the real engine and end the turn there (the tiny model writes no tool
        # calls, so a stop string it does write stands in for "</tool_call>")
        c = ctx(max_turns=3, stop=["answer"])
        c.sampling = SamplingParams(temperature=0, max_new_tokens=64, stop=["answer"])
        engine, result = episode(c)
    finally:
        backend.shutdown()
    check_invariants(tok, result, engine, None)
    assert [r.sampling.stop for r in engine.sent] == [["answer", "</tool_call>"]]
    trained = [t for t, m in zip(result.tokens[-result.response_length:], result.loss_mask, strict=True) if m]
    assert tok.decode(trained, skip_special_tokens=True).endswith("answer")  # nothing after the stop string
    assert result.response == "The " and result.termination_reason == "stop"


def test_dagger_roll_in_mixes_student_and_teacher_by_beta_and_t_max(tok, model_dir):
    from rayapp.envs.agents.dagger import DAggerAgent

    def episode(beta, t_max, max_turns=4):
        student = recording(ScriptedEngine(tok, model_dir, [CALL] * 8))
        teacher = recording(ScriptedEngine(tok, model_dir, [CALL] * 8))
        student.name, teacher.name = "student", "teacher"
        agent = DAggerAgent(student, teacher, verify)
        c = EpisodeContext(3, None, StoppingCriteria(max_turns=max_turns), SamplingParams(max_new_tokens=64),
                           Iteration(beta=beta, t_max=t_max))
        result = run(agent.run(sample(), c))
        return episode_metadata(c.record), result  # the metadata the trainer gets

    m, result = episode(beta=1.0, t_max=0)
    assert m["_turn_actor"] == ["teacher"] * 4 and "_dagger_labels" not in m
    assert [p["actor"] for p in m["_turn_placement"]] == ["teacher"] * 4
    assert sum(result.loss_mask) > 0  # the teacher's tokens are the training targets

    m, result = episode(beta=0.0, t_max=0)
    assert m["_turn_actor"] == ["student"] * 4
    assert sum(result.loss_mask) == 0  # no student token is a target...
    assert [lab["turn"] for lab in m["_dagger_labels"]] == [1, 2, 3, 4]  # ...the teacher's labels are
    assert all(lab["label_ids"] for lab in m["_dagger_labels"])

    m, _ = episode(beta=1.0, t_max=2)  # the mixture covers the first t_max turns only
    assert m["_turn_actor"] == ["teacher", "teacher", "student", "student"]

    a, _ = episode(beta=0.5, t_max=0, max_turns=8)
    b, _ = episode(beta=0.5, t_max=0, max_turns=8)
    assert a["_turn_actor"] == b["_turn_actor"]  # seeded: the roll-in replays
    assert set(a["_turn_actor"]) == {"teacher", "student"}


class FakeSandbox:
    def __init__(self):
        self.closed = 0

    async def close(self):
        self.closed += 1


def test_a_kept_sandbox_is_closed_when_the_step_is_cancelled_between_run_and_verify(tok, model_dir):
    from rayapp.core.contracts import StepContext
    from rayapp.core.evaluator import Evaluator, TaskRun
    from rayapp.types import EvaluatorSpec, Resource, Task, TaskConfig

    opened = []

    async def factory(sample, c):
        opened.append(FakeSandbox())
        return opened[-1]

    between = asyncio.Event()

    class Paused(ToolAgent):  # the run phase is over (the sandbox kept), the verify phase not begun
        async def run(self, sample, c):
            result = await super().run(sample, c)
            between.set()
            await asyncio.Event().wait()
            return result

        async def verify_in(self, sandbox, sample, result):
            raise AssertionError("never verified")

    agent = Paused(ScriptedEngine(tok, model_dir, ["The answer is 4."]), None, tools=["bash"],
                   sandbox_factory=factory, keep_sandbox=True)
    token = Token(0, "node-a", (0,), 1.0, 1.0, 1.0)
    ev = Evaluator(EvaluatorSpec("tools", agent, Resource(concurrency=1)), StepContext(0), tokens=[token])
    task = Task("t", "What is 2 + 2?", TaskConfig("tools"), "4")
    group = TaskRun(task, [sample()], StoppingCriteria(max_turns=2), SamplingParams(max_new_tokens=64))

    async def step():
        running = asyncio.create_task(ev.run([group]))
        await asyncio.wait_for(between.wait(), 30)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    run(step())
    [sandbox] = opened
    assert sandbox.closed == 1
    def holds(v):
        return v is sandbox or (isinstance(v, dict) and holds(list(v.values()))) or \
            (isinstance(v, list | tuple) and any(holds(x) for x in v))

    assert not [k for k, v in vars(agent).items() if holds(v)]  # the agent keeps nothing of the episode
    assert len(ev._local) == 1  # and the token came back


class Window:
    """An engine whose window is smaller than the agent's max_context_len (sglang's is its
    max_req_input_len): a prompt at or past it makes nothing, a reply ends LENGTH where it fills it."""

    def __init__(self, engine, window):
        self.engine, self.window = engine, window

    async def info(self):
        return await self.engine.info()

    async def generate(self, req, timeout_s=None):
        room = self.window - len(req.input_ids)
        if room <= 0:
            return GenerateOutput("r", [], [], FinishReason.LENGTH, engine="window")
        out = await self.engine.generate(req, timeout_s)
        if len(out.output_ids) <= room:
            return out
        ids = out.output_ids[:room]
        return GenerateOutput("r", ids, out.logprobs[:room], FinishReason.LENGTH, engine="window")


@pytest.mark.parametrize("agent", [ChatAgent, ToolAgent])
def test_the_engines_window_ending_a_turn_is_max_context_and_the_budget_is_length(tok, model_dir, agent):
    def episode(window, max_new_tokens=64):
        engine = Window(ScriptedEngine(tok, model_dir, ["The answer is 4, as two and two make four."]), window)
        c = EpisodeContext(0, None, StoppingCriteria(max_turns=2, max_context_len=1000),
                           SamplingParams(max_new_tokens=max_new_tokens))
        return run(agent(engine, verify).run(sample(), c))

    prompt = len(episode(1).tokens)  # the prompt alone: past a 1-token window, no reply
    assert (episode(1).termination_reason, episode(1).response_length) == ("max_context_len", 0)
    cut = episode(prompt + 3)  # the window ends the reply after 3 tokens, short of its budget
    assert (cut.termination_reason, cut.response_length, cut.truncated) == ("max_context_len", 3, True)
    budget = episode(1000, max_new_tokens=3)  # the turn's own budget ends it: a LENGTH reply
    assert (budget.termination_reason, budget.response_length, budget.truncated) == ("length", 3, True)


def test_episodes_starting_at_once_share_one_tokenizer_load_and_a_failed_load_is_retried(model_dir):
    from rayapp.envs.protocol import EngineTokenizer

    class CountingEngine:
        def __init__(self):
            self.asked, self.fail = 0, True

        async def info(self):
            self.asked += 1
            await asyncio.sleep(0.05)  # a load in flight while the other episodes ask
            if self.fail:
                self.fail = False
                raise ConnectionError("engine not up yet")
            return {"tokenizer_path": str(model_dir)}

    engine = CountingEngine()
    tok = EngineTokenizer(engine)

    async def episodes():
        first = await asyncio.gather(*(tok.get() for _ in range(32)), return_exceptions=True)
        return first, await asyncio.gather(*(tok.get() for _ in range(32)))

    failed, loaded = asyncio.run(episodes())
    assert all(isinstance(e, ConnectionError) for e in failed) and engine.asked == 2
    assert len({id(t) for t in loaded}) == 1 and loaded[0].encode("2+2")
    assert asyncio.run(tok.get()) is loaded[0] and engine.asked == 2  # kept, also for a later loop

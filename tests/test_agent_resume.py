"""Partial rollouts at the agent: a cut-short multi-turn episode resumes from its last complete turn
(kept token data exact, its sandbox rebuilt by replaying tool calls); an agent that cannot resume
starts afresh."""

import asyncio

import msgspec
import pytest
from agent_helpers import CALL, ScriptedEngine, ctx, recording, sample
from conftest import run

from rayapp.envs.agents.chat import ChatAgent
from rayapp.envs.agents.multiturn import ToolAgent
from rayapp.envs.arithmetic import verify
from rayapp.record import Iteration, ResumePoint
from rayapp.trainers.converters import episode_metadata


class ExecSandbox:
    """Records the commands run in it (a fresh one per episode)."""

    def __init__(self):
        self.commands, self.closed = [], 0

    async def exec(self, command, timeout_s=None):
        import types as _types

        self.commands.append(command)
        return _types.SimpleNamespace(exit_code=0, stdout=f"ran {command}\n", stderr="", timed_out=False)

    async def close(self):
        self.closed += 1


def cut_short(episode, ready):
    """Run the ``episode`` coroutine until ``ready()`` (polled, bounded: a failure must not hang),
    then cancel it and see it end cancelled."""
    async def go():
        task = asyncio.create_task(episode)
        for _ in range(1000):
            if ready():
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())


def bash_call(command):
    return '<tool_call>{"name": "bash", "arguments": {"command": "' + command + '"}}</tool_call>'


def test_a_cut_short_episode_resumes_from_its_last_complete_turn(tok, model_dir):
    # partial rollouts: turns 1-2 complete (a bash call, a calculator call), turn 3 is cut short;
    # resumed, the kept token data is exactly as it was, the sandbox is rebuilt by replaying the
    # bash call, and turn 3 is generated again from the same context
    boxes = []

    async def factory(sample, c):
        boxes.append(ExecSandbox())
        return boxes[-1]

    first = recording(ScriptedEngine(tok, model_dir, [bash_call("touch a"), CALL]))
    hang = asyncio.Event()
    real = first.generate

    async def generate(req, timeout_s=None):
        if len(first.sent) == 2:
            await hang.wait()  # the third turn never ends: the step goes on without it
        return await real(req, timeout_s)

    first.generate = generate
    c1 = ctx(max_turns=5)

    cut_short(ToolAgent(first, verify, tools=["calculator", "bash"], sandbox_factory=factory).run(sample(), c1),
              lambda: len(first.sent) >= 2 and c1.record.turns == 2)
    point = c1.record.resume
    assert point is not None and point.turns == 2 and [r.turn for r in point.turn_records] == [1, 2]
    assert [(t.name, t.arguments) for t in point.tool_calls] == [("bash", {"command": "touch a"})]

    again = recording(ScriptedEngine(tok, model_dir, ["The answer is 4."]))
    s = sample()
    s.episode.start = point
    c2 = ctx(max_turns=5)
    result = run(ToolAgent(again, verify, tools=["calculator", "bash"], sandbox_factory=factory).run(s, c2))
    assert again.sent[0].input_ids == point.tokens  # the cut turn, generated again from the same context
    assert result.tokens[:len(point.tokens)] == point.tokens  # the kept turns, exactly
    kept = len(point.tokens) - point.prompt_len
    assert result.loss_mask[:kept] == point.loss_mask and result.rollout_log_probs[:kept] == point.rollout_log_probs
    assert result.turns == 3 and [r.turn for r in c2.record.turn_records] == [1, 2, 3]
    assert boxes[1].commands == ["touch a"]  # replayed in the new episode's fresh sandbox


def test_an_agent_that_cannot_resume_starts_afresh(tok, model_dir):
    class Fresh(ChatAgent):
        resumable = False

    s = sample()
    s.episode.start = ResumePoint(turns=1, tokens=[1, 2], prompt_len=1, loss_mask=[1], rollout_log_probs=[0.0])
    assert Fresh(ScriptedEngine(tok, model_dir, []), verify).resume_point(s) is None


def versioned(engine, version):
    """``engine``, its outputs naming the weights ``version`` (as a real engine reports them)."""
    real = engine.generate

    async def generate(req, timeout_s=None):
        return msgspec.structs.replace(await real(req, timeout_s), weight_version=version)

    engine.generate = generate
    return engine


def test_a_cut_short_dagger_roll_in_resumes_with_its_labels_and_per_turn_weights(tok, model_dir):
    # a student-only roll-in (beta 0: every turn the student's, every turn labelled by the teacher)
    # is cut short in its third turn under weights "0"; resumed under weights "1", it neither asks
    # the student nor the teacher about turns 1-2 again, keeps their labels, and each turn record
    # names the weights that produced it
    from rayapp.envs.agents.dagger import DAggerAgent
    from rayapp.episode import EpisodeContext
    from rayapp.types import SamplingParams, StoppingCriteria

    def context():
        return EpisodeContext(0, None, StoppingCriteria(max_turns=5), SamplingParams(max_new_tokens=64),
                              Iteration(beta=0.0, t_max=0))

    student = versioned(recording(ScriptedEngine(tok, model_dir, [CALL] * 8)), 0)
    teacher = recording(ScriptedEngine(tok, model_dir, ["The answer is 4."] * 8))
    hang, real = asyncio.Event(), student.generate

    async def generate(req, timeout_s=None):
        if len(student.sent) == 2:
            await hang.wait()
        return await real(req, timeout_s)

    student.generate = generate
    c1 = context()

    # until the third turn is under way
    cut_short(DAggerAgent(student, teacher, verify).run(sample(), c1),
              lambda: c1.record.turns == 2 and len(teacher.sent) == 2)
    point = c1.record.resume
    assert point.turns == 2 and [lab.turn for lab in point.dagger_labels] == [1, 2]

    student2 = versioned(recording(ScriptedEngine(tok, model_dir, ["The answer is 4."])), 1)
    teacher2 = recording(ScriptedEngine(tok, model_dir, ["The answer is 4."] * 8))
    s = sample()
    s.episode.start = point
    c2 = context()
    result = run(DAggerAgent(student2, teacher2, verify).run(s, c2))
    assert len(student2.sent) == 1 and student2.sent[0].input_ids == point.tokens  # only the cut turn, again
    assert len(teacher2.sent) == 1  # labelled once: the kept turns' labels came with the point
    assert result.turns == 3 and result.tokens[:len(point.tokens)] == point.tokens
    meta = episode_metadata(c2.record)
    assert [lab["turn"] for lab in meta["_dagger_labels"]] == [1, 2, 3]
    assert meta["_dagger_labels"][:2] == msgspec.to_builtins(point.dagger_labels)
    assert [r.weight_version for r in c2.record.turn_records] == [0, 0, 1]  # the staleness per turn

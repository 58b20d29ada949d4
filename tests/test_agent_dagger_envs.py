"""The DAgger agents the recipes build (``evaluators[].teacher``): mini-SWE in a real local sandbox,
where the teacher's turn really fixes the repository the student then finishes in, and the wiring
from a recipe to the agents."""

import json

import yaml
from conftest import run
from test_agent_multiturn import ScriptedEngine

from rayapp.cli import ROOT
from rayapp.envs.agents.dagger import DAggerAgent
from rayapp.envs.protocol import AgentDeps, run_inline
from rayapp.envs.sandboxes import make_sandbox
from rayapp.envs.swe import DAggerSweAgent, SweAgent, load_repos, load_swe_tasks
from rayapp.episode import EpisodeContext
from rayapp.record import Iteration
from rayapp.trainers.converters import episode_metadata
from rayapp.types import Sample, SamplingParams, StepKind, StoppingCriteria

DONE = "I fixed the bug."


def gold_write(repo):
    [(path, content)] = repo.task.gold_patch.items()
    call = {"name": "write_file", "arguments": {"path": path, "content": content}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def episode(tok, model_dir, beta, t_max, student_script, teacher_script, step=StepKind.ROLLOUT):
    task = load_swe_tasks()[0]
    student = ScriptedEngine(tok, model_dir, student_script)
    teacher = ScriptedEngine(tok, model_dir, teacher_script)

    async def open_sandbox(token):
        return await make_sandbox("local")

    agent = DAggerSweAgent(AgentDeps(student, run_inline, open_sandbox, teacher=teacher))
    sample = Sample(task.task_id, 0, task.prompt, task.label)
    ctx = EpisodeContext(2, None, StoppingCriteria(max_turns=3), SamplingParams(max_new_tokens=4096),
                         Iteration(beta=beta, t_max=t_max), step)

    async def both_phases():
        async with ctx:  # as the evaluator does: the context closes the sandbox the agent kept
            result = await agent.run(sample, ctx)
            return result, await agent.evaluate(sample, result, ctx)  # verified in the episode's own sandbox

    result, reward = run(both_phases())
    sample.metadata.update(episode_metadata(ctx.record))  # what the trainer gets
    return sample, result, reward, student, teacher


def test_the_teachers_turn_fixes_the_repository_the_student_finishes_in(tok, model_dir):
    repo = next(r for r in load_repos() if r.name == load_swe_tasks()[0].label["repo"])
    sample, result, reward, student, teacher = episode(tok, model_dir, beta=1.0, t_max=1,
                                                       student_script=[DONE], teacher_script=[gold_write(repo), DONE])
    assert sample.metadata["_turn_actor"] == ["teacher", "student"]  # t_max=1: the mixture covers turn 1 only
    assert reward["score"] == 1.0  # the teacher's write_file landed in the sandbox the verifier ran in
    assert result.termination_reason == "stop"
    # targets: the teacher's tokens carry loss; the student's turn carries none, and its label is the teacher's
    # (the turn ends at its tool call's closing tag; the eos that closes it is the environment's)
    teacher_turn = len(tok.encode(gold_write(repo), add_special_tokens=False))
    assert sum(result.loss_mask) == teacher_turn and result.loss_mask[:teacher_turn] == [1] * teacher_turn
    [label] = sample.metadata["_dagger_labels"]
    assert label["turn"] == 2 and label["text"] == DONE
    assert len(student.requests) == 1 and len(teacher.requests) == 2


def test_at_beta_zero_the_student_acts_and_the_teacher_only_labels(tok, model_dir):
    repo = next(r for r in load_repos() if r.name == load_swe_tasks()[0].label["repo"])
    sample, result, reward, _, teacher = episode(tok, model_dir, beta=0.0, t_max=0,
                                                 student_script=[DONE], teacher_script=[gold_write(repo)])
    assert sample.metadata["_turn_actor"] == ["student"]
    assert reward["score"] == 0.0  # the student stopped without fixing anything
    assert sum(result.loss_mask) == 0
    [label] = sample.metadata["_dagger_labels"]
    assert label["turn"] == 1 and "write_file" in label["text"]  # what the expert would have done there
    assert label["label_ids"] and label["state_len"] == len(teacher.requests[0].input_ids)


def test_an_eval_step_asks_the_teacher_for_no_labels(tok, model_dir):
    sample, _, _, student, teacher = episode(tok, model_dir, beta=0.0, t_max=0, student_script=[DONE],
                                             teacher_script=[DONE], step=StepKind.EVAL)
    assert sample.metadata["_turn_actor"] == ["student"] and "_dagger_labels" not in sample.metadata
    assert teacher.requests == [] and len(student.requests) == 1


def test_a_recipe_with_a_teacher_builds_the_dagger_agents():
    from rayapp.recipe import build_scheduler, parse_recipe

    async def not_called(*args, **kwargs):
        raise AssertionError("wiring must not run or open anything")

    cfg = yaml.safe_load((ROOT / "recipes" / "dagger_local" / "rollout.yaml").read_text())
    recipe = parse_recipe(cfg["applications"][0]["args"])
    engines = {"student": object(), "teacher": object()}
    sched = build_scheduler(recipe, engines, None, executor=not_called, open_sandbox=not_called)
    swe, math = sched.specs["swe"].handler, sched.specs["math"].handler
    assert isinstance(swe, DAggerSweAgent) and isinstance(swe, SweAgent)
    assert isinstance(math, DAggerAgent)
    assert swe.engine is engines["student"] and swe.teacher is engines["teacher"]
    assert math.engine is engines["student"] and math.teacher is engines["teacher"]
    assert recipe.dagger.beta(0) == 1.0 and recipe.dagger.beta(1) == 0.5 and recipe.dagger.beta(2) == 0.0
    assert [recipe.dagger.t_max(i) for i in range(3)] == [1, 2, 3]

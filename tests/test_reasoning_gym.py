"""The reasoning-gym env family: rows from reasoning_gym.create_dataset, scored by each dataset's
own score_answer. Needs the optional extra (pip install 'rayapp[reasoning-gym]'); the tests that use
reasoning-gym skip without it, the one about the missing package runs everywhere."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import msgspec
import pytest

from rayapp.envs import reasoning_gym as env
from rayapp.types import AgentResult, Sample

FAMILIES = ["leg_counting", "basic_arithmetic", "word_sorting", "knights_knaves", "maze"]


@pytest.fixture
def rg():
    reasoning_gym = pytest.importorskip("reasoning_gym")
    env._dataset.cache_clear()  # each test makes its entries afresh, as another process would
    return reasoning_gym


def run(task, text):
    return env.verify(Sample(task.task_id, 0, task.prompt, label=task.label),
                      AgentResult(tokens=[], response_length=0, response=text))


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_are_the_datasets_entries_in_order(rg, family):
    rows = env.rows_for(family, size=4, seed=3)
    entries = rg.create_dataset(family, size=4, seed=3)
    assert [t.prompt for t in rows] == [entries[i]["question"] for i in range(4)]
    assert [t.label["answer"] for t in rows] == [entries[i]["answer"] for i in range(4)]
    assert len({t.task_id for t in rows}) == 4 and {t.config.task_type for t in rows} == {env.TASK_TYPE}
    env._dataset.cache_clear()
    assert env.rows_for(family, size=4, seed=3) == rows  # the same arguments, the same tasks


@pytest.mark.parametrize("family", FAMILIES)
def test_the_oracle_answer_scores_full_and_others_do_not(rg, family):
    for task in env.rows_for(family, size=3, seed=11):
        answer = task.label["answer"]
        assert run(task, f"Let me think.\n<answer>{answer}</answer>") == {"score": 1.0}
        assert run(task, f"<answer>{answer}</answer> no wait, <answer>not it at all</answer>")["score"] < 1.0
        assert run(task, f"The answer is {answer}.") == {"score": 0.0}  # the format asks for the tags
        assert run(task, None) == {"score": 0.0}


def test_a_label_survives_a_json_round_trip_and_another_process(rg):
    (task,) = env.rows_for("leg_counting", size=1, seed=5)
    task = msgspec.json.decode(msgspec.json.encode(task), type=type(task))  # as a checkpoint stores it
    env._dataset.cache_clear()  # as in a verifier process that never made the rows
    assert run(task, f"<answer>{task.label['answer']}</answer>") == {"score": 1.0}


def test_a_family_config_reaches_the_dataset(rg):
    rows = env.rows_for("leg_counting", size=3, seed=1, config={"min_animals": 1, "max_animals": 1})
    entries = rg.create_dataset("leg_counting", size=3, seed=1, min_animals=1, max_animals=1)
    assert [t.prompt for t in rows] == [entries[i]["question"] for i in range(3)]
    assert rows[0].label["config"] == {"max_animals": 1, "min_animals": 1}
    assert run(rows[0], f"<answer>{rows[0].label['answer']}</answer>") == {"score": 1.0}


def test_a_recipe_source_names_the_family_by_attribute(rg):
    cfg = SimpleNamespace(n_prompts=3, seed=9)
    assert env.tasks.leg_counting(cfg) == env.rows_for("leg_counting", size=3, seed=9)
    assert "leg_counting" in dir(env.tasks)
    with pytest.raises(AttributeError, match="unknown reasoning_gym task 'no_such_family'"):
        _ = env.tasks.no_such_family


@pytest.mark.parametrize("kwargs,match", [
    ({"task": "no_such_family", "size": 2}, "unknown reasoning_gym task"),
    ({"task": "leg_counting", "size": 0}, "size must be an int >= 1"),
    ({"task": "leg_counting", "size": 2, "config": {"x": object()}}, "plain JSON"),
])
def test_bad_arguments_are_one_clear_error(rg, kwargs, match):
    with pytest.raises(ValueError, match=match):
        env.rows_for(kwargs.pop("task"), **kwargs)


def test_the_agent_is_a_single_turn_chat_agent_with_the_envs_verifier(rg):
    from rayapp.envs.agents.chat import ChatAgent

    deps = SimpleNamespace(engine=object(), executor=object(), verify=None)
    agent = env.make_agent(deps)
    assert isinstance(agent, ChatAgent) and agent.verify is env.verify
    assert agent.system_prompt == env.SYSTEM_PROMPT and "<answer>" in env.SYSTEM_PROMPT

    def mine(sample, result):
        return {"score": 0.0}

    assert env.make_agent(SimpleNamespace(engine=object(), executor=object(), verify=mine)).verify is mine


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # what an import finds when it is not installed
    with pytest.raises(ModuleNotFoundError, match=r"rayapp\[reasoning-gym\]"):
        env.rows_for("leg_counting", size=1)

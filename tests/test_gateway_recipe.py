"""An evaluator's ``gateway:`` section (rayapp/recipe/gateway_config.py): the agent is checked like every
plug-in (an ``async def`` taking (client, task, sandbox)), what it replaces may not be named beside it,
a verifier function must score it, and partial rollouts may not ask to resume it (its state is in the
user's code): each refusal one RecipeError naming the field. The example recipe parses."""

import importlib
import itertools
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from rayapp.recipe import RecipeError, parse_recipe

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "openai_agent"
_names = itertools.count()

AGENTS = '''
async def solve(client, task, sandbox):
    return "42"

async def defaulted(client, task, sandbox=None, *, retries=2):
    return "42"

def sync_solve(client, task, sandbox):
    return "42"

async def two_args(client, task):
    return "42"
'''


@pytest.fixture
def mod(tmp_path, monkeypatch):
    name = f"user_gateway_agents_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(AGENTS))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return name


def recipe(gateway, **evaluator):
    return {
        "engines": {"student": {}},
        "evaluators": [{"evaluator_id": "arithmetic", "env": "arithmetic", "gateway": gateway, **evaluator}],
        "data": {"arithmetic": {"env": "arithmetic", "n_prompts": 4}},
    }


def refusal(args) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        parse_recipe(args)
    return info.value


def test_a_gateway_section_parses_with_its_defaults(mod):
    cfg = parse_recipe(recipe({"agent": f"{mod}:solve"}))
    gw = cfg.evaluators[0].gateway
    assert (gw.agent, gw.segments, gw.sandbox) == (f"{mod}:solve", "last", False)
    assert parse_recipe(recipe({"agent": f"{mod}:defaulted", "segments": "each", "sandbox": True})) \
        .evaluators[0].gateway.segments == "each"
    assert parse_recipe(recipe(None)).evaluators[0].gateway is None  # unset: the env's own agent


@pytest.mark.parametrize("gateway, path, said", [
    ({"agent": "{mod}:sync_solve"}, "$.evaluators[0].gateway.agent", "not a coroutine function"),
    ({"agent": "{mod}:two_args"}, "$.evaluators[0].gateway.agent", "takes (client, task)"),
    ({"agent": "{mod}:missing"}, "$.evaluators[0].gateway.agent", "has no attribute 'missing'"),
    ({"agent": "no_such_module_anywhere:solve"}, "$.evaluators[0].gateway.agent", "no module named"),
    ({"agent": "os:popen"}, "$.evaluators[0].gateway.agent", "standard library"),
    ({"agent": "{mod}:solve", "segments": "first"}, "$.evaluators[0].gateway.segments", "invalid enum value 'first'"),
    ({"agent": "{mod}:solve", "retries": 3}, "$.evaluators[0].gateway", "unknown field"),
    ({}, "$.evaluators[0].gateway", "set one of agent"),
    ({"agent": "{mod}:solve", "command": ["python3", "a.py"], "sandbox": True}, "$.evaluators[0].gateway",
     "set one of agent"),
    ({"command": ["python3", "a.py"]}, "$.evaluators[0].gateway.sandbox", "set sandbox: true"),
    ({"command": []}, "$.evaluators[0].gateway.command", "length >= 1"),
    ({"command": ["python3", ""], "sandbox": True}, "$.evaluators[0].gateway.command[1]", "length >= 1"),
    ({"agent": "{mod}:solve", "collect": ["out.txt"]}, "$.evaluators[0].gateway", "a command's settings"),
    ({"command": ["a"], "sandbox": True, "command_timeout_s": 0}, "$.evaluators[0].gateway.command_timeout_s",
     "> 0"),
    ({"agent": "{mod}:solve", "tool_parser": "sglang:"}, "$.evaluators[0].gateway.tool_parser", "matching"),
    ({"agent": "{mod}:solve", "tool_parser": "hermes"}, "$.evaluators[0].gateway.tool_parser", "matching"),
])
def test_a_wrong_gateway_section_is_one_error_naming_its_field(mod, gateway, path, said):
    gateway = {k: v.format(mod=mod) if isinstance(v, str) else v for k, v in gateway.items()}
    e = refusal(recipe(gateway))
    assert e.path == path and said in e.reason, (e.path, e.reason)


def test_a_command_agent_runs_in_a_local_or_docker_sandbox_and_is_built_from_its_argv(mod):
    from rayapp.gateway.command import CommandAgent
    from rayapp.recipe.wiring import check_builds

    args = recipe({"command": ["python3", "agent.py"], "sandbox": True, "command_timeout_s": 30,
                   "collect": ["answer.txt"]})
    gw = parse_recipe(args).evaluators[0].gateway
    assert (gw.command, gw.command_timeout_s, gw.collect) == (["python3", "agent.py"], 30, ["answer.txt"])
    assert check_builds(parse_recipe(args)) == []
    assert CommandAgent(gw.command, timeout_s=gw.command_timeout_s).command == ["python3", "agent.py"]
    args["evaluators"][0]["sandbox"] = {"kind": "docker", "image": "python:3.11"}
    assert parse_recipe(args).evaluators[0].sandbox.kind == "docker"


@pytest.mark.parametrize("key, value", [("agent", "rayapp.envs.arithmetic:make_agent"), ("tools", ["calculator"]),
                                        ("teacher", "student")])
def test_what_a_gateway_agent_replaces_may_not_be_named_beside_it(mod, key, value):
    e = refusal(recipe({"agent": f"{mod}:solve"}, **{key: value}))
    assert e.path == f"$.evaluators[0].{key}"
    assert "$.evaluators[0].gateway.agent" in e.reason and f"unset {key}" in e.reason


def test_an_env_that_verifies_in_its_sandbox_needs_a_verifier_function(mod):
    args = recipe({"agent": f"{mod}:solve"}, env="humaneval", evaluator_id="humaneval")
    args["data"] = {"humaneval": {"env": "humaneval"}}
    e = refusal(args)
    assert e.path == "$.evaluators[0].verifier" and "verify(sample, result)" in e.reason
    args["evaluators"][0]["verifier"] = "rayapp.envs.arithmetic:verify"
    assert parse_recipe(args).evaluators[0].verifier == "rayapp.envs.arithmetic:verify"


def test_partial_rollouts_may_restart_a_gateway_agent_but_not_resume_it(mod, tmp_path):
    args = recipe({"agent": f"{mod}:solve"})
    args["scheduler"] = {"partial": {"over_provision": 1.5}, "checkpoint_dir": str(tmp_path)}  # policy: resume
    e = refusal(args)
    assert e.path == "$.scheduler.partial.policy"
    assert "$.evaluators[0].gateway.agent" in e.reason and "restart" in e.reason  # both paths, and the way out
    args["scheduler"]["partial"]["policy"] = "restart"
    assert parse_recipe(args).scheduler.partial.policy == "restart"
    del args["evaluators"][0]["gateway"]  # the env's own agent resumes as before
    args["scheduler"]["partial"]["policy"] = "resume"
    assert parse_recipe(args).scheduler.partial.policy == "resume"


def test_the_example_recipe_names_its_agent_and_verifier_by_import_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))  # as PYTHONPATH=examples/openai_agent would
    args = yaml.safe_load((EXAMPLE / "rollout.yaml").read_text())["applications"][0]["args"]
    ev = parse_recipe(args).evaluators[0]
    assert (ev.gateway.agent, ev.verifier, ev.env) == ("openai_agent.agent:solve", "openai_agent.verify:verify",
                                                       "arithmetic")
    source = (EXAMPLE / "openai_agent" / "agent.py").read_text()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines()
               if line.strip().startswith(("import ", "from "))}
    assert "openai" in imports and imports - {"openai"} <= sys.stdlib_module_names | {"__future__"}, imports


def test_sglangs_tool_parser_is_checked_where_the_manager_builds_it_not_by_validate(mod):
    """Validation (``check_builds``) takes the name's form only: a cluster recipe validates on a machine
    without sglang. The manager's build needs sglang (not in this venv: the SGLang lane runs the
    parser itself, tests/sglang_engine/test_tool_parser.py) and says so, naming the field."""
    from rayapp.recipe.wiring import build_evaluator_specs, check_builds

    async def nowhere(*args, **kwargs):
        raise AssertionError("building an agent ran no work")

    pytest.importorskip("openai")
    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    cfg = parse_recipe(recipe({"agent": f"{mod}:solve", "tool_parser": "sglang:qwen25"}))
    assert check_builds(cfg) == []
    with pytest.raises(RecipeError) as info:
        build_evaluator_specs(cfg, {"student": object()}, executor=nowhere, open_sandbox=nowhere, gateway=object())
    assert info.value.path == "$.evaluators[0].gateway.tool_parser"
    assert "needs the sglang package where the manager runs" in info.value.reason

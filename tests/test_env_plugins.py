"""Environments, agents, verifiers, tools and data sources by import path: one protocol each, one
error naming the recipe field when a path or object is wrong; the built-in envs take the same shape
(one module each, one Env) and every agent is the core's AgentHandler."""

import importlib
import itertools
import textwrap

import pytest
from conftest import run

from rayapp import AgentDeps, AgentHandler, ChatAgent, DAggerAgent, Env, PluginError, ToolAgent
from rayapp.core.agent import FunctionAgent
from rayapp.envs.agents.tools import ToolCall, calculator
from rayapp.envs.registry import ENVS, get_env
from rayapp.envs.swe import DAggerSweAgent, SweAgent
from rayapp.recipe import RecipeError, build_data_source, build_evaluator_specs, parse_recipe
from rayapp.types import Task

_names = itertools.count()

PLUGIN = '''
from rayapp import ChatAgent, Env, Task, TaskConfig

NOT_CALLABLE = 3

def rows(cfg):
    return [Task(f"p{i}", f"prompt {i}", TaskConfig("plug")) for i in range(cfg.n_prompts)]

async def async_rows(cfg):
    return rows(cfg)

async def async_agent(deps):
    return agent(deps)

def verify(sample, result):
    return {"score": 1.0}

async def averify(sample, result):
    return {"score": 0.5}

def verify_one(sample):
    return {"score": 1.0}

async def lookup(arguments, sandbox):
    return "found " + str(arguments.get("q"))

def sync_tool(arguments, sandbox):
    return "x"

def agent(deps):
    return ChatAgent(deps.engine, deps.verify, deps.executor)

def not_an_agent(deps):
    return "nope"

ENV = Env("plug", rows, agent, verify=verify)
NO_ROWS = Env("plug", None, agent, verify=verify)
'''


@pytest.fixture
def plug(tmp_path, monkeypatch):
    """The name of a fresh importable module holding PLUGIN, and of one that fails to import."""
    name = f"user_plug_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return name


def recipe(evaluator=None, dataset=None):
    return {"engines": {"student": {}, "teacher": {}},
            "evaluators": [{"evaluator_id": "plug", **(evaluator or {})}],
            "data": {"x": {**(dataset or {})}}}


def test_each_built_in_env_is_one_module_with_one_env():
    assert set(ENVS) == {"arithmetic", "math", "humaneval", "swe"}
    for name, env in ENVS.items():
        module = importlib.import_module(f"rayapp.envs.{name}")
        assert module.ENV is env and env.name == name and get_env(name) is env
    assert [e for e in ENVS.values() if e.make_dagger_agent is not None] == [ENVS["math"], ENVS["swe"]]
    assert ENVS["arithmetic"].verify is not None and ENVS["math"].verify is not None
    assert ENVS["humaneval"].verify is None and ENVS["swe"].verify is None  # verified in their sandboxes
    assert set(ENVS["math"].tools) == {"calculator"} and set(ENVS["swe"].tools) == {"bash", "read_file", "write_file"}


def test_the_built_in_envs_rows_carry_their_name_as_task_type():
    from rayapp.recipe import DatasetConfig

    for name in ("arithmetic", "math"):
        tasks = ENVS[name].rows(DatasetConfig(env=name, n_prompts=3, seed=1))
        assert len(tasks) == 3 and {t.config.task_type for t in tasks} == {name}
    assert {t.config.task_type for t in ENVS["swe"].rows(DatasetConfig(env="swe"))} == {"swe"}


def test_every_agent_is_the_core_s_agent_handler():
    for cls in (ChatAgent, ToolAgent, DAggerAgent, SweAgent, DAggerSweAgent, FunctionAgent):
        assert issubclass(cls, AgentHandler), cls

    class Forgetful(AgentHandler):
        async def run(self, sample, ctx):
            raise NotImplementedError

    with pytest.raises(TypeError, match="evaluate"):
        Forgetful()  # the protocol's methods are abstract for a subclass
    engines = object()
    deps = AgentDeps(engines, None, None, teacher=object())
    for env in ENVS.values():
        assert isinstance(env.build_agent(deps), AgentHandler)
        if env.make_dagger_agent is not None:
            assert isinstance(env.build_agent(deps, dagger=True), AgentHandler)


@pytest.mark.parametrize("evaluator,dataset,where,message", [
    ({"env": "nosuch_pkg_zz.env:ENV"}, None, "$.evaluators[0].env",
     "env 'nosuch_pkg_zz.env:ENV': no module named 'nosuch_pkg_zz'"),
    ({"env": "{m}:MISSING"}, None, "$.evaluators[0].env", "env '{m}:MISSING': module '{m}' has no attribute 'MISSING'"),
    ({"env": "{m}:NOT_CALLABLE"}, None, "$.evaluators[0].env", "a int, expected a rayapp.envs.protocol.Env"),
    ({"env": "{m}_broken:ENV"}, None, "$.evaluators[0].env",
     "importing '{m}_broken' failed: RuntimeError: boom at import"),
    ({"env": "chess"}, None, "$.evaluators[0].env", "'chess' is not one of ['arithmetic', 'humaneval', 'math', 'swe']"),
    ({"agent": "{m}:NOT_CALLABLE"}, None, "$.evaluators[0].agent", "a int is not callable; expected factory(deps"),
    ({"agent": "{m}:verify"}, None, "$.evaluators[0].agent", "takes (sample, result), expected factory(deps"),
    ({"verifier": "{m}:verify_one"}, None, "$.evaluators[0].verifier",
     "takes (sample), expected verify(sample, result) -> dict[str, float]"),
    ({"env": "math", "tools": ["calculator", "{m}:sync_tool"]}, None, "$.evaluators[0].tools[1]",
     "not a coroutine function"),
    ({"env": "math", "tools": ["abacus"]}, None, "$.evaluators[0].tools[0]", "tool 'abacus': not one of"),
    ({"env": "math", "tools": ["{m}:nope"]}, None, "$.evaluators[0].tools[0]", "has no attribute 'nope'"),
    ({"env": "swe", "verifier": "{m}:verify"}, None, "$.evaluators[0].verifier", "env 'swe' verifies inside"),
    ({"tools": ["calculator"]}, None, "$.evaluators[0].tools", "env 'arithmetic' runs an agent without tools"),
    ({"env": "humaneval", "teacher": "teacher"}, None, "$.evaluators[0].teacher", "has no DAgger agent"),
    (None, {"source": "{m}:NOT_CALLABLE"}, "$.data.x.source", "data source '{m}:NOT_CALLABLE': a int is not"),
    (None, {"source": "{m}:rows", "path": "a.jsonl"}, "$.data.x.source", "a path or a source, not both"),
    (None, {"source": "{m}:async_rows"}, "$.data.x.source", "data source '{m}:async_rows': a coroutine function; "
     "it is called, not awaited: expected a plain def rows(cfg: DatasetConfig) -> Iterable[Task]"),
    ({"agent": "{m}:async_agent"}, None, "$.evaluators[0].agent", "a coroutine function; it is called, not awaited"),
    (None, {"fields": {"prompt": "q"}}, "$.data.x.fields", "fields map a file's columns: set path too"),
    (None, {"env": "{m}:NO_ROWS"}, "$.data.x.path", "has no rows of its own: give a path or a source"),
    (None, {"env": "{m}:NOPE"}, "$.data.x.env", "has no attribute 'NOPE'"),
    (None, {"path": "a.jsonl", "fields": {"prompt": "q", "label": "q"}}, "$.data.x.fields",
     "columns named for two fields: ['q']"),
    (None, {"path": "a.jsonl", "task_type": "t", "fields": {"task_type": "kind"}}, "$.data.x.task_type",
     "unset one of the two"),
])
def test_a_wrong_plug_in_is_one_error_naming_its_recipe_field(plug, evaluator, dataset, where, message):
    def fill(d):
        return {k: ([x.format(m=plug) for x in v] if isinstance(v, list) else
                    v.format(m=plug) if isinstance(v, str) else v) for k, v in (d or {}).items()}

    with pytest.raises(RecipeError) as e:
        parse_recipe(recipe(fill(evaluator), fill(dataset)), source="r.yaml")
    assert str(e.value).startswith(f'recipe "r.yaml": {where}: '), str(e.value)
    assert message.format(m=plug) in str(e.value), str(e.value)


async def no_sandbox(*args, **kwargs):
    raise AssertionError("wiring must not open anything")


def specs(args):
    return {s.evaluator_id: s for s in build_evaluator_specs(
        parse_recipe(args), {"student": "S", "teacher": "T"}, executor=no_sandbox, open_sandbox=no_sandbox)}


def test_plug_ins_reach_the_agents(plug):
    mod = importlib.import_module(plug)
    args = recipe({"env": f"{plug}:ENV"}, {"env": f"{plug}:ENV", "n_prompts": 2, "task_type": "plug"})
    args["evaluators"] += [
        {"evaluator_id": "arith", "env": "arithmetic", "verifier": f"{plug}:verify"},
        {"evaluator_id": "calc", "env": "math", "tools": ["calculator", f"{plug}:lookup"], "teacher": "teacher"},
        {"evaluator_id": "own", "env": "swe", "agent": f"{plug}:agent", "verifier": f"{plug}:verify"},
    ]
    by_id = specs(args)
    assert isinstance(by_id["plug"].handler, ChatAgent) and by_id["plug"].handler.verify is mod.verify
    assert by_id["arith"].handler.verify is mod.verify  # the recipe's verifier over the env's own
    calc = by_id["calc"].handler
    assert isinstance(calc, DAggerAgent) and calc.teacher == "T" and calc.tools == ["calculator", "lookup"]
    assert calc.tool_fns == {"calculator": calculator, "lookup": mod.lookup}
    assert "lookup" in calc.system_prompt  # the model is told about it
    assert run(calc._call_tool(ToolCall("lookup", {"q": "x"}), None)) == "found x"
    assert isinstance(by_id["own"].handler, ChatAgent) and by_id["own"].handler.verify is mod.verify
    source = build_data_source(parse_recipe(args))
    assert [t.task_id for t in source.take(2)] and {t.config.task_type for t in source.take(4)} == {"plug"}


def test_a_plain_verifier_runs_through_the_executor_and_an_async_one_is_awaited(plug):
    from rayapp.episode import EpisodeContext
    from rayapp.types import AgentResult, Sample, SamplingParams, StoppingCriteria

    ran = []

    async def executor(token, fn, *args):
        ran.append(fn.__name__)
        return fn(*args)

    args = recipe({"verifier": f"{plug}:verify"})
    args["evaluators"].append({"evaluator_id": "a", "verifier": f"{plug}:averify"})
    handlers = {s.evaluator_id: s.handler for s in build_evaluator_specs(
        parse_recipe(args), {"student": "S", "teacher": "T"}, executor=executor, open_sandbox=no_sandbox)}
    ctx = EpisodeContext(0, None, StoppingCriteria(), SamplingParams())
    sample, result = Sample("t", 0, "p", "l"), AgentResult(tokens=[1], response_length=0)
    assert run(handlers["plug"].evaluate(sample, result, ctx)) == {"score": 1.0} and ran == ["verify"]
    assert run(handlers["a"].evaluate(sample, result, ctx)) == {"score": 0.5} and ran == ["verify"]


def test_an_agent_factory_that_returns_no_agent_fails_at_wiring_naming_the_field(plug):
    with pytest.raises(RecipeError, match=r"\$\.evaluators\[0\]\.agent: agent '.*:not_an_agent': returned a str, "
                                          r"expected an AgentHandler"):
        specs(recipe({"agent": f"{plug}:not_an_agent"}))


def test_a_data_source_plug_in_gives_the_rows_and_its_non_tasks_are_named(plug, tmp_path):
    source = build_data_source(parse_recipe(recipe(dataset={"source": f"{plug}:rows", "n_prompts": 3})))
    assert sorted(t.task_id for t in source.take(3)) == ["p0", "p1", "p2"]
    (tmp_path / f"{plug}_bad.py").write_text("def rows(cfg):\n    return ['not a task']\n")
    with pytest.raises(ValueError, match=r"dataset 'x': row 0 is a str, not a Task"):
        build_data_source(parse_recipe(recipe(dataset={"source": f"{plug}_bad:rows"})))


def test_import_paths_take_either_separator_and_builtins_need_none():
    from rayapp.envs.plugin_import import import_object, load_tool

    assert import_object("rayapp.envs.math:ENV", "env") is ENVS["math"]
    assert import_object("rayapp.envs.math.ENV", "env") is ENVS["math"]
    assert load_tool("calculator") == ("calculator", calculator)
    assert load_tool("rayapp.envs.agents.tools:calculator") == ("calculator", calculator)
    with pytest.raises(PluginError, match=r"env 'x:': expected 'package.module:attr'"):
        import_object("x:", "env")
    assert isinstance(get_env("rayapp.envs.arithmetic:ENV"), Env)
    assert all(isinstance(t, Task) for t in ENVS["arithmetic"].rows(type("C", (), {"seed": 0, "n_prompts": 2})))

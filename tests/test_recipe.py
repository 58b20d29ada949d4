"""Recipes without Ray: parsing, the bounds on the types, the cross-field rules, the launch-time
variables, and the wiring of a recipe into evaluator specs."""


import pickle
import re

import pytest
import yaml

from rayapp.cli import ROOT
from rayapp.core.batching import budget_batching, fifo_batching
from rayapp.core.convert import InputError
from rayapp.recipe import RecipeError, apply_env, build_evaluator_specs, load_recipe, parse_recipe
from rayapp.types import Resource, SamplingParams, StoppingCriteria

LOCAL = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())["applications"][0]["args"]


def _local():
    return yaml.safe_load(yaml.safe_dump(LOCAL))


def test_the_local_recipe_parses():
    cfg = parse_recipe(LOCAL)
    assert cfg.engines["student"].backend == "hf" and cfg.pool.gate
    assert cfg.evaluators[0].run_resource == Resource(gpu=0.25, cpu=0.5, memory_gb=1)
    assert [e.env for e in cfg.evaluators] == ["arithmetic", "math", "humaneval", "swe"]


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda a: a["evaluators"][0]["resource"].update(gpu="lots"), r"\$\.evaluators\[0\]\.resource\.gpu"),
    (lambda a: a["evaluators"][0].update(engine="teacher"), r"\$\.evaluators\[0\]\.engine: 'teacher'"),
    (lambda a: a["pool"].update(cluster_layuot="x"),
     r'\$\.pool: unknown field "cluster_layuot" \(expected gate, cluster_layout, num_cpus, memory_gb, '
     r'pg_ready_timeout_s\)$'),
    (lambda a: a.update(engines={}), r"\$\.engines: at least one engine"),
    (lambda a: a.update(evaluators=[]), r"\$\.evaluators: at least one evaluator"),
    (lambda a: a["evaluators"][3].update(teacher="expert"), r"\$\.evaluators\[3\]\.teacher: 'expert' is not one of"),
    (lambda a: a["evaluators"][0].update(teacher="student"),
     r"\$\.evaluators\[0\]\.teacher: env 'arithmetic' has no DAgger agent; DAgger runs on \['math', 'swe'\]"),
])
def test_a_bad_recipe_gets_one_error_naming_the_path(mutate, message):
    args = _local()
    mutate(args)
    with pytest.raises(RecipeError, match=message):
        parse_recipe(args, source="x.yaml")


def test_a_recipe_takes_a_dagger_schedule_and_filters():
    args = _local()
    args["dagger"] = {"beta_schedule": "cosine", "beta_start": 1.0, "beta_end": 0.1, "decay_iters": 3}
    args["filters"] = {"rejection": {"drop_all_wrong": True}, "finish_only": {"whole_group": False}}
    cfg = parse_recipe(args)
    assert cfg.dagger.beta(3) == pytest.approx(0.1) and cfg.filters.rejection.drop_all_wrong
    args["filters"]["rejection"]["drop_al_wrong"] = True
    with pytest.raises(RecipeError, match="drop_al_wrong"):
        parse_recipe(args)


def test_the_user_set_variables_are_read_once_when_the_recipe_is_built_and_a_bad_one_stops_the_build(monkeypatch):
    """Issue 31 point 4: the spec's user-set STACX_* variables are read when the step runner is built
    (``rayapp.recipe.environment``), not at each step; a bad one is an error naming the variable then."""
    from rayapp.recipe import build_step_runner

    async def not_called(*a, **kw):
        raise AssertionError("the wiring must not run or open anything")

    args = _local()
    args["dagger"] = {"t_max_step": 0}
    cfg = parse_recipe(args)
    for name, value in (("STACX_REUSE_ROLLOUT", "1"), ("STACX_DAGGER_EVAL_BETA", "0.3"), ("STACX_DAGGER_T_MAX", "12")):
        monkeypatch.setenv(name, value)
    runner = build_step_runner(cfg, {"student": object()}, None, executor=not_called, open_sandbox=not_called)
    for name in ("STACX_REUSE_ROLLOUT", "STACX_DAGGER_EVAL_BETA", "STACX_DAGGER_T_MAX"):
        monkeypatch.setenv(name, "changed later, not read")
    iteration = runner.scheduler.iteration
    assert runner.reuse.reuse_rollout and (iteration.eval_beta, iteration.static_t_max) == (0.3, 12)
    monkeypatch.setenv("STACX_SAVE_PER_ITER_PT", "maybe")
    with pytest.raises(RecipeError) as info:
        build_step_runner(cfg, {"student": object()}, None, executor=not_called, open_sandbox=not_called)
    assert str(info.value).startswith("environment variable: STACX_DAGGER_EVAL_BETA=")  # the first bad one
    for name in ("STACX_REUSE_ROLLOUT", "STACX_DAGGER_EVAL_BETA", "STACX_DAGGER_T_MAX"):
        monkeypatch.delenv(name)
    with pytest.raises(RecipeError, match=r"^environment variable: STACX_SAVE_PER_ITER_PT='maybe': expected 1 or 0"):
        build_step_runner(cfg, {"student": object()}, None, executor=not_called, open_sandbox=not_called)


def test_stacx_dagger_env_concurrency_sets_the_ceiling_of_swe_dagger_evaluators_only():
    args = _local()
    args["engines"]["teacher"] = args["engines"]["student"]
    args["evaluators"][3]["teacher"] = "teacher"  # swe becomes a DAgger evaluator
    args["evaluators"][1]["teacher"] = "teacher"  # math too: not the SWE recipe's variable's business
    cfg = parse_recipe(args)
    assert apply_env(cfg, {}) is cfg
    out = apply_env(cfg, {"STACX_DAGGER_ENV_CONCURRENCY": "7"})
    assert [e.resource.concurrency for e in out.evaluators] == [3, 3, 3, 7]
    assert out.evaluators[3].resource.cpu == cfg.evaluators[3].resource.cpu
    for bad in ("0", "four", "2.5"):
        with pytest.raises(RecipeError, match=f"STACX_DAGGER_ENV_CONCURRENCY='{bad}': expected an integer >= 1"):
            apply_env(cfg, {"STACX_DAGGER_ENV_CONCURRENCY": bad})




ENGINE = r"\$\.engines\.student\."


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda a: a["engines"]["student"].update(backend="vllm"),
     ENGINE + r'backend: expected "hf" or "sglang", got "vllm"$'),
    (lambda a: a["engines"]["student"].update(num_replicas=0), ENGINE + r"num_replicas: expected int >= 1"),
    (lambda a: a["engines"]["student"].update(request_timeout_s=0),
     ENGINE + r"request_timeout_s: expected float > 0 and <= 604800, got 0$"),
    (lambda a: a["engines"]["student"].update(backend="sglang", options={"weight_version": "default"}),
     ENGINE + r"options\.weight_version: the sglang backend names weight versions itself"),
    (lambda a: a["pool"].update(num_cpus=-1), r"\$\.pool\.num_cpus: expected float >= 0"),
    (lambda a: a["scheduler"].update(rollout_batch_size=0), r"\$\.scheduler\.rollout_batch_size: expected int >= 1"),
    (lambda a: a["data"]["math"].update(weight=-0.5),
     r"\$\.data\.math\.weight: expected float >= 0 and <= 1000000, got -0\.5$"),
    (lambda a: a["evaluators"][2]["sandbox"].update(kind="podman"),
     r'\$\.evaluators\[2\]\.sandbox\.kind: expected "docker" or "local", got "podman"$'),
    (lambda a: a["evaluators"][2]["sandbox"].update(kind="docker"),
     r'\$\.evaluators\[2\]\.sandbox: kind "local", or kind "docker" with an image'),
    (lambda a: a["evaluators"][1].update(env="chess"), r"\$\.evaluators\[1\]\.env: 'chess' is not one of"),
    (lambda a: a["eval"]["math"].update(env="chess"), r"\$\.eval\.math\.env: 'chess' is not one of"),
    (lambda a: a.update(data={}), r"\$\.data: at least one dataset is needed"),
    (lambda a: a["scheduler"].update(batching="fastest"), r"\$\.scheduler\.batching: batching strategy 'fastest'"),
    (lambda a: a["scheduler"].update(batching="no_such_pkg.mod.fn"),
     r"\$\.scheduler\.batching: batching strategy 'no_such_pkg\.mod\.fn': no module named 'no_such_pkg'"),
])
def test_the_bounds_on_the_types_and_the_cross_field_rules_name_the_path(mutate, message):
    _refused(mutate, message, "x.yaml")


def _refused(mutate, message, source):
    """The local recipe changed by ``mutate`` is one RecipeError naming ``source`` and ``message``."""
    args = _local()
    mutate(args)
    with pytest.raises(RecipeError, match=f'^recipe "{re.escape(source)}": ' + message):
        parse_recipe(args, source=source)


def test_a_recipe_error_is_the_input_error_of_the_one_door():
    args = _local()
    args["engines"]["student"]["num_gpus"] = -1
    with pytest.raises(InputError) as info:
        parse_recipe(args, source="r.yaml")
    e = info.value
    assert (e.source, e.path) == ('recipe "r.yaml"', "$.engines.student.num_gpus")
    assert e.reason == "expected float >= 0 and <= 1024, got -1"
    assert str(e) == 'recipe "r.yaml": $.engines.student.num_gpus: expected float >= 0 and <= 1024, got -1'


def test_the_batching_strategy_is_resolved_at_parse_time():
    assert parse_recipe(LOCAL).scheduler.strategy is fifo_batching
    args = _local()
    args["scheduler"]["batching"] = "rayapp.core.batching:budget_batching"  # a plugin by dotted path
    assert parse_recipe(args).scheduler.strategy is budget_batching


def test_every_shipped_recipe_parses():
    for path in sorted((ROOT / "recipes").glob("*/rollout.yaml")):
        (app,) = yaml.safe_load(path.read_text())["applications"]
        parse_recipe(app["args"], source=str(path))


def test_the_wiring_copies_each_evaluator_field_by_name():
    args = _local()
    ev = args["evaluators"][0]
    ev |= {"batch_size": 5, "eval_timeout_s": 7.5, "eval_resource": {"cpu": 0.25, "memory_gb": 3},
           "default_stopping": {"max_turns": 2}, "default_sampling": {"top_p": 0.5}}
    engines = {"student": object()}

    async def not_called(*a, **kw):
        raise AssertionError("the wiring must not run or open anything")

    spec = build_evaluator_specs(parse_recipe(args), engines, executor=not_called, open_sandbox=not_called)[0]
    assert spec.evaluator_id == "arithmetic" and spec.handler.engine is engines["student"]
    assert (spec.batch_size, spec.eval_timeout_s) == (5, 7.5)
    assert spec.resource == Resource(gpu=0.75, concurrency=3, cpu=1.5, memory_gb=3)
    assert spec.run_resource == Resource(gpu=0.25, cpu=0.5, memory_gb=1)
    assert spec.eval_resource == Resource(cpu=0.25, memory_gb=3)
    assert spec.default_stopping == StoppingCriteria(max_turns=2)
    assert spec.default_sampling == SamplingParams(top_p=0.5)



@pytest.mark.parametrize(("mutate", "message"), [
    (lambda a: a["evaluators"][0].update(batch_size=0), r"\$\.evaluators\[0\]\.batch_size: expected int >= 1, got 0$"),
    (lambda a: a["evaluators"][0].update(batch_size=-1),
     r"\$\.evaluators\[0\]\.batch_size: expected int >= 1, got -1$"),
    (lambda a: a["evaluators"][0]["run_resource"].update(gpu=-1),
     r"\$\.evaluators\[0\]\.run_resource\.gpu: expected finite float >= 0, got -1$"),
    (lambda a: a["evaluators"][0].update(default_stopping={"timeout_s": -1}),
     r"\$\.evaluators\[0\]\.default_stopping\.timeout_s: expected float > 0 and <= 604800, got -1$"),
    (lambda a: a["evaluators"][0].update(sandbox={"wall_seconds": -1}),
     r"\$\.evaluators\[0\]\.sandbox\.wall_seconds: expected float > 0 and <= 604800, got -1$"),
    (lambda a: a["evaluators"][0].update(eval_timeout_s=float("inf")),
     r"\$\.evaluators\[0\]\.eval_timeout_s: expected float > 0 and <= 604800, got inf$"),
    (lambda a: a["engines"]["student"].update(num_replicas=0),
     ENGINE + r"num_replicas: expected int >= 1 and <= 1024, got 0$"),
    (lambda a: a["engines"]["student"].update(max_ongoing_requests=100_001),
     ENGINE + r"max_ongoing_requests: expected int >= 1 and <= 100000, got 100001$"),
    (lambda a: a["data"]["math"].update(seed=-1),
     r"\$\.data\.math\.seed: expected int >= 0 and <= 9223372036854775807, got -1$"),
    (lambda a: a["engines"]["student"].update(num_cpus=float("inf")),
     ENGINE + r"num_cpus: expected float >= 0 and <= 65536, got inf"),
    (lambda a: a["data"]["math"].update(dataset_cfg={"temprature": 0.5}),
     r'\$\.data\.math\.dataset_cfg: unknown key "temprature" \(did you mean \'temperature\'\? keys: max_turns, '),
    (lambda a: a["eval"]["math"].update(dataset_cfg={"max_turns": 0}),
     r"\$\.eval\.math\.dataset_cfg\.max_turns: expected int >= 1 and <= 1000000, got 0$"),
    (lambda a: a["data"]["math"].update(dataset_cfg={"top_k": 0}), r"\$\.data\.math\.dataset_cfg\.top_k: expected -1"),
    (lambda a: a["pool"].update(cluster_layout={"n": [10**5000]}),
     r'\$\.pool\.cluster_layout: cluster layout "<inline>": \$\.n\[0\]: expected int >= 0 and <= 65536, got a very '),
    (lambda a: a["pool"].update(cluster_layout='"[1,2]"'),
     r'\$\.pool\.cluster_layout: cluster layout "<inline>": \$: expected an object'),
])
def test_every_number_enum_and_dataset_key_is_checked_at_parse_time(mutate, message):
    _refused(mutate, message, "my/recipe.yaml")


def test_a_recipe_file_is_loaded_through_the_same_door_and_errors_name_it(tmp_path):
    good = ROOT / "recipes" / "local" / "rollout.yaml"
    args, cfg = load_recipe(good)
    assert args == LOCAL and cfg == parse_recipe(LOCAL)
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump({**_local(), "engines": {"student": {"backend": "vllm"}}}))
    with pytest.raises(RecipeError, match=rf'^recipe "{bare}": \$\.engines\.student\.backend: expected "hf"'):
        load_recipe(bare)
    served = tmp_path / "served.yaml"
    doc = yaml.safe_load(good.read_text())
    doc["applications"][0]["args"]["evaluators"][1]["batch_size"] = 0
    served.write_text(yaml.safe_dump(doc))
    with pytest.raises(RecipeError, match=rf'^recipe "{served}": \$\.applications\[0\]\.args\.evaluators\[1\]\.'
                                          r"batch_size: expected int >= 1, got 0$"):
        load_recipe(served)
    for text, reason in (("applications: [{name: x, import_path: a:b}]", r"\$\.applications: no application"),
                         ("[1, 2]", r"\$: expected an object"), ("a: [", "malformed YAML")):
        served.write_text(text)
        with pytest.raises(RecipeError, match=rf'^recipe "{served}": {reason}'):
            load_recipe(served)
    with pytest.raises(RecipeError, match=r'^recipe ".*missing\.yaml": cannot read file'):
        load_recipe(tmp_path / "missing.yaml")


def test_a_recipe_error_crosses_a_pickle_unchanged():
    e = RecipeError("r.yaml", "$.a", "bad")
    again = pickle.loads(pickle.dumps(e))
    assert (type(again), str(again), again.file) == (RecipeError, str(e), "r.yaml")


def test_a_layout_file_is_read_by_load_recipe_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "layout.json").write_text('{"n": [0, 0]}')
    args = _local()
    args["pool"]["cluster_layout"] = "layout.json"
    parse_recipe(args)  # the build may run where the pool's working directory is not
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(args))
    with pytest.raises(RecipeError, match=r'^recipe "r\.yaml": \$\.pool\.cluster_layout: cluster layout '
                                          r'"layout\.json": \$\.n\[1\]: duplicate GPU id 0$'):
        load_recipe("r.yaml")


def test_no_module_but_the_writer_touches_the_process_environment_where_stacx_variables_are_named():
    """The user-set STACX_* variables are read by ``recipe/environment.py`` from the mapping it is handed
    (the wiring hands it ``os.environ`` once, at the build); the code-set ones are written by
    ``steps/stacx_env.py`` alone. No other module reads the process's environment for them."""
    from pathlib import Path

    import rayapp

    names = re.compile(r"STACX_|ENV_T_MAX|ENV_EVAL_BETA|ENV_KNOBS|ENV_CONCURRENCY")
    touching = {str(p.relative_to(Path(rayapp.__file__).parent)) for p in Path(rayapp.__file__).parent.rglob("*.py")
                if re.search(r"os\.environ|getenv", (text := p.read_text())) and names.search(text)}
    assert touching == {"steps/stacx_env.py"}

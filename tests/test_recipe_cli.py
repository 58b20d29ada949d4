"""A broken recipe stops at the door, in a separate process as users meet it: `serve run` in the
import-path form (the builder runs in the `serve run` process) exits non-zero naming the file and the
JSON path, and `rayapp validate` checks a recipe offline. No Ray cluster is started: the builder
fails before `serve run` connects to one."""

import json
import os
import subprocess
import sys

import pytest
import yaml

from rayapp.cli import LOCAL_ENV, ROOT, _bin, free_port

GOOD = ROOT / "recipes" / "local" / "rollout.yaml"


def _broken(tmp_path):
    doc = yaml.safe_load(GOOD.read_text())
    doc["applications"][0]["args"]["engines"]["student"]["backend"] = "vllm"
    path = tmp_path / "my-recipe.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _env():
    return {**os.environ, **LOCAL_ENV, "PYTHONPATH": str(ROOT)}


def test_serve_run_of_a_broken_recipe_exits_non_zero_naming_the_file_and_path(tmp_path):
    recipe = _broken(tmp_path)
    # A port nobody listens on: were the builder to pass, serve run could not start a cluster of its own.
    cmd = [_bin("serve"), "run", f"--address=127.0.0.1:{free_port()}", "rayapp.actors.app:build_app",
           f"recipe={recipe}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env(), cwd=tmp_path)
    assert proc.returncode != 0
    assert (f'RecipeError: recipe "{recipe}": $.applications[0].args.engines.student.backend: '
            f'expected "hf" or "sglang", got "vllm"') in proc.stderr + proc.stdout


def test_rayapp_validate_prints_ok_or_the_error_with_exit_2(tmp_path):
    validate = [sys.executable, "-m", "rayapp.cli", "validate"]
    ok = subprocess.run([*validate, str(GOOD)], capture_output=True, text=True, timeout=120, env=_env())
    assert (ok.returncode, ok.stdout.strip()) == (0, f"{GOOD}: OK")
    recipe = _broken(tmp_path)
    bad = subprocess.run([*validate, str(recipe)], capture_output=True, text=True, timeout=120, env=_env())
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == (f'recipe "{recipe}": $.applications[0].args.engines.student.backend: '
                                  f'expected "hf" or "sglang", got "vllm"')


def test_the_demo_stops_at_a_broken_recipe_before_a_cluster_starts(tmp_path):
    recipe = _broken(tmp_path)
    temp_dir = tmp_path / "ray"
    proc = subprocess.run([sys.executable, "-m", "rayapp.cli", "demo", "--recipe", str(recipe),
                           "--temp-dir", str(temp_dir)], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2 and f'recipe "{recipe}": $.applications[0].args.engines' in proc.stderr
    assert not temp_dir.exists()  # no Ray session was started


# -- the command line in-process: validate, schema, init, run --------------------------------------

def _main(capsys, *argv):
    from rayapp.cli import main

    with pytest.raises(SystemExit) as done:
        main(list(argv))
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


def _serve_broken(tmp_path):
    """A recipe that parses but that Serve refuses: what only Serve's own schema can catch."""
    doc = yaml.safe_load(GOOD.read_text())
    doc["proxy_location"] = "Everywhere"
    doc["applications"][0]["deployments"] = [{"name": "manager", "num_replicas": 0}]
    path = tmp_path / "serve-broken.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_validate_checks_serves_own_schema_by_json_path(tmp_path, capsys):
    recipe = _serve_broken(tmp_path)
    code, out, err = _main(capsys, "validate", str(recipe))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert lines[0] == (f'recipe "{recipe}": $.proxy_location: Input should be '
                        "'Disabled', 'HeadOnly' or 'EveryNode'")
    # num_replicas is an int > 0 or "auto": one line for the path, the union's branches joined
    assert lines[1].startswith(f'recipe "{recipe}": $.applications[0].deployments[0].num_replicas: ')
    assert " or " in lines[1] and len(lines) == 2


def test_validate_reports_the_recipe_and_serve_problems_together(tmp_path, capsys):
    doc = yaml.safe_load(_serve_broken(tmp_path).read_text())
    doc["applications"][0]["args"]["scheduler"]["rollout_batch_size"] = 0
    path = tmp_path / "both.yaml"
    path.write_text(yaml.safe_dump(doc))
    code, _, err = _main(capsys, "validate", str(path))
    paths = [line.split(": ")[1] for line in err.strip().splitlines()]
    assert code == 2
    assert paths == ["$.applications[0].args.scheduler.rollout_batch_size", "$.proxy_location",
                     "$.applications[0].deployments[0].num_replicas"]


def test_validate_takes_a_shipped_recipe_by_name(capsys):
    from rayapp.cli import shipped_recipes

    names = shipped_recipes()
    assert {"local", "dagger_local", "swe_dagger", "grpo_sglang"} <= set(names)
    code, out, _ = _main(capsys, "validate", "local")
    assert code == 0 and out.strip().endswith("recipes/local/rollout.yaml: OK")
    code, _, err = _main(capsys, "validate", "no-such-recipe")
    assert code == 2 and err.strip() == 'recipe "no-such-recipe": cannot read file: No such file or directory'


def test_version_names_rayapp_and_ray(capsys):
    from importlib import metadata

    code, out, _ = _main(capsys, "--version")
    assert code == 0
    assert out.startswith(f"rayapp {metadata.version('rayapp')} (ray {metadata.version('ray')}, python ")


def test_schema_accepts_every_shipped_recipe_and_refuses_what_the_parser_refuses(capsys):
    jsonschema = pytest.importorskip("jsonschema")
    code, out, _ = _main(capsys, "schema")
    schema = json.loads(out)
    assert code == 0 and schema["$ref"] == "#/$defs/RecipeConfig"
    for path in sorted((ROOT / "recipes").glob("*/rollout.yaml")):
        jsonschema.validate(yaml.safe_load(path.read_text())["applications"][0]["args"], schema)
    args = yaml.safe_load(GOOD.read_text())["applications"][0]["args"]
    for section, key, bad in (("engines", "student", {"backend": "vllm"}),
                              ("scheduler", "rollout_batch_size", 0),
                              ("scheduler", "temprature", 0.5)):  # a misspelt key: unknown fields are refused
        broken = json.loads(json.dumps(args))
        target = broken[section][key] if isinstance(bad, dict) else broken[section]
        if isinstance(bad, dict):
            target.update(bad)
        else:
            target[key] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


def test_serve_config_schema_holds_the_rayapp_apps_args_to_the_recipe(capsys):
    jsonschema = pytest.importorskip("jsonschema")
    code, out, _ = _main(capsys, "schema", "--serve-config")
    schema = json.loads(out)
    assert code == 0
    for path in sorted((ROOT / "recipes").glob("*/rollout.yaml")):
        jsonschema.validate(yaml.safe_load(path.read_text()), schema)
    doc = yaml.safe_load(GOOD.read_text())
    doc["applications"][0]["args"]["engines"]["student"]["backend"] = "vllm"
    with pytest.raises(jsonschema.ValidationError) as e:
        jsonschema.validate(doc, schema)
    assert list(e.value.absolute_path)[:2] == ["applications", 0]
    # another application's args are its own business
    doc["applications"][0]["import_path"] = "other.module:app"
    jsonschema.validate(doc, schema)


def test_init_writes_a_recipe_that_validates_and_never_overwrites_unasked(tmp_path, capsys, monkeypatch):
    code, out, _ = _main(capsys, "init", str(tmp_path / "mine"))
    written = tmp_path / "mine" / "rollout.yaml"
    assert code == 0 and written.read_text() == GOOD.read_text() and f"wrote {written}" in out
    written.write_text("# edited\n" + GOOD.read_text())
    code, _, err = _main(capsys, "init", str(tmp_path / "mine"))
    assert code == 2 and "not overwriting" in err and written.read_text().startswith("# edited")
    code, _, _ = _main(capsys, "init", str(tmp_path / "mine"), "--force")
    assert code == 0 and written.read_text() == GOOD.read_text()
    # a recipe that names a layout file gets it, where its relative path resolves from that folder
    code, _, _ = _main(capsys, "init", str(tmp_path / "swe"), "--recipe", "swe_dagger")
    assert code == 0 and (tmp_path / "swe" / "cluster" / "layouts" / "swe_cluster.json").is_file()
    monkeypatch.chdir(tmp_path / "swe")
    assert _main(capsys, "validate", "rollout.yaml")[0] == 0
    code, _, err = _main(capsys, "init", str(tmp_path / "x"), "--recipe", "nope")
    assert code == 2 and "no shipped recipe 'nope'" in err and not (tmp_path / "x").exists()


def test_rayapp_run_of_a_broken_recipe_exits_within_seconds_before_a_cluster_starts(tmp_path):
    """`serve run <config file>` of a recipe whose build fails never exits (Ray's CLI logs the error and
    waits); `rayapp run` validates first and stops, starting nothing."""
    recipe = _broken(tmp_path)
    temp_dir = tmp_path / "ray"
    proc = subprocess.run([sys.executable, "-m", "rayapp.cli", "run", str(recipe), "--temp-dir", str(temp_dir),
                           "--", "--rollouts", "1"], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (f'recipe "{recipe}": $.applications[0].args.engines.student.backend: '
                                   f'expected "hf" or "sglang", got "vllm"')
    assert not temp_dir.exists()


def test_rayapp_run_hands_the_driver_its_options_and_returns_its_exit_status(tmp_path, monkeypatch, capsys):
    """The wiring of `run` without a cluster: the recipe, resolved by name, goes to serve run in the
    caller's folder; the driver gets the app's address, our step timeout, then the options after --
    (so they win); its exit status is run's."""
    import contextlib

    import rayapp.cli.launch as run_module

    seen = {}

    @contextlib.contextmanager
    def fake_local_app(recipe, temp_dir, log, **kw):
        seen.update(recipe=recipe, cwd=kw["cwd"], address=kw["address"], verbose=kw["verbose"], log=log)
        yield "127.0.0.1:6379", None

    class Done:
        returncode = 3

    def fake_run(cmd, timeout=None):
        seen["driver"] = cmd
        return Done()

    monkeypatch.setattr(run_module, "local_app", fake_local_app)
    monkeypatch.setattr(run_module.subprocess, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    code, out, _ = _main(capsys, "run", "local", "--timeout", "60", "--", "--rollouts", "2", "--timeout", "5")
    assert code == 3 and "local/rollout.yaml: OK" in out and "driver done" in out
    # the recipe deployed as validated: its dataset paths absolute against its folder
    from rayapp.recipe.load import recipe_document

    assert yaml.safe_load(seen["recipe"].read_text()) == recipe_document(GOOD)[0]
    assert seen["cwd"] == tmp_path and seen["address"] is None
    assert seen["driver"][1:] == [str(run_module.DRIVER), "--address=127.0.0.1:6379", "--timeout", "60.0",
                                  "--rollouts", "2", "--timeout", "5"]
    # quiet by default: Ray's and Serve's lines go to the run's log, whose path is said once
    assert seen["verbose"] is False
    assert f"logs: {seen['log']} (ray start, serve run" in out and "--verbose shows them here" in out
    code, out, _ = _main(capsys, "run", "local", "--verbose", "--", "--rollouts", "2")
    assert code == 3 and seen["verbose"] is True and "shown here too (--verbose)" in out
    assert seen["driver"][1:4] == [str(run_module.DRIVER), "--address=127.0.0.1:6379", "--verbose"]


def test_a_cluster_that_does_not_come_up_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """run and demo: the failure's own message on stderr, exit 1; --verbose keeps the traceback."""
    import contextlib

    import rayapp.cli.launch as run_module

    @contextlib.contextmanager
    def failing_local_app(recipe, temp_dir, log, **kw):
        raise RuntimeError(f"application rayapp is DEPLOY_FAILED: TypeError: bad factory\n(full log: {log})")
        yield

    monkeypatch.setattr(run_module, "local_app", failing_local_app)
    monkeypatch.chdir(tmp_path)
    code, _, err = _main(capsys, "run", "local")
    assert code == 1 and err.startswith("rayapp run: application rayapp is DEPLOY_FAILED: TypeError: bad factory")
    assert "Traceback" not in err
    with pytest.raises(RuntimeError, match="DEPLOY_FAILED"):
        from rayapp.cli import main

        main(["run", "local", "--verbose"])


def test_ray_start_s_output_goes_to_the_run_s_log_and_to_the_terminal_only_when_verbose(tmp_path, monkeypatch,
                                                                                        capfd):
    """``ray start`` stands in for itself: a script printing a banner (and failing, the second time)."""
    import rayapp.cli.local_cluster as local

    fake = tmp_path / "ray"
    fake.write_text("#!/bin/sh\necho 'Ray runtime started.'\necho 'a warning' >&2\nexit ${FAKE_RC:-0}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(local, "_bin", lambda name: str(fake))
    log = tmp_path / "run.log"
    for verbose in (False, True):
        with open(log, "w") as out:
            assert local.start_head(0, 1, tmp_path / "t", 1, out, verbose).startswith("127.0.0.1:")
        shown = capfd.readouterr()
        assert log.read_text() == "Ray runtime started.\na warning\n"
        assert shown.out == "" and shown.err == ("Ray runtime started.\na warning\n" if verbose else "")
    monkeypatch.setenv("FAKE_RC", "3")
    with open(log, "w") as out, pytest.raises(RuntimeError) as e:
        local.start_head(0, 1, tmp_path / "t", 1, out)
    assert str(e.value) == f"ray start exited with 3: a warning; its output: {log}"


def _with_agent(tmp_path, body):
    """The local recipe with its first evaluator's agent a plug-in in ``tmp_path`` (on sys.path)."""
    (tmp_path / "my_agents.py").write_text("from rayapp.envs.agents.chat import ChatAgent\n\n\n" + body)
    doc = yaml.safe_load(GOOD.read_text())
    doc["applications"][0]["args"]["evaluators"][0]["agent"] = "my_agents:make"
    path = tmp_path / "agent-recipe.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_validate_builds_each_agent_factory_and_names_the_field_of_one_that_fails(tmp_path, monkeypatch):
    from rayapp.cli.check import problems

    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = _with_agent(tmp_path, "def make(deps):\n    return ChatAgent(deps.engine)\n")
    assert problems(recipe) == [
        f'recipe "{recipe}": $.applications[0].args.evaluators[0].agent: agent \'my_agents:make\': building it '
        "with AgentDeps failed: TypeError: ChatAgent.__init__() missing 1 required positional argument: 'verify'"]
    # validate imports plug-ins in its watched child (cli/isolate.py), never into this process
    assert "my_agents" not in sys.modules
    recipe = _with_agent(tmp_path, "def make(deps):\n    return ChatAgent(deps.engine, deps.verify)\n")
    assert problems(recipe) == []


def test_a_failed_deployment_is_told_by_its_exceptions_own_line():
    from rayapp.cli.local_cluster import deploy_error

    message = ("Deploying app 'rayapp' failed with exception:\nTraceback (most recent call last):\n"
               '  File "wiring.py", line 48, in _evaluator_spec\n    raise RecipeError(...)\n'
               '\x1b[36mrayapp.recipe.config.RecipeError\x1b[39m: recipe "<args>": $.evaluators[0].agent: agent '
               "'my_agents:make': building it with AgentDeps failed: TypeError: ChatAgent.__init__() missing 1")
    assert deploy_error(message) == ('rayapp.recipe.config.RecipeError: recipe "<args>": $.evaluators[0].agent: '
                                     "agent 'my_agents:make': building it with AgentDeps failed: TypeError: "
                                     "ChatAgent.__init__() missing 1")
    assert deploy_error("The deployments ['Manager'] are UNHEALTHY.") == "The deployments ['Manager'] are UNHEALTHY."


def test_validate_makes_a_source_plug_ins_rows_and_names_the_field_when_they_fail(tmp_path, monkeypatch):
    from rayapp.cli.check import problems

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rows.py").write_text("def rows(cfg):\n    return [{'prompt': p} for p in cfg.prompts]\n")
    doc = yaml.safe_load(GOOD.read_text())
    doc["applications"][0]["args"]["data"]["mine"] = {"env": "arithmetic", "source": "my_rows:rows"}
    recipe = tmp_path / "source-recipe.yaml"
    recipe.write_text(yaml.safe_dump(doc))
    assert problems(recipe) == [
        f'recipe "{recipe}": $.applications[0].args.data.mine.source: data source \'my_rows:rows\': its rows '
        "failed: AttributeError: 'DatasetConfig' object has no attribute 'prompts'"]


class RunningServe:
    """A ``serve run`` process that has not exited."""

    def poll(self):
        return None


def scripted_status(monkeypatch, answers):
    """``wait_for_app``'s status probes answer ``answers`` in turn, and its pauses take no time."""
    import json
    import subprocess

    import rayapp.cli.local_cluster as local

    monkeypatch.setattr(local.subprocess, "run",
                        lambda *a, **k: subprocess.CompletedProcess(a, 0, json.dumps(next(answers)) + "\n", ""))
    monkeypatch.setattr(local.time, "sleep", lambda s: None)


def test_waiting_for_the_app_says_each_change_of_its_deployments_states(tmp_path, monkeypatch, capsys):
    """A deploy takes about a minute here: each new state of its deployments is one line, a repeat none."""

    import rayapp.cli.local_cluster as local

    answers = iter([["DEPLOYING", "", {"pool": "UPDATING", "manager": "UPDATING"}, 10.0],
                    ["DEPLOYING", "", {"pool": "HEALTHY", "manager": "UPDATING"}, 10.0],
                    ["DEPLOYING", "", {"pool": "HEALTHY", "manager": "UPDATING"}, 10.0],
                    ["RUNNING", "", {"pool": "HEALTHY", "manager": "HEALTHY"}, 10.0]])

    scripted_status(monkeypatch, answers)
    local.wait_for_app("127.0.0.1:1", "rayapp", 60, RunningServe(), tmp_path / "log")
    lines = [line.split(" (")[0] for line in capsys.readouterr().out.splitlines()]
    assert lines == ["  serve: manager updating, pool updating", "  serve: manager updating, pool healthy"]


def test_waiting_for_the_app_judges_the_deployment_just_submitted_not_the_old_one(tmp_path, monkeypatch, capsys):
    """``rayapp run --address`` onto a cluster already running an app of that name: the old deployment's
    RUNNING (deployed at 10.0, before the submit) is not the new one's, whose import fails (deployed at 20.0)."""

    import rayapp.cli.local_cluster as local

    failed = "Traceback (most recent call last):\n  ...\nModuleNotFoundError: No module named 'my_agents'"
    answers = iter([["RUNNING", "", {"pool": "HEALTHY", "manager": "HEALTHY"}, 10.0],
                    ["DEPLOYING", "", {"pool": "HEALTHY", "manager": "HEALTHY"}, 20.0],
                    ["DEPLOY_FAILED", failed, {"pool": "HEALTHY", "manager": "HEALTHY"}, 20.0]])

    scripted_status(monkeypatch, answers)
    with pytest.raises(RuntimeError) as e:
        local.wait_for_app("127.0.0.1:1", "rayapp", 60, RunningServe(), tmp_path / "log", deployed_before=10.0)
    assert str(e.value).startswith("application rayapp is DEPLOY_FAILED: ModuleNotFoundError: No module named "
                                   "'my_agents'"), e.value
    assert "(the deployment before this one): waiting for the new one" in capsys.readouterr().out

"""A broken recipe stops at the door, in a separate process as users meet it: `serve run` in the
import-path form (the builder runs in the `serve run` process) exits non-zero naming the file and the
JSON path, and `rayapp validate` checks a recipe offline. No Ray cluster is started: the builder
fails before `serve run` connects to one."""

import os
import subprocess
import sys

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

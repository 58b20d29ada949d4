"""``rayapp verify``: each dataset's rows through its verifier with the reference answers (or given
responses), offline; a verifier that scores its own references 0 is reported and fails the command."""

import importlib
import itertools
import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from rayapp.cli import ROOT
from rayapp.cli.verify import verify

_names = itertools.count()
PLUGIN = """
from rayapp.envs.arithmetic import extract_answer

def good(sample, result):
    return {"score": 1.0 if extract_answer(result.response) == str(sample.label) else 0.0}

def broken(sample, result):  # compares with the prompt, not the label: never right
    return {"score": 1.0 if result.response == sample.prompt else 0.0}

async def raises(sample, result):
    raise KeyError("answer")
"""


def squash(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def plug(tmp_path, monkeypatch):
    name = f"verify_plug_{next(_names)}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    return name


def write_recipe(tmp_path, verifier=None):
    ev = {"evaluator_id": "arithmetic", "env": "arithmetic", **({"verifier": verifier} if verifier else {})}
    args = {"engines": {"student": {}}, "evaluators": [ev, {"evaluator_id": "swe", "env": "swe"}],
            "data": {"arith": {"env": "arithmetic", "n_prompts": 5}},
            "eval": {"arith-e": {"env": "arithmetic", "seed": 3, "n_prompts": 3}, "swe": {"env": "swe"}}}
    path = tmp_path / "rollout.yaml"
    path.write_text(yaml.safe_dump(args))
    return path


def test_a_good_verifier_scores_1_on_its_references(tmp_path, plug, capsys):
    assert verify(write_recipe(tmp_path, f"{plug}:good")) == 0
    out = squash(capsys.readouterr().out)
    assert "data/arith 5 rows: mean score 1.000, 5 scored > 0" in out
    assert "eval/arith-e 3 rows: mean score 1.000, 3 scored > 0" in out
    assert "eval/swe skipped: env 'swe' verifies inside the episode's sandbox" in out


def test_a_broken_verifier_is_reported_and_fails_the_command(tmp_path, plug, capsys):
    assert verify(write_recipe(tmp_path, f"{plug}:broken")) == 1
    out, err = map(squash, capsys.readouterr())
    assert "data/arith 5 rows: mean score 0.000, 0 scored > 0" in out
    assert "BROKEN: the reference answers of data/arith, eval/arith-e score 0" in err


def test_a_verifier_that_raises_is_named_with_its_error(tmp_path, plug, capsys):
    assert verify(write_recipe(tmp_path, f"{plug}:raises"), dataset="arith-e") == 1
    out = squash(capsys.readouterr().out)
    assert "3 raised, the first: arithmetic-3-0: KeyError: 'answer'" in out and "data/arith" not in out


def test_given_responses_are_scored_instead_and_an_unknown_dataset_is_refused(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    from rayapp.envs.arithmetic import ArithmeticSource

    tasks = ArithmeticSource(3).take(3)
    lines = [{"task_id": tasks[0].task_id, "response": f"The answer is {tasks[0].label}."},
             {"task_id": tasks[1].task_id, "response": "The answer is 1e9."}]
    responses = tmp_path / "r.jsonl"
    responses.write_text("\n".join(json.dumps(x) for x in lines))
    assert verify(recipe, dataset="eval/arith-e", responses=str(responses)) == 0  # wrong answers are no bug
    assert "eval/arith-e 2 rows: mean score 0.500, 1 scored > 0" in squash(capsys.readouterr().out)
    assert verify(recipe, dataset="nope") == 2
    assert "no dataset 'nope'" in capsys.readouterr().err
    responses.write_text('{"response": "x"}\n')
    assert verify(recipe, responses=str(responses)) == 2
    assert "line 1" in capsys.readouterr().err


def test_the_command_checks_the_demo_recipe_without_starting_ray(tmp_path):
    code = ("import sys; from rayapp.cli import main\n"
            "try:\n    main(['verify', 'local', '--limit', '4'])\n"
            "except SystemExit as e:\n    print('exit', e.code, 'ray' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.stdout.strip().endswith("exit 0 False"), proc.stdout + proc.stderr  # no Ray imported at all
    assert "eval/arith-a 2 rows: mean score 1.000" in squash(proc.stdout)


def _verify_example(*pythonpath):
    env = {**os.environ, "PYTHONPATH": ":".join([str(ROOT), *map(str, pythonpath)])}
    return subprocess.run([sys.executable, "-m", "rayapp.cli", "verify", "examples/wordplay"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)


def test_the_wordplay_example_verifies_by_its_folder_as_its_readme_says():
    """``PYTHONPATH=examples/wordplay rayapp verify examples/wordplay``: the folder's rollout.yaml, its env
    found as the recipe names it (``wordplay:ENV``), every reference answer scored 1."""
    proc = _verify_example(ROOT / "examples" / "wordplay")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = squash(proc.stdout)
    assert out.startswith("examples/wordplay/rollout.yaml: verifiers scored with each row's reference answer")
    assert "data/words 16 rows: mean score 1.000, 16 scored > 0 (env wordplay:ENV" in out
    assert "eval/words 4 rows: mean score 1.000, 4 scored > 0" in out


def test_a_project_folder_shadowing_the_env_s_package_is_named_with_the_folder_to_use():
    """With ``examples`` on the path, ``import wordplay`` finds the project folder examples/wordplay (no
    __init__.py: an empty namespace package) before the package inside it: the error says so."""
    proc = _verify_example(ROOT / "examples")
    assert proc.returncode == 2 and proc.stdout == ""
    inner = ROOT / "examples" / "wordplay"
    assert squash(proc.stderr) == squash(
        f"""recipe "examples/wordplay/rollout.yaml": $.applications[0].args.evaluators[0].env: env 'wordplay:ENV':
        module 'wordplay' has no attribute 'ENV': 'wordplay' was imported from {inner}, a folder without
        __init__.py (an empty namespace package), not the package; the package is inside it: put {inner} on
        PYTHONPATH, not its parent (or pip install it)""")

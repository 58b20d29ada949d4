"""``rayapp try``: a recipe's steps in one process without Ray (rayapp/cli/try_recipe.py, docs/try.md).

Each run is a child process started through the CLI's entry, which then says whether ``ray`` was
ever imported in it; recipes are cut down from shipped ones so that a run takes seconds."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayapp.cli import build_parser
from rayapp.cli.check import findings
from rayapp.cli.try_recipe import LocalEngine, flag_problem, runs
from rayapp.core.termination import AgentTimeout

ROOT = Path(__file__).resolve().parents[1]
# The CLI's entry, then whether this process ever imported ray, on the last line of stdout.
ENTRY = """import sys
from rayapp.cli import main
try:
    main(sys.argv[1:])
    code = 0
except SystemExit as e:
    code = e.code
print("ray imported:", "ray" in sys.modules)
sys.exit(code)
"""


def rayapp_try(*args, paths=(), cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *map(str, paths)])}
    proc = subprocess.run([sys.executable, "-c", ENTRY, "try", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)
    assert proc.stdout.rstrip().endswith("ray imported: False"), proc.stdout + proc.stderr
    return proc


def cut_down(shipped, tmp_path, evaluators, batch=2, group=None):
    """A shipped recipe's Serve config with only ``evaluators`` (and their datasets), ``batch`` groups a step
    (of ``group`` samples each, when given)."""
    doc = yaml.safe_load((ROOT / shipped).read_text())
    args = doc["applications"][0]["args"]
    args["evaluators"] = [e for e in args["evaluators"] if e["evaluator_id"] in evaluators]
    for where in ("data", "eval"):
        args[where] = {k: d for k, d in args.get(where, {}).items() if d["env"] in evaluators}
    for d in args["data"].values():
        d.update({"n_samples_per_prompt": group} if group else {})
    args["scheduler"].update(rollout_batch_size=batch, save_eval_details=None)
    path = tmp_path / "rollout.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def samples(path, kind="rollouts"):
    found = json.loads(Path(path).read_text())[kind]
    if kind == "rollouts":
        return [s for step in found for group in step["groups"] for s in group]
    return [s for step in found for group in step["samples"].values() for s in group]


def check_trainable(s):
    assert s["status"] == "completed", s
    assert s["response_length"] > 0 and len(s["tokens"]) > s["response_length"]
    assert len(s["loss_mask"]) == len(s["rollout_log_probs"]) == s["response_length"]
    assert all(lp <= 0 for lp in s["rollout_log_probs"]) and "score" in s["reward"]


def test_the_local_recipe_prints_trainable_samples_without_importing_ray(tmp_path):
    recipe = cut_down("recipes/local/rollout.yaml", tmp_path, {"arithmetic"})
    out = tmp_path / "steps.json"
    proc = rayapp_try(recipe, "--rollouts", 2, "--eval", "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert "== rollout 0: 2 groups" in proc.stdout and "== rollout 1: 2 groups" in proc.stdout
    assert "== eval 1:" in proc.stdout and "loss mask" in proc.stdout and "log-probs" in proc.stdout
    rows = samples(out)
    assert len(rows) == 8  # 2 steps x 2 groups x n_samples_per_prompt 2
    for s in rows:
        check_trainable(s)
        # the table's line for this sample: its token count and mask as runs
        assert any(f" {len(s['tokens']):>6} " in line and runs(s["loss_mask"]) in line
                   for line in proc.stdout.splitlines() if line.lstrip().startswith(s["task_id"]))
    assert {s["metadata"]["_dataset_name"] for s in samples(out, "evals")} == {"arith-a", "arith-cut"}


def test_the_wordplay_example_runs_its_plugins_by_import_path(tmp_path):
    out = tmp_path / "steps.json"
    proc = rayapp_try(ROOT / "examples/wordplay", "--eval", "--json", out, paths=[ROOT / "examples/wordplay"],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = samples(out)
    assert len(rows) == 8 and {s["task_id"] for s in rows} <= {f"w{i:02}" for i in range(20)}
    for s in rows:
        check_trainable(s)
        assert set(s["reward"]) == {"score", "mentions"}  # the plug-in verifier's rewards, not the env's
    assert len(samples(out, "evals")) == 8


def test_a_gateway_recipe_runs_its_openai_agent_over_a_loopback_gateway(tmp_path):
    recipe = cut_down("recipes/train_grpo/gateway.yaml", tmp_path, {"math"}, batch=1, group=2)
    out = tmp_path / "steps.json"
    proc = rayapp_try(recipe, "--json", out, paths=[ROOT / "examples/openai_agent"])
    assert proc.returncode == 0, proc.stderr
    rows = samples(out)
    assert len(rows) == 2
    for s in rows:
        check_trainable(s)
        assert s["metadata"]["_turns"] >= 1  # the agent's calls through its episode's gateway URL, recorded


def test_a_bad_recipe_is_the_line_validate_prints(tmp_path):
    recipe = cut_down("recipes/local/rollout.yaml", tmp_path, {"arithmetic"})
    doc = yaml.safe_load(recipe.read_text())
    doc["applications"][0]["args"]["evaluators"][0]["engine"] = "teacher"
    recipe.write_text(yaml.safe_dump(doc))
    proc = rayapp_try(recipe)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == findings(recipe)[0][:1]
    assert "$.applications[0].args.evaluators[0].engine" in proc.stderr


def test_an_sglang_engine_is_one_error_naming_its_backend():
    proc = rayapp_try("grpo_sglang")
    assert proc.returncode == 2 and proc.stdout.startswith("ray imported: False")
    line, = proc.stderr.strip().splitlines()
    assert ".args.engines." in line and ".backend: 'sglang': rayapp try runs hf engines only" in line


def test_an_hf_engine_that_cannot_start_is_one_line_naming_its_options(tmp_path):
    recipe = cut_down("recipes/local/rollout.yaml", tmp_path, {"arithmetic"})
    doc = yaml.safe_load(recipe.read_text())
    broken = tmp_path / "broken-model"  # a model folder validate finds, whose files no model loads from
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    doc["applications"][0]["args"]["engines"]["student"]["options"]["model_path"] = str(broken)
    recipe.write_text(yaml.safe_dump(doc))
    proc = rayapp_try(recipe)
    assert proc.returncode == 2
    line, = proc.stderr.strip().splitlines()
    assert line.startswith(f'recipe "{recipe}": $.applications[0].args.engines.student.options: the hf backend '
                           "could not start: ")


def test_the_loss_mask_shows_as_runs():
    assert runs([1, 1, 1, 0, 0, 1]) == "1x3 0x2 1x1"
    assert runs([]) == "-"


class SlowBackend:
    """Answers after ``delay_s``: an engine that is slower than its request_timeout_s."""

    def __init__(self, delay_s):
        self.delay_s = delay_s

    async def generate(self, req):
        await asyncio.sleep(self.delay_s)
        return "late"


def test_an_engine_call_past_its_timeout_is_an_agent_timeout_naming_the_engine():
    async def call():
        return await LocalEngine(SlowBackend(30), "student", timeout_s=0.05).generate(None)

    with pytest.raises(AgentTimeout, match=r"engine student\.generate gave no answer within 0\.05s"):
        asyncio.run(call())


@pytest.mark.parametrize(("flags", "said"), [
    (["--rollouts", "0"], "--rollouts 0: expected at least 1"),
    (["--timeout", "-1"], "--timeout -1: expected a positive number of seconds"),
    (["--timeout", "inf"], "--timeout inf: expected a positive number of seconds"),
    (["--num-gpus", "-2"], "--num-gpus -2: expected 0 or more"),
    (["--num-cpus", "nan"], "--num-cpus nan: expected 0 or more"),
    (["--json", "/no/such/folder/steps.json"], "--json /no/such/folder/steps.json: its folder does not exist"),
])
def test_a_flag_out_of_range_is_one_line_naming_it(flags, said):
    assert flag_problem(build_parser().parse_args(["try", "local", *flags])) == said

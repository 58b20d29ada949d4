"""What `rayapp validate` once accepted and the app then failed on or mishandled (issue 32, points 11
and 13): each refused with one line naming the field, or, where the run time only warns, warned of."""

import copy
import inspect

import pytest
import yaml

from rayapp.cli import ROOT
from rayapp.recipe import RecipeError, parse_recipe

GOOD = ROOT / "recipes" / "local" / "rollout.yaml"
ARGS = yaml.safe_load(GOOD.read_text())["applications"][0]["args"]


def _args(**changes):
    """The local recipe's args with ``changes`` ("engines.student.options.dtype": value) applied."""
    args = copy.deepcopy(ARGS)
    for dotted, value in changes.items():
        node, *keys = args, *dotted.split(".")
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[keys[-1]] = value
    return args


@pytest.mark.parametrize(("change", "path", "reason"), [
    ({"engines.student.options.max_concurrency": 0}, "$.engines.student.options.max_concurrency", "expected int >= 1"),
    ({"engines.student.options.max_concurrency": -4}, "$.engines.student.options.max_concurrency", "got -4"),
    ({"engines.student.options.max_concurrency": "four"}, "$.engines.student.options.max_concurrency",
     'expected int, got "four"'),
    ({"engines.student.options.num_threads": -1}, "$.engines.student.options.num_threads", "expected int >= 1"),
    ({"engines.student.options.prefix_cache": -1}, "$.engines.student.options.prefix_cache", "expected int >= 0"),
    ({"engines.student.options.dtype": "float99"}, "$.engines.student.options.dtype", 'got "float99"'),
    ({"engines.student.options.device": "gpu7"}, "$.engines.student.options.device", "expected str matching"),
    ({"engines.student.options.device": "cuda:7"}, "$.engines.student.options.device",
     "needs a GPU, but the replica reserves none (engines.student.num_gpus is 0)"),
    ({"engines.student.options.device": "cuda:7", "engines.student.num_gpus": 1},
     "$.engines.student.options.device", "a replica sees only the GPUs Ray reserves for it, numbered from 0"),
    ({"evaluators.1.evaluator_id": "arithmetic"}, "$.evaluators[1].evaluator_id",
     "'arithmetic' is evaluators[0]'s too"),
    ({"scheduler.rollout_batch_size": 10**6}, "$.scheduler.rollout_batch_size", "a typo, not a plan"),
    ({"scheduler.n_samples_per_eval_prompt": 10**6}, "$.scheduler.n_samples_per_eval_prompt", "a typo, not a plan"),
    ({"evaluators.0.run_resource": {"gpu": 1.5}}, "$.evaluators[0].run_resource.gpu",
     "above 1 it must be a whole number of GPUs"),
    ({"scheduler.eval_details_tokens": True, "scheduler.save_eval_details": None},
     "$.scheduler.eval_details_tokens", "needs scheduler.save_eval_details"),
])
def test_what_the_app_would_fail_on_is_refused_naming_the_field(change, path, reason):
    with pytest.raises(RecipeError) as info:
        parse_recipe(_args(**change))
    assert info.value.path == path and reason in info.value.reason, (info.value.path, info.value.reason)


def test_a_device_the_replica_reserves_passes():
    parse_recipe(_args(**{"engines.student.options.device": "cuda:1", "engines.student.num_gpus": 2}))
    parse_recipe(_args(**{"engines.student.options.max_concurrency": 1, "engines.student.options.prefix_cache": 0}))


def test_the_hf_options_hold_the_backends_own_names_and_defaults():
    from rayapp.inference.hf import _DTYPES, HFBackend
    from rayapp.recipe.runnable import HFOptions

    params = list(inspect.signature(HFBackend.__init__).parameters.values())[1:]
    assert {p.name: p.default for p in params} == {f: getattr(HFOptions(), f) for f in HFOptions.__struct_fields__}
    for dtype in _DTYPES:
        parse_recipe(_args(**{"engines.student.options.dtype": dtype}))


def _recipe(tmp_path, change=None, serve=None):
    doc = yaml.safe_load(GOOD.read_text())
    doc["applications"][0]["args"] = _args(**(change or {}))
    doc |= serve or {}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_validate_refuses_a_port_serve_could_never_bind(tmp_path):
    from rayapp.cli.check import problems

    recipe = _recipe(tmp_path, serve={"http_options": {"host": "127.0.0.1", "port": -1}})
    assert problems(recipe) == [f'recipe "{recipe}": $.http_options.port: expected a port in 1 .. 65535, got -1']


@pytest.mark.parametrize(("body", "reason"), [
    ("def rows(cfg):\n    return []\n", "data source 'my_rows:rows': its rows(cfg) made no rows"),
    ("def rows(cfg):\n    return [{'prompt': '1+1', 'label': '2'}]\n",
     "data source 'my_rows:rows': its rows(cfg) made row 0 a dict, not a rayapp Task"),
])
def test_validate_refuses_a_source_whose_rows_are_not_tasks(tmp_path, monkeypatch, body, reason):
    from rayapp.cli.check import problems

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rows.py").write_text(body)
    recipe = _recipe(tmp_path, {"data.mine": {"env": "arithmetic", "source": "my_rows:rows"}})
    assert problems(recipe) == [f'recipe "{recipe}": $.applications[0].args.data.mine.source: {reason}']


def test_validate_calls_a_verifier_plug_in_once_and_refuses_a_float(tmp_path, monkeypatch, capsys):
    from rayapp.cli.check import problems, validate

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_verify.py").write_text("def score(sample, result):\n    return 1.0\n\n\n"
                                           "def good(sample, result):\n    return {'score': 1.0}\n")
    recipe = _recipe(tmp_path, {"evaluators.0.verifier": "my_verify:score"})
    [line] = problems(recipe)
    assert line.startswith(f'recipe "{recipe}": $.applications[0].args.evaluators[0].verifier: on row ')
    assert "handler.evaluate returned 1.0, not a dict with a 'score'; every sample would abort infra_other" in line
    recipe = _recipe(tmp_path, {"evaluators.0.verifier": "my_verify:good"})
    assert validate(recipe) == 0


def test_validate_warns_of_rows_no_evaluator_runs_and_still_passes(tmp_path, capsys):
    from rayapp.cli.check import validate

    recipe = _recipe(tmp_path, {"data.arithmetic.task_type": "nope"})
    assert validate(recipe) == 0
    err = capsys.readouterr().err
    assert (f'recipe "{recipe}": $.applications[0].args.data.arithmetic.task_type: warning: rows of '
            "data.arithmetic name evaluator 'nope', which is not one of ['arithmetic', 'math', 'humaneval', "
            "'swe']: they would run on the first, 'arithmetic'") in err


def test_the_hf_backend_refuses_a_cuda_device_this_process_lacks_before_loading_the_model():
    from rayapp.inference.hf import HFBackend

    with pytest.raises(ValueError, match=r"device 'cuda:999': this process sees \d+ CUDA device\(s\)"):
        HFBackend(model_path="/nonexistent", device="cuda:999")  # refused before the model path is looked at

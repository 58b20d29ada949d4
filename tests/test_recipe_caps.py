"""Sizes, counts and timeouts of 10^9 in a recipe (issue 32, point 13): each once passed `rayapp
validate` and only limited (or overflowed) at run time; each is now refused by the recipe loader with
one error naming the file, the field's JSON path and its bound. Where "no limit" is meant, the field
is left unset."""

import copy

import pytest
import yaml

from rayapp.cli import ROOT
from rayapp.recipe import RecipeError, load_recipe

LOCAL = ROOT / "recipes" / "local" / "rollout.yaml"
HUGE = 10**9
IN_FILE = "$.applications[0].args"  # where a Serve config file holds the recipe

# (where the field is set, as a dotted path into the args; the JSON path the error names; its bound)
CAPPED = [
    ("engines.student.max_ongoing_requests", "$.engines.student.max_ongoing_requests", "100000"),
    ("engines.student.request_timeout_s", "$.engines.student.request_timeout_s", "604800"),
    ("engines.student.options.max_concurrency", "$.engines.student.options.max_concurrency", "100000"),
    ("engines.student.options.steps_per_call", "$.engines.student.options.steps_per_call", "10000000"),
    ("engines.student.options.prefix_cache", "$.engines.student.options.prefix_cache", "100000"),
    ("pool.pg_ready_timeout_s", "$.pool.pg_ready_timeout_s", "604800"),
    ("evaluators.0.resource.concurrency", "$.evaluators[0].resource.concurrency", "100000"),
    ("evaluators.0.run_resource.concurrency", "$.evaluators[0].run_resource.concurrency", "100000"),
    ("evaluators.0.batch_size", "$.evaluators[0].batch_size", "1000000"),
    ("evaluators.0.eval_timeout_s", "$.evaluators[0].eval_timeout_s", "604800"),
    ("evaluators.0.sandbox.wall_seconds", "$.evaluators[0].sandbox.wall_seconds", "604800"),
    ("evaluators.0.sandbox.cpu_seconds", "$.evaluators[0].sandbox.cpu_seconds", "604800"),
    ("evaluators.0.default_stopping.max_turns", "$.evaluators[0].default_stopping.max_turns", "1000000"),
    ("evaluators.0.default_stopping.max_context_len", "$.evaluators[0].default_stopping.max_context_len",
     "10000000"),
    ("evaluators.0.default_stopping.timeout_s", "$.evaluators[0].default_stopping.timeout_s", "604800"),
    ("evaluators.0.default_sampling.max_new_tokens", "$.evaluators[0].default_sampling.max_new_tokens",
     "10000000"),
    ("evaluators.0.default_sampling.top_k", "$.evaluators[0].default_sampling.top_k", "10000000"),
    ("evaluators.0.gateway.command_timeout_s", "$.evaluators[0].gateway.command_timeout_s", "604800"),
    ("scheduler.rollout_batch_size", "$.scheduler.rollout_batch_size", "1000000"),
    ("scheduler.n_samples_per_eval_prompt", "$.scheduler.n_samples_per_eval_prompt", "1000000"),
    ("scheduler.acquire_timeout_s", "$.scheduler.acquire_timeout_s", "604800"),
    ("scheduler.global_stopping.max_turns", "$.scheduler.global_stopping.max_turns", "1000000"),
    ("scheduler.global_stopping.max_context_len", "$.scheduler.global_stopping.max_context_len", "10000000"),
    ("scheduler.global_stopping.timeout_s", "$.scheduler.global_stopping.timeout_s", "604800"),
    ("scheduler.global_sampling.max_new_tokens", "$.scheduler.global_sampling.max_new_tokens", "10000000"),
    ("scheduler.partial.max_staleness", "$.scheduler.partial.max_staleness", "1000000"),
    ("data.math.n_samples_per_prompt", "$.data.math.n_samples_per_prompt", "1000000"),
    ("data.math.weight", "$.data.math.weight", "1000000"),
    ("data.math.dataset_cfg.max_new_tokens", "$.data.math.dataset_cfg.max_new_tokens", "10000000"),
    ("eval.math.dataset_cfg.timeout_s", "$.eval.math.dataset_cfg.timeout_s", "604800"),
    ("dagger.decay_iters", "$.dagger.decay_iters", "1000000"),
    ("dagger.step_size", "$.dagger.step_size", "1000000"),
    ("dagger.t_max_start", "$.dagger.t_max_start", "1000000"),
]


def _with(dotted: str, value) -> dict:
    """The local recipe file's document with the field at ``dotted`` (in the app's args) set to ``value``,
    the sections on the way made where the local recipe has none (a gateway agent needs its command)."""
    doc = yaml.safe_load(LOCAL.read_text())
    node, *keys = doc["applications"][0]["args"], *dotted.split(".")
    for key in keys[:-1]:
        if isinstance(node, list):
            node = node[int(key)]
            continue
        if node.get(key) is None:
            node[key] = {"command": ["true"]} if key == "gateway" else {}
        node = node[key]
    node[keys[-1]] = copy.deepcopy(value)
    return doc


@pytest.mark.parametrize(("dotted", "path", "bound"), CAPPED, ids=[c[0] for c in CAPPED])
def test_a_size_count_or_timeout_of_ten_to_the_ninth_is_refused_naming_the_path_and_the_bound(tmp_path, dotted,
                                                                                           path, bound):
    recipe = tmp_path / "rollout.yaml"
    recipe.write_text(yaml.safe_dump(_with(dotted, HUGE)))
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe)
    assert e.value.path == IN_FILE + path[1:], str(e.value)
    assert str(e.value).startswith(f'recipe "{recipe}": {IN_FILE}{path[1:]}: '), str(e.value)
    assert bound in e.value.reason and "1000000000" in e.value.reason, e.value.reason


@pytest.mark.parametrize(("dotted", "path", "bound"), CAPPED, ids=[c[0] for c in CAPPED])
def test_the_bound_itself_is_not_refused_for_that_field(tmp_path, dotted, path, bound):
    """The bound is the most a field takes, not one past it: a refusal names another field, or a rule
    spanning fields (a step of 10^6 groups of 2 samples is too large, though 10^6 groups alone is not)."""
    recipe = tmp_path / "rollout.yaml"
    recipe.write_text(yaml.safe_dump(_with(dotted, int(bound))))
    try:
        load_recipe(recipe)
    except RecipeError as e:
        assert e.path != IN_FILE + path[1:] or f"<= {bound}" not in e.reason, str(e)

"""Recipes: the typed ``args`` of a Serve config (``config``) and the pure wiring that turns one
into evaluators, datasets, a scheduler and a step runner (``wiring``); ``load`` reads one from its
file, ``environment`` the user-set variables that configure a run. No Ray here: the Ray shell
(``rayapp.actors``) hands in its engine clients, pool client and bundle executors."""

from rayapp.recipe.config import (
    ARGS_SOURCE,
    DatasetConfig,
    EngineConfig,
    EvaluatorConfig,
    FiltersConfig,
    PoolConfig,
    RecipeConfig,
    RecipeError,
    SandboxConfig,
    SchedulerSection,
    check_live_gpus,
    check_recipe,
    parse_recipe,
)
from rayapp.recipe.environment import ENV_KNOBS, apply_env
from rayapp.recipe.load import load_recipe
from rayapp.recipe.wiring import (
    build_data_source,
    build_eval_sets,
    build_evaluator_specs,
    build_scheduler,
    build_step_runner,
)

__all__ = [
    "ARGS_SOURCE",
    "ENV_KNOBS",
    "DatasetConfig",
    "EngineConfig",
    "EvaluatorConfig",
    "FiltersConfig",
    "PoolConfig",
    "RecipeConfig",
    "RecipeError",
    "SandboxConfig",
    "SchedulerSection",
    "apply_env",
    "build_data_source",
    "build_eval_sets",
    "build_evaluator_specs",
    "build_scheduler",
    "build_step_runner",
    "check_live_gpus",
    "check_recipe",
    "load_recipe",
    "parse_recipe",
]

"""A recipe: the ``args`` of the rayapp application in a Serve config (``rollout.yaml``).

Validated whole with msgspec before anything starts; one error names the file (when known) and the
JSON path, and nothing is deployed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rayapp.types import Resource, SamplingParams, StoppingCriteria


class RecipeError(ValueError):
    pass


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class EngineConfig(_Strict):
    """One inference deployment. ``options`` go to the backend (``make_backend(backend, **options)``)."""

    backend: str = "hf"
    num_replicas: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 64
    request_timeout_s: float = 300.0
    options: dict[str, Any] = {}
    # For engines spanning several GPUs (tensor parallel): the replica reserves them as one group.
    placement_group_bundles: list[dict[str, float]] | None = None
    placement_group_strategy: str = "STRICT_PACK"


class PoolConfig(_Strict):
    """The placement pool: the layout (inline JSON, a file, or None to read the live cluster),
    the shorthand's defaults, and whether batches are gated at all."""

    gate: bool = True
    cluster_layout: str | dict[str, Any] | None = None  # --env-cluster-layout
    num_cpus: float | None = None  # --env-num-cpus
    memory_gb: float | None = None  # --env-memory-gb
    pg_ready_timeout_s: float = 10.0


class EvaluatorConfig(_Strict):
    evaluator_id: str
    env: str = "arithmetic"
    engine: str = "student"
    resource: Resource = Resource()
    run_resource: Resource = Resource()
    eval_resource: Resource = Resource()
    batch_size: int | None = None
    default_stopping: StoppingCriteria = StoppingCriteria()
    default_sampling: SamplingParams = SamplingParams()
    eval_timeout_s: float = 300.0


class DatasetConfig(_Strict):
    """A data source: an env's built-in generator; ``dataset_cfg`` is the cascade's third level."""

    env: str = "arithmetic"
    task_type: str | None = None  # names the evaluator; defaults to the env's name
    seed: int = 0
    n_prompts: int = 8  # eval datasets only
    n_samples_per_prompt: int = 1
    dataset_cfg: dict[str, Any] = {}


class SchedulerConfig(_Strict):
    rollout_batch_size: int = 8
    batching: str = "fifo"
    n_samples_per_eval_prompt: int = 1
    global_stopping: StoppingCriteria = StoppingCriteria()
    global_sampling: SamplingParams = SamplingParams()
    acquire_timeout_s: float = 3600.0
    progress: bool = True


class RecipeConfig(_Strict):
    engines: dict[str, EngineConfig]
    evaluators: list[EvaluatorConfig]
    data: DatasetConfig = DatasetConfig()
    eval: dict[str, DatasetConfig] = {}
    pool: PoolConfig = PoolConfig()
    scheduler: SchedulerConfig = SchedulerConfig()


def parse_recipe(args: dict[str, Any], source: str = "rollout.yaml") -> RecipeConfig:
    try:
        recipe = msgspec.convert(args, RecipeConfig)
    except msgspec.ValidationError as e:
        raise RecipeError(f'recipe "{source}": {e}') from None
    if not recipe.engines:
        raise RecipeError(f'recipe "{source}": $.engines: at least one engine is needed')
    for i, ev in enumerate(recipe.evaluators):
        if ev.engine not in recipe.engines:
            raise RecipeError(f'recipe "{source}": $.evaluators[{i}].engine: {ev.engine!r} is not one of '
                              f"{sorted(recipe.engines)}")
    if not recipe.evaluators:
        raise RecipeError(f'recipe "{source}": $.evaluators: at least one evaluator is needed')
    return recipe

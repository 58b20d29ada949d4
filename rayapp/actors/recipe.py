"""A recipe: the ``args`` of the rayapp application in a Serve config (``rollout.yaml``).

Validated whole with msgspec before anything starts; one error names the file (when known) and the
JSON path, and nothing is deployed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from rayapp.training.dagger import DAggerSchedule
from rayapp.training.filters import AbortCap, FinishOnlyFilter, RejectionFilter
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


class SandboxConfig(_Strict):
    """Where an evaluator's episodes act. CPU and memory limits come from its run_resource."""

    kind: str = "local"  # "local" (a process sandbox on the sample's node) or "docker"
    image: str | None = None  # docker only
    wall_seconds: float = 60.0  # per command
    cpu_seconds: int = 60  # per command
    network: bool = False


class EvaluatorConfig(_Strict):
    evaluator_id: str
    env: str = "arithmetic"
    engine: str = "student"
    teacher: str | None = None  # a second engine: the episode is a DAgger roll-in (student + teacher)
    resource: Resource = Resource()
    run_resource: Resource = Resource()
    eval_resource: Resource = Resource()
    batch_size: int | None = None
    default_stopping: StoppingCriteria = StoppingCriteria()
    default_sampling: SamplingParams = SamplingParams()
    eval_timeout_s: float = 300.0
    sandbox: SandboxConfig = SandboxConfig()


class DatasetConfig(_Strict):
    """One dataset of an env; ``dataset_cfg`` is the cascade's third level (flat keys)."""

    env: str = "arithmetic"
    task_type: str | None = None  # routes the rows to another evaluator; default: the env's own
    seed: int = 0
    n_prompts: int = 64  # generated envs: rows made; eval datasets: prompts used
    n_samples_per_prompt: int | None = None
    weight: float = 1.0  # rollout mixing weight
    shuffle: bool = True
    dataset_cfg: dict[str, Any] = {}


class SchedulerConfig(_Strict):
    seed: int = 0  # the data source's RNG (which dataset each task comes from)
    rollout_batch_size: int = 8
    batching: str = "fifo"
    n_samples_per_eval_prompt: int = 1
    global_stopping: StoppingCriteria = StoppingCriteria()
    global_sampling: SamplingParams = SamplingParams()
    acquire_timeout_s: float = 3600.0
    progress: bool = True
    save_eval_details: str | None = None  # --save-eval-details: folder for eval_details/ artifacts
    trajectory_dir: str | None = None  # where rollouts are saved and reused (STACX_* reuse knobs)
    checkpoint_dir: str | None = None  # mid-rollout checkpoints: a restarted manager resumes the step


class FiltersConfig(_Strict):
    """Survivorship filters on each rollout step (spec §5): rejection first, then finish-only on
    the survivors; the abort cap only warns."""

    rejection: RejectionFilter | None = None
    finish_only: FinishOnlyFilter | None = None
    abort_cap: AbortCap | None = AbortCap()


class RecipeConfig(_Strict):
    engines: dict[str, EngineConfig]
    evaluators: list[EvaluatorConfig]
    data: dict[str, DatasetConfig]  # rollout datasets by name, mixed by weight
    eval: dict[str, DatasetConfig] = {}
    pool: PoolConfig = PoolConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    filters: FiltersConfig = FiltersConfig()
    dagger: DAggerSchedule | None = None  # per-iteration beta / t_max, published before each fetch


def parse_recipe(args: dict[str, Any], source: str = "rollout.yaml") -> RecipeConfig:
    try:
        recipe = msgspec.convert(args, RecipeConfig)
    except msgspec.ValidationError as e:
        raise RecipeError(f'recipe "{source}": {e}') from None
    if not recipe.engines:
        raise RecipeError(f'recipe "{source}": $.engines: at least one engine is needed')
    for i, ev in enumerate(recipe.evaluators):
        for key in ("engine", "teacher"):
            name = getattr(ev, key)
            if name is not None and name not in recipe.engines:
                raise RecipeError(f'recipe "{source}": $.evaluators[{i}].{key}: {name!r} is not one of '
                                  f"{sorted(recipe.engines)}")
    if not recipe.evaluators:
        raise RecipeError(f'recipe "{source}": $.evaluators: at least one evaluator is needed')
    if not recipe.data:
        raise RecipeError(f'recipe "{source}": $.data: at least one dataset is needed')
    from rayapp.envs.registry import ENVS

    for where, datasets in (("data", recipe.data), ("eval", recipe.eval)):
        for name, d in datasets.items():
            if d.env not in ENVS:
                raise RecipeError(f'recipe "{source}": $.{where}.{name}.env: {d.env!r} is not one of {sorted(ENVS)}')
    for i, ev in enumerate(recipe.evaluators):
        if ev.env not in ENVS:
            raise RecipeError(f'recipe "{source}": $.evaluators[{i}].env: {ev.env!r} is not one of {sorted(ENVS)}')
        if ev.teacher is not None and ENVS[ev.env].make_dagger_agent is None:
            dagger_envs = sorted(n for n, e in ENVS.items() if e.make_dagger_agent is not None)
            raise RecipeError(f'recipe "{source}": $.evaluators[{i}].teacher: env {ev.env!r} has no DAgger agent; '
                              f"DAgger runs on {dagger_envs}")
        if ev.sandbox.kind not in ("local", "docker") or (ev.sandbox.kind == "docker") != bool(ev.sandbox.image):
            raise RecipeError(f'recipe "{source}": $.evaluators[{i}].sandbox: kind "local", or kind "docker" '
                              f"with an image")
    return recipe


# Launch-time environment variables the spec's recipes read (name -> (default, meaning)).
ENV_CONCURRENCY = "STACX_DAGGER_ENV_CONCURRENCY"
ENV_KNOBS: dict[str, tuple[str, str]] = {
    ENV_CONCURRENCY: ("(unset)", "user-set: when set, the per-evaluator concurrency (resource.concurrency, the "
                                 "semaphore ceiling) of every DAgger evaluator (one with a teacher); the spec's "
                                 "SWE recipe default is 4"),
}


def apply_env(recipe: RecipeConfig, environ: Mapping[str, str], source: str = "rollout.yaml") -> RecipeConfig:
    """The recipe with the launch-time variables of ``ENV_KNOBS`` applied (read in the manager's
    process: set them in the Serve config's ``runtime_env.env_vars`` or the shell of ``serve run``)."""
    raw = environ.get(ENV_CONCURRENCY)
    if raw is None:
        return recipe
    try:
        concurrency = int(raw)
        if concurrency < 1:
            raise ValueError
    except ValueError:
        raise RecipeError(f'recipe "{source}": {ENV_CONCURRENCY}={raw!r}: expected an integer >= 1') from None
    evaluators = [msgspec.structs.replace(ev, resource=msgspec.structs.replace(ev.resource, concurrency=concurrency))
                  if ev.teacher is not None else ev for ev in recipe.evaluators]
    return msgspec.structs.replace(recipe, evaluators=evaluators)

"""A recipe: the ``args`` of the rayapp application in a Serve config (``recipes/*/rollout.yaml``).

Validated whole once, before anything starts: the Structs carry their own bounds (``Meta(ge=...)``,
``Literal``s), ``rayapp.core.convert`` turns a misfit into one error naming the file and the JSON
path, the batching strategy's dotted path is resolved, and ``check_recipe`` holds the few rules
that span fields. Code behind ``parse_recipe`` trusts the types. Nothing here imports Ray.
"""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rayapp.core.batching import BatchingStrategy
from rayapp.core.cascade import CASCADE_FIELDS, CascadeError, dataset_override
from rayapp.core.contracts import SchedulerConfig
from rayapp.core.convert import InputError, convert, show
from rayapp.core.layout import LayoutError, is_inline, parse_cluster_layout
from rayapp.envs import watch
from rayapp.envs.datasets.files import FieldMap
from rayapp.envs.plugin_import import load_strategy
from rayapp.inference.client import Backend
from rayapp.recipe.gateway_config import GatewayConfig, check_gateways
from rayapp.recipe.limits import (
    MAX_CPUS,
    MAX_GPUS,
    MAX_MEMORY_GB,
    MAX_REPLICAS,
    MAX_ROWS,
    check_dagger_section,
    check_limits,
    layout_of,
)
from rayapp.recipe.plugin_checks import check_dataset_env, check_evaluator_env
from rayapp.recipe.removed import removed_keys
from rayapp.recipe.runnable import check_runnable
from rayapp.steps.dagger_schedule import DAggerSchedule
from rayapp.steps.filters import AbortCap, Filter, FinishOnlyFilter, RejectionFilter
from rayapp.steps.partial import PartialConfig
from rayapp.types import (
    FINITE,
    MAX_CONCURRENCY,
    MAX_SECONDS,
    MAX_STEP_SAMPLES,
    Resource,
    SamplingParams,
    StoppingCriteria,
)

Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # what numpy and the engines take as a seed
# Finite too: inf passes a lower bound and would reach Ray's options and timers.
Amount = Annotated[float, Meta(ge=0, le=FINITE)]
Seconds = Annotated[float, Meta(gt=0, le=MAX_SECONDS)]
Samples = Annotated[int, Meta(ge=1, le=MAX_STEP_SAMPLES)]  # samples or tasks of a step, or of a part of one
# Relative, so any scale serves; a ratio past this never draws the lighter dataset, and huge sums overflow.
Weight = Annotated[float, Meta(ge=0, le=1_000_000)]
# Sizes past these are typos, not plans (rayapp.recipe.limits).
Cpus = Annotated[float, Meta(ge=0, le=MAX_CPUS)]
Gpus = Annotated[float, Meta(ge=0, le=MAX_GPUS)]
MemoryGb = Annotated[float, Meta(ge=0, le=MAX_MEMORY_GB)]
SandboxKind = Literal["local", "docker"]
PlacementStrategy = Literal["STRICT_PACK", "PACK", "STRICT_SPREAD", "SPREAD"]  # Ray's placement group strategies


class RecipeError(InputError):
    """A recipe that does not fit: ``recipe "<file>": $.path: reason``."""

    def __init__(self, file: str | os.PathLike, path: str | None, reason: str):
        self.file = os.fsdecode(file)
        super().__init__(f'recipe "{self.file}"', path, reason)

    def __reduce__(self) -> tuple[Any, ...]:  # rebuilt from the file, not the source it made
        return type(self), (self.file, self.path, self.reason)


class _Strict(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class EngineConfig(_Strict):
    """One inference deployment. ``options`` go to the backend (``make_backend(backend, **options)``)."""

    backend: Annotated[Backend, Meta(description="inference backend: hf (transformers) or sglang")] = "hf"
    num_replicas: Annotated[int, Meta(ge=1, le=MAX_REPLICAS, description="Serve replicas of this engine")] = 1
    num_cpus: Annotated[Cpus, Meta(description="CPUs Ray reserves for each replica")] = 1.0
    num_gpus: Annotated[Gpus, Meta(description="GPUs Ray reserves for each replica; a fraction shares one")] = 0.0
    max_ongoing_requests: Annotated[int, Meta(ge=1, le=MAX_CONCURRENCY, description="requests one replica serves at "
                                                                                   "once (Serve)")] = 64
    request_timeout_s: Annotated[Seconds, Meta(description="seconds an agent waits for one generate call; then the "
                                                         "call is cancelled and the sample aborts")] = 300.0
    options: Annotated[dict[str, Any], Meta(description="keyword arguments of the backend (model_path, ...)")] = {}
    weight_roots: Annotated[list[str] | None, Meta(
        description="absolute folders update_weights_from_disk may read from: a checkpoint and every file it names "
                    "must resolve inside one ([]: no updates); unset: the model folder's parent and "
                    "scheduler.checkpoint_dir")] = None
    placement_group_bundles: Annotated[list[dict[str, Amount]] | None, Meta(
        description="bundles each replica reserves as one placement group, for engines spanning several GPUs "
                    "(tensor parallel)")] = None
    placement_group_strategy: Annotated[PlacementStrategy, Meta(description="Ray strategy of that placement group "
                                                              "(STRICT_PACK: all on one node)")] = "STRICT_PACK"


class PoolConfig(_Strict):
    """The placement pool: the layout (inline JSON, a file, or None to read the live cluster),
    the shorthand's defaults, and whether batches are gated at all."""

    gate: Annotated[bool, Meta(description="admit batches through the placement pool; false: no pool, batches "
                                           "launch ungated")] = True
    cluster_layout: Annotated[str | dict[str, Any] | None, Meta(
        description="what the pool may hand out per node: a layout file, inline JSON or a mapping; unset: the "
                    "live cluster's nodes")] = None
    num_cpus: Annotated[Cpus | None, Meta(description="CPUs of a layout node that names none; with no layout, "
                                                       "overrides each live node's CPUs")] = None
    memory_gb: Annotated[MemoryGb | None, Meta(description="memory (GB) of a layout node that names none; with no "
                                                        "layout, overrides each live node's memory")] = None
    pg_ready_timeout_s: Annotated[Seconds, Meta(description="seconds the pool's placement groups (one per node) may "
                                                          "take to become ready at start-up; then it fails")] = 10.0


class SandboxConfig(_Strict):
    """Where an evaluator's episodes act. CPU and memory limits come from its run_resource."""

    kind: Annotated[SandboxKind, Meta(description="local (a process sandbox on the sample's node) or docker")] = (
        "local")
    image: Annotated[str | None, Meta(description="container image; docker only, and needed there")] = None
    wall_seconds: Annotated[Seconds, Meta(description="wall-clock limit of one sandbox command, seconds")] = 60.0
    cpu_seconds: Annotated[int, Meta(ge=1, le=MAX_SECONDS, description="CPU-time limit of one sandbox command, "
                                                                       "seconds")] = 60
    network: Annotated[bool, Meta(description="let sandbox commands reach the network")] = False


class EvaluatorConfig(_Strict):
    evaluator_id: Annotated[str, Meta(description="the evaluator's name: tasks whose evaluator_id (default: "
                                                  "their task_type) is this run here")]
    env: Annotated[str, Meta(description="env whose agent runs the episodes: arithmetic, math, humaneval, swe, "
                                         "or an import path to an Env ('my_pkg.my_env:ENV')")] = "arithmetic"
    agent: Annotated[str | None, Meta(description="import path to an agent factory, factory(deps) -> agent, used "
                                                  "instead of the env's (docs/plugins.md); unset: the env's")] = None
    verifier: Annotated[str | None, Meta(description="import path to verify(sample, result) -> reward dict, used "
                                                     "instead of the env's; unset: the env's")] = None
    tools: Annotated[list[str] | None, Meta(description="the tools the agent offers: built-in names (calculator, "
                                                        "bash, read_file, write_file) or import paths to async "
                                                        "tool(arguments, sandbox) -> str; unset: the env's")] = None
    engine: Annotated[str, Meta(description="engine (a name under engines) the agent generates with")] = "student"
    teacher: Annotated[str | None, Meta(description="a second engine: episodes are DAgger roll-ins mixing it "
                                                    "with engine (math, swe); unset: no DAgger")] = None
    resource: Annotated[Resource, Meta(description="budget of one batch: it is granted tokens for as many of its "
                                                   "samples as fit; concurrency caps those running at once")] = (
        Resource())
    run_resource: Annotated[Resource, Meta(description="what one sample holds in its run phase; cpu and "
                                                       "memory_gb also limit its sandbox")] = Resource()
    eval_resource: Annotated[Resource, Meta(description="what one sample holds in its verify phase (it holds the "
                                                        "larger of the two throughout)")] = Resource()
    batch_size: Annotated[Samples | None, Meta(description="most tasks in one batch; unset: a step's tasks of one "
                                                       "type form one batch")] = None
    default_stopping: Annotated[StoppingCriteria, Meta(
        description="stopping criteria of this evaluator: over scheduler.global_stopping, under a dataset's "
                    "dataset_cfg")] = StoppingCriteria()
    default_sampling: Annotated[SamplingParams, Meta(
        description="sampling params of this evaluator: over scheduler.global_sampling, under a dataset's "
                    "dataset_cfg")] = SamplingParams()
    eval_timeout_s: Annotated[Seconds, Meta(description="wall-clock limit of a sample's verify phase, "
                                                      "seconds; past it the sample aborts")] = 300.0
    sandbox: Annotated[SandboxConfig, Meta(description="where the agent's commands and tests run")] = (
        SandboxConfig())
    gateway: Annotated[GatewayConfig | None, Meta(description="run an agent written against the OpenAI API instead "
                                                              "of the env's (docs/agents.md); unset: the env's "
                                                              "agent or the agent plug-in")] = None


class DatasetConfig(_Strict):
    """One dataset of an env; ``dataset_cfg`` is the cascade's third level (flat keys)."""

    env: Annotated[str, Meta(description="env whose rows this dataset holds (a built-in name or an import path); "
                                         "with path or source, the env the rows are meant for")] = "arithmetic"
    path: Annotated[str | None, Meta(description="a JSONL (.jsonl, .jsonl.gz) or Parquet file of rows, read by the "
                                                 "manager at its start (relative: to the recipe file's folder "
                                                 "under rayapp validate and run); unset: the env's rows")] = None
    fields: Annotated[FieldMap, Meta(description="which column of path holds the prompt, label, task type, task "
                                                 "id and metadata")] = FieldMap()
    source: Annotated[str | None, Meta(description="import path to rows(cfg) -> Iterable[Task], the dataset's rows "
                                                   "instead of the env's; unset: the env's")] = None
    task_type: Annotated[str | None, Meta(description="sets the rows' task_type, which routes them to the "
                                                      "evaluator of that id; unset: the env's own")] = None
    seed: Annotated[Seed, Meta(description="seed generated envs (arithmetic, math) make their rows with")] = 0
    n_prompts: Annotated[int, Meta(ge=1, le=MAX_ROWS, description="generated envs: rows made; eval datasets: the "
                                                                  "first n prompts "
                                               "used")] = 64
    n_samples_per_prompt: Annotated[Samples | None, Meta(description="rollout datasets: samples per prompt (group "
                                                                 "size); unset: the row's own n_samples")] = None
    weight: Annotated[Weight, Meta(description="rollout datasets: mixing weight, tasks are drawn in proportion to "
                                               "it")] = 1.0
    shuffle: Annotated[bool, Meta(description="rollout datasets: a fresh seeded row order each epoch; false: row "
                                              "order")] = True
    dataset_cfg: Annotated[dict[str, Any], Meta(description="flat overrides: keys naming a stopping or sampling "
                                                            "field win over the evaluator's and global ones; any "
                                                            "other key is an error")] = {}


class SchedulerSection(SchedulerConfig, forbid_unknown_fields=True, frozen=True, dict=True):
    """The TaskScheduler's settings (``SchedulerConfig``'s fields, defaults and bounds, defined once
    there) and the recipe's own keys around it. ``dict=True`` only makes room for ``strategy``'s cache."""

    seed: Annotated[Seed, Meta(description="seed of the data source: which dataset each task comes from, and "
                                          "shuffle orders")] = 0
    batching: Annotated[str, Meta(description="batching strategy: fifo, longest_first, budget, or a dotted path "
                                              "to a callable")] = "fifo"
    save_eval_details: Annotated[str | None, Meta(description="folder for eval_details/ artifacts (per-sample "
                                                              "JSONL, eval and train summaries); unset: none")] = None
    eval_details_tokens: Annotated[bool, Meta(description="eval_details/{id}.jsonl also holds each sample's token "
                                                          "data as a trainer gets it (tokens, loss_mask, "
                                                          "rollout_log_probs); needs save_eval_details")] = False
    trajectory_dir: Annotated[str | None, Meta(description="folder where rollouts are saved and reused per the "
                                                           "STACX_* reuse variables; unset: always roll out fresh, "
                                                           "save nothing")] = None
    checkpoint_dir: Annotated[str | None, Meta(description="folder for mid-rollout checkpoints (source state + each "
                                                           "finished group): a restarted manager resumes the step "
                                                           "without re-running finished groups, and the two latest "
                                                           "finished steps' results are served from it again "
                                                           "(step_results/); unset: none")] = None
    partial: Annotated[PartialConfig | None, Meta(description="partial rollouts: a step starts more groups than "
                                                              "rollout_batch_size, returns once that many are "
                                                              "complete and carries the rest into the next step "
                                                              "(kept in checkpoint_dir when set); unset: off")] = None

    def scheduler_config(self) -> SchedulerConfig:
        """The settings the TaskScheduler takes: this section's ``SchedulerConfig`` fields."""
        return SchedulerConfig(**{f: getattr(self, f) for f in SchedulerConfig.__struct_fields__})

    @functools.cached_property
    def strategy(self) -> BatchingStrategy:
        """``batching`` resolved; ``parse_recipe`` resolves it first, so a bad path fails there."""
        return load_strategy(self.batching)


class FiltersConfig(_Strict):
    """Survivorship filters on each rollout step (docs/scheduler.md §5): rejection first, then finish-only on
    the survivors; the abort cap only warns."""

    rejection: Annotated[RejectionFilter | None, Meta(description="drops groups without learning signal; unset: "
                                                                  "off")] = None
    finish_only: Annotated[FinishOnlyFilter | None, Meta(description="drops samples that did not finish on their "
                                                                     "own; unset: off")] = None
    abort_cap: Annotated[AbortCap | None, Meta(description="warns when too many of a step's samples aborted; "
                                                           "null: off")] = AbortCap()

    def chain(self) -> list[Filter]:
        """The filters that are on, in the order they run."""
        return [f for f in (self.rejection, self.finish_only) if f is not None]


class RecipeConfig(_Strict):
    engines: Annotated[dict[str, EngineConfig], Meta(description="inference deployments by name (student, "
                                                                 "teacher, ...)")]
    evaluators: Annotated[list[EvaluatorConfig], Meta(description="what runs each task type's episodes")]
    data: Annotated[dict[str, DatasetConfig], Meta(description="rollout datasets by name, mixed by weight")]
    eval: Annotated[dict[str, DatasetConfig], Meta(description="eval datasets by name")] = {}
    pool: Annotated[PoolConfig, Meta(description="the placement pool that admits batches")] = PoolConfig()
    scheduler: Annotated[SchedulerSection, Meta(description="the TaskScheduler's settings")] = SchedulerSection()
    filters: Annotated[FiltersConfig, Meta(description="survivorship filters on each rollout step")] = (
        FiltersConfig())
    dagger: Annotated[DAggerSchedule | None, Meta(description="per-iteration β / t_max, published before each "
                                                              "fetch; unset: β 0, the student acts alone")] = None


# What an error names when the recipe came as a Serve config's args (Serve does not say from which file).
ARGS_SOURCE = "<serve args>"
def parse_recipe(args: dict[str, Any], source: str | os.PathLike = ARGS_SOURCE) -> RecipeConfig:
    """``args`` as a RecipeConfig, or one RecipeError naming ``source`` and the JSON path."""
    try:
        # msgspec writes a dict value's path as `$.engines[...]`: convert the named sections' entries
        # one by one first, so an error names the engine or dataset.
        for key, type_ in (("engines", EngineConfig), ("data", DatasetConfig), ("eval", DatasetConfig)):
            section = args.get(key) if isinstance(args, dict) else None
            for name, value in section.items() if isinstance(section, dict) else ():
                convert(value, type_, "", root=f"$.{key}.{name}")
        check_dagger_section(args.get("dagger") if isinstance(args, dict) else None)
        removed = next(removed_keys(args), None)
        if removed is not None:
            raise RecipeError(source, *removed)
        recipe = convert(args, RecipeConfig, "")
    except InputError as e:
        raise RecipeError(source, e.path, e.reason) from None
    problem = next(check_recipe(recipe), None)
    if problem is not None:
        raise RecipeError(source, *problem)
    return recipe


def check_recipe(recipe: RecipeConfig) -> Iterator[tuple[str, str]]:
    """The rules that span fields, as (JSON path, reason), first problem first: engines, evaluators
    and datasets exist, names point at engines that exist, envs and plug-ins resolve and fit
    (``recipe/plugin_checks.py``), a DAgger evaluator has a DAgger agent, a docker sandbox names an image,
    dataset_cfg keys name cascade fields, a gateway agent fits (``recipe/gateway_config.py``), an inline
    layout reads, and the batching strategy resolves."""
    for key, what in (("engines", "engine"), ("evaluators", "evaluator"), ("data", "dataset")):
        if not getattr(recipe, key):
            yield f"$.{key}", f"at least one {what} is needed"
    for i, ev in enumerate(recipe.evaluators):
        yield from _check_evaluator(f"$.evaluators[{i}]", ev, recipe.engines)
    for where, datasets in (("data", recipe.data), ("eval", recipe.eval)):
        for name, d in datasets.items():
            yield from check_dataset_env(f"$.{where}.{name}", d)
            yield from _check_dataset_cfg(f"$.{where}.{name}", d.dataset_cfg)
    yield from check_gateways(recipe)
    # A layout file is read where the pool replica runs (the head's working directory), which the build
    # need not share: only load_recipe, on the user's side, reads it ahead.
    if is_inline(recipe.pool.cluster_layout):
        yield from check_layout(recipe.pool)
    # Sizes, folders and engine options (recipe/limits.py); a layout file is
    # load_recipe's to read, so only an inline one is fitted here.
    yield from check_limits(recipe, layout_of(recipe.pool) if is_inline(recipe.pool.cluster_layout) else None)
    yield from check_runnable(recipe)  # options, ids and sizes the app would fail on (recipe/runnable.py)
    try:
        with watch.field("$.scheduler.batching"):
            recipe.scheduler.strategy  # noqa: B018 -- resolved and checked (cached) now: a bad path fails here
    except ValueError as e:
        yield "$.scheduler.batching", str(e)


def _check_dataset_cfg(at: str, cfg: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Every key names a cascade field (a misspelt one would be dropped without a word) and every
    value fits that field, as the evaluator would find at the first step."""
    for key in cfg:
        if key not in CASCADE_FIELDS:
            close = difflib.get_close_matches(key, CASCADE_FIELDS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            yield f"{at}.dataset_cfg", f"unknown key {show(key)} ({hint}keys: {', '.join(CASCADE_FIELDS)})"
    for cls in (StoppingCriteria, SamplingParams):
        try:
            dataset_override(cls, cfg)
        except CascadeError as e:
            yield f"{at}{e.path[1:]}", e.reason


def check_layout(pool: PoolConfig) -> Iterator[tuple[str, str]]:
    """The pool's layout read as the pool replica will read it, so a bad one fails before it starts."""
    if pool.gate:
        try:
            parse_cluster_layout(pool.cluster_layout, pool.num_cpus or 0.0, pool.memory_gb or 0.0)
        except LayoutError as e:
            yield "$.pool.cluster_layout", str(e)


def _check_evaluator(at: str, ev: EvaluatorConfig, engines: Mapping[str, EngineConfig]) -> Iterator[tuple[str, str]]:
    for key in ("engine", "teacher"):
        name = getattr(ev, key)
        if name is not None and name not in engines:
            yield f"{at}.{key}", f"{name!r} is not one of {sorted(engines)}"
    # Env names stay plain strings (a built-in's name or an import path), resolved here.
    yield from check_evaluator_env(at, ev)
    if (ev.sandbox.kind == "docker") != bool(ev.sandbox.image):
        yield f"{at}.sandbox", 'kind "local", or kind "docker" with an image'


def check_live_gpus(recipe: RecipeConfig, cluster_gpus: float | None, source: str = ARGS_SOURCE) -> None:
    """A layout read off the live cluster (``cluster_gpus``: its GPUs; None: no cluster to read) needs
    GPUs there when samples ask for them: say so at `serve run` time, not as a deadlock at the first
    step."""
    wanted = [e.evaluator_id for e in recipe.evaluators if e.run_resource.gpu > 0 or e.eval_resource.gpu > 0]
    if recipe.pool.gate and recipe.pool.cluster_layout is None and wanted and cluster_gpus is not None \
            and cluster_gpus <= 0:
        raise RecipeError(
            source, "$.evaluators", f"{wanted} hold GPU fractions, but this Ray cluster has no GPUs. On one "
            f"machine start Ray with logical GPUs first (ray start --head --num-gpus=4 "
            f"--node-ip-address=127.0.0.1), or give pool.cluster_layout / gpu: 0")

"""What a recipe asks for that fits each field's type but that the app would then fail on, or quietly
mishandle: refused (or, where the spec's run time only warns, warned of) before anything starts. Each
finding is (JSON path, reason), first problem first, as ``check_recipe`` reports them.

- Engine options of the hf backend hold its constructor's types and bounds (``HFOptions``):
  ``max_concurrency`` >= 1, ``num_threads`` >= 1, ``prefix_cache`` >= 0, a ``dtype`` it knows, a torch
  ``device`` name; ``cuda`` needs GPUs the replica reserves (``num_gpus``), and a replica sees only
  those, numbered from 0 (``num_gpus: 1`` gives ``cuda:0``, never ``cuda:7``).
- Evaluator ids are unique (the scheduler would refuse the second at its start).
- A step holds at most ``MAX_STEP_SAMPLES`` samples: a rollout step's groups (``rollout_batch_size``,
  more with partial rollouts) times the largest group, an eval step's prompts times
  ``n_samples_per_eval_prompt``: more is a typo, not a plan. (Each of these alone, and every other
  size, count and timeout of a recipe, is bounded by its type: ``rayapp.types``' ``MAX_*``.)
- ``scheduler.eval_details_tokens`` needs ``scheduler.save_eval_details``.
- A source plug-in's rows are Tasks, at least one (``rows_problem``; ``recipe.wiring.check_builds``
  makes them).

``recipe_warnings`` (``rayapp validate`` only): a dataset whose rows name no evaluator (the scheduler
falls back to the first one, with a warning, as the spec says), and a ``cuda`` device this machine
lacks (the engine's node may have it). ``verifier_problems`` (validate only): each verifier plug-in
called on one row routed to it, with the row's label as the response, must return what the
evaluator takes (a dict with a finite ``score``), or every sample would abort ``infra_other``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rayapp.core.convert import InputError, convert
from rayapp.types import MAX_CONCURRENCY, MAX_STEP_SAMPLES, MAX_TOKENS, Task

MAX_THREADS = 4096
MAX_PREFIX_CACHE = 100_000  # cached prompt prefixes, each one's KV cache held in memory
# A torch device name: cpu, mps, or cuda/xpu with an optional index.
_DEVICE = r"^(cpu|mps|(cuda|xpu)(:[0-9]{1,4})?)$"


class HFOptions(msgspec.Struct, frozen=True):
    """The hf backend's keyword arguments with their bounds (``rayapp.inference.hf.HFBackend``; a
    test holds the names and defaults to its signature). Unknown keys are ``recipe.limits``' to name."""

    model_path: str | None = None
    device: Annotated[str, Meta(pattern=_DEVICE)] = "cpu"
    max_concurrency: Annotated[int, Meta(ge=1, le=MAX_CONCURRENCY)] = 4
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int | None = None
    num_threads: Annotated[int, Meta(ge=1, le=MAX_THREADS)] | None = None
    cache_dir: str | None = None
    steps_per_call: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] = 8
    prefix_cache: Annotated[int, Meta(ge=0, le=MAX_PREFIX_CACHE)] = 64


def check_runnable(recipe: Any) -> Iterator[tuple[str, str]]:
    """The module docstring's refusals, first problem first."""
    for name, e in recipe.engines.items():
        yield from _check_hf(name, e)
    seen: dict[str, int] = {}
    for i, ev in enumerate(recipe.evaluators):
        at = f"$.evaluators[{i}]"
        if ev.evaluator_id in seen:
            yield f"{at}.evaluator_id", (f"{ev.evaluator_id!r} is evaluators[{seen[ev.evaluator_id]}]'s too: each "
                                         "evaluator_id names one evaluator")
        seen.setdefault(ev.evaluator_id, i)
    yield from _check_step_sizes(recipe)
    s = recipe.scheduler
    if s.eval_details_tokens and not s.save_eval_details:
        yield "$.scheduler.eval_details_tokens", "needs scheduler.save_eval_details, the folder its files go to"


def _check_hf(name: str, e: Any) -> Iterator[tuple[str, str]]:
    if e.backend != "hf":
        return
    at = f"$.engines.{name}.options"
    try:
        options = convert(e.options, HFOptions, "", root=at)
    except InputError as err:
        yield err.path or at, err.reason
        return
    device = options.device
    if not device.startswith("cuda") or e.placement_group_bundles:
        return
    if e.num_gpus == 0:
        yield f"{at}.device", (f"{device!r} needs a GPU, but the replica reserves none "
                               f"(engines.{name}.num_gpus is 0)")
        return
    index = int(device.partition(":")[2] or 0)
    visible = max(1, math.ceil(e.num_gpus))
    if index >= visible:
        yield f"{at}.device", (f"{device!r}: a replica sees only the GPUs Ray reserves for it, numbered from 0 "
                               f"(engines.{name}.num_gpus {e.num_gpus:g}: cuda:0"
                               f"{'' if visible == 1 else f' .. cuda:{visible - 1}'})")


def _check_step_sizes(recipe: Any) -> Iterator[tuple[str, str]]:
    s = recipe.scheduler
    group = max((d.n_samples_per_prompt or 1 for d in recipe.data.values()), default=1)
    groups = math.ceil(s.rollout_batch_size * (s.partial.over_provision if s.partial is not None else 1.0))
    if groups * group > MAX_STEP_SAMPLES:  # a group alone is bounded by its type
        yield "$.scheduler.rollout_batch_size", (
            f"a rollout step of {groups} groups of up to {group} samples holds {groups * group} samples, more "
            f"than {MAX_STEP_SAMPLES}: a typo, not a plan")
    prompts = sum(d.n_prompts for d in recipe.eval.values())
    if prompts * s.n_samples_per_eval_prompt > MAX_STEP_SAMPLES:
        yield "$.scheduler.n_samples_per_eval_prompt", (
            f"an eval step of up to {prompts} prompts x {s.n_samples_per_eval_prompt} copies holds more than "
            f"{MAX_STEP_SAMPLES} samples: a typo, not a plan")


def rows_problem(rows: list[Any], what: str) -> str | None:
    """Why a source plug-in's rows could not be a dataset (none, or one that is not a Task), or None."""
    if not rows:
        return f"{what}: its rows(cfg) made no rows"
    for i, row in enumerate(rows):
        if not isinstance(row, Task):
            return f"{what}: its rows(cfg) made row {i} a {type(row).__name__}, not a rayapp Task"
    return None


def routed_rows(recipe: Any) -> list[tuple[str, str, list[Task]]]:
    """(JSON path, dataset label, rows) of each dataset whose rows can be made here, made once for
    ``recipe_warnings`` and ``verifier_problems``; a dataset whose rows fail is the other checks' to
    report."""
    from rayapp.envs.registry import dataset_rows

    found = []
    for where in ("data", "eval"):
        for name, d in sorted(getattr(recipe, where).items()):
            try:
                rows = dataset_rows(d, name)
            except Exception:  # said by load_recipe's own checks
                continue
            found.append((f"$.{where}.{name}", f"{where}.{name}", [r for r in rows if isinstance(r, Task)]))
    return found


def recipe_warnings(recipe: Any, datasets: list[tuple[str, str, list[Task]]]) -> list[tuple[str, str]]:
    """The module docstring's warnings; ``datasets``: ``routed_rows(recipe)``."""
    found = []
    ids = [ev.evaluator_id for ev in recipe.evaluators]
    for at, label, rows in datasets:
        unknown = sorted({t.evaluator_id for t in rows} - set(ids))
        if unknown and ids:
            field = f"{at}.task_type" if getattr(_dataset_of(recipe, label), "task_type", None) else at
            found.append((field, f"rows of {label} name evaluator {', '.join(map(repr, unknown))}, which is not "
                                 f"one of {ids}: they would run on the first, {ids[0]!r} (a task_type naming "
                                 "one of them, or an evaluator of that id)"))
    for name, e in recipe.engines.items():
        device = str(e.options.get("device", "")) if e.backend == "hf" else ""
        if device.startswith("cuda"):
            have = _cuda_devices()
            index = int(device.partition(":")[2] or 0)
            if have is not None and index >= have:
                found.append((f"$.engines.{name}.options.device", (
                    f"{device!r}: this machine has {have} CUDA device(s); the engine's node must have it")))
    return found


def _dataset_of(recipe: Any, label: str) -> Any:
    where, _, name = label.partition(".")
    return getattr(recipe, where).get(name)


def _cuda_devices() -> int | None:
    """CUDA devices this machine shows torch, or None where torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.device_count()


def verifier_problems(recipe: Any, datasets: list[tuple[str, str, list[Task]]]) -> list[tuple[str, str]]:
    """Each verifier plug-in's return on one row routed to it (module docstring; ``datasets``:
    ``routed_rows(recipe)``); one that raises is left to ``rayapp verify``, which shows every row."""
    from rayapp.core.evaluator import checked_reward
    from rayapp.envs import watch
    from rayapp.envs.plugin_import import load_verifier
    from rayapp.types import AgentResult, Sample

    found = []
    for i, ev in enumerate(recipe.evaluators):
        if not ev.verifier:
            continue
        row = next(((label, t) for _, label, rows in datasets for t in rows if t.evaluator_id == ev.evaluator_id),
                   None)
        if row is None:
            continue
        label, task = row
        at = f"$.evaluators[{i}].verifier"
        sample = Sample(task.task_id, 0, task.prompt, task.label, metadata=dict(task.metadata))
        response = task.label if isinstance(task.label, str) else json.dumps(task.label)
        try:
            with watch.field(at), watch.running(f"verifier {ev.verifier!r}: verify(sample, result)"):
                reward = load_verifier(ev.verifier)(sample, AgentResult(tokens=[], response_length=0,
                                                                        response=response))
                if inspect.isawaitable(reward):
                    reward = asyncio.run(_awaited(reward))
        except Exception:
            continue
        try:
            checked_reward(reward)
        except ValueError as e:
            found.append((at, f"on row {task.task_id!r} of {label} (its label as the response) {e}; every sample "
                              "would abort infra_other (a verifier returns {'score': float, ...})"))
    return found


async def _awaited(reward: Any) -> Any:
    return await reward

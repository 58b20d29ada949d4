"""What a recipe asks for that could never run, refused before anything starts: sizes no cluster
meets, folders that cannot be folders, engine options their backend does not take. Each problem is
(JSON path, reason), first problem first, as ``check_recipe`` reports them.

- Sizes: every resource stays under ``MAX_GPUS`` / ``MAX_CPUS`` / ``MAX_MEMORY_GB`` (a typo, not a
  plan); a sample's gpu above 1 is a whole number of GPUs; an evaluator's budget admits at least one
  of its samples; a sample fits on some node of the layout (when the recipe gives one) and in the
  pool's per-node defaults (``pool.num_cpus: 0`` with samples that need CPUs admits none); some
  rollout dataset has a weight above 0.
- Folders (``scheduler.save_eval_details``, ``trajectory_dir``, ``checkpoint_dir``): not empty, not
  under a system folder (``/proc``, ``/sys``, ``/dev``, ``/etc``, ``/boot``, ``/usr``, ``/bin``,
  ``/sbin``, ``/lib*``: judged after ``..`` and symbolic links are resolved, so ``/tmp/../proc`` or a
  link into ``/proc`` is one too) nor ``/`` itself, and, where the path exists on this machine, a
  writable directory under no file. A path that does not exist here is left to the manager's machine.
- Cluster layout nodes: cpu and memory_gb under ``MAX_CPUS`` / ``MAX_MEMORY_GB``, as the pool's are.
- Engine weight roots: absolute paths (a relative one would depend on where each replica runs).
- Engine options: the hf backend takes ``HF_OPTIONS`` and reads a local model folder (it never
  downloads: a ``model_path`` without ``config.json`` here fails); sglang takes ``SGLANG_OPTIONS``
  and hands the rest to sglang's ``ServerArgs``, checked against it where sglang is installed.
- Batching: a dotted path resolves to a Python function taking ``(tasks, specs)``.
- DAgger: the schedule's own rules speak of CLI flags (``--dagger-decay-iters``);
  ``check_dagger_section`` says them of the recipe's field (``$.dagger.decay_iters``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from rayapp.core.convert import InputError
from rayapp.core.layout import parse_cluster_layout
from rayapp.core.units import budget_tokens
from rayapp.steps.dagger_schedule import FLAGS as DAGGER_FLAGS
from rayapp.steps.dagger_schedule import DAggerSchedule
from rayapp.types import NodeSpec, Resource

MAX_GPUS = 1024.0  # per replica, sample or budget
MAX_CPUS = 65536.0
MAX_MEMORY_GB = 1048576.0  # 1 PB
MAX_REPLICAS = 1024
MAX_ROWS = 1_000_000  # rows a generated dataset makes (n_prompts): more takes minutes to build
# HFBackend's keyword arguments (rayapp.inference.hf: a test holds this list to its signature).
HF_OPTIONS = ("model_path", "device", "max_concurrency", "dtype", "seed", "num_threads", "cache_dir", "steps_per_call",
              "prefix_cache")
# SGLangBackend's own keyword arguments; the rest go to sglang's ServerArgs.
SGLANG_OPTIONS = ("model_path", "tp_size", "mem_fraction_static", "base_gpu_id", "placement_group", "request_timeout_s")
_SYSTEM = ("/proc", "/sys", "/dev", "/etc", "/boot", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_FOLDERS = ("save_eval_details", "trajectory_dir", "checkpoint_dir")


def check_limits(recipe: Any, layout: dict[str, NodeSpec] | None = None) -> Iterator[tuple[str, str]]:
    """Every rule of the module docstring; ``layout``: the pool's, when it is already read."""
    yield from _check_engines(recipe.engines)
    yield from _check_nodes(layout)
    yield from _check_sizes(recipe, layout)
    if recipe.data and all(d.weight == 0 for d in recipe.data.values()):
        yield "$.data", "every rollout dataset has weight 0: no task could be drawn (give one a weight > 0)"
    for key in _FOLDERS:
        yield from _check_folder(f"$.scheduler.{key}", getattr(recipe.scheduler, key, None))


def _sample(ev: Any) -> Resource:
    """What one sample of ``ev`` holds throughout: the larger of its run and verify phases, per field."""
    run, ev_ = ev.run_resource, ev.eval_resource
    return Resource(gpu=max(run.gpu, ev_.gpu), concurrency=max(run.concurrency, ev_.concurrency),
                    cpu=max(run.cpu, ev_.cpu), memory_gb=max(run.memory_gb, ev_.memory_gb))


def _check_sizes(recipe: Any, layout: dict[str, NodeSpec] | None) -> Iterator[tuple[str, str]]:
    for i, ev in enumerate(recipe.evaluators):
        at = f"$.evaluators[{i}]"
        for key in ("resource", "run_resource", "eval_resource"):
            r = getattr(ev, key)
            for field, most in (("gpu", MAX_GPUS), ("cpu", MAX_CPUS), ("memory_gb", MAX_MEMORY_GB)):
                if getattr(r, field) > most:
                    yield f"{at}.{key}.{field}", f"expected at most {most:g}, got {getattr(r, field)!r}"
                    return
            if key != "resource" and r.gpu > 1 and r.gpu != int(r.gpu):  # said of the field, not of the pool
                yield f"{at}.{key}.gpu", (f"above 1 it must be a whole number of GPUs (a sample holds whole GPUs "
                                          f"of one node, or a share of one), got {r.gpu!r}")
                return
        sample = _sample(ev)
        if budget_tokens(ev.resource, sample) < 1:
            yield f"{at}.resource", (f"the budget {_show(ev.resource)} admits no sample of {_show(sample)} "
                                     f"(the larger of run_resource and eval_resource)")
        pool = recipe.pool
        if pool.gate and layout is None and pool.cluster_layout is None:
            for field, need, have in (("num_cpus", sample.cpu, pool.num_cpus), ("memory_gb", sample.memory_gb,
                                                                                 pool.memory_gb)):
                if have is not None and need > have:
                    yield f"$.pool.{field}", (f"each node offers {have:g}, but a sample of evaluator "
                                              f"{ev.evaluator_id!r} needs {need:g}: none would be admitted")
        if layout and not any(_fits(sample, node) for node in layout.values()):
            yield f"{at}.run_resource", (f"a sample holds {_show(sample)}, more than any node of "
                                         f"pool.cluster_layout offers: none would be admitted")


def _check_nodes(layout: dict[str, NodeSpec] | None) -> Iterator[tuple[str, str]]:
    for name, node in (layout or {}).items():
        for field, most in (("cpu", MAX_CPUS), ("memory_gb", MAX_MEMORY_GB)):
            amount = getattr(node, field)
            if amount > most:
                yield f"$.pool.cluster_layout.{name}.{field}", f"expected at most {most:g}, got {amount!r}"
                return


def _fits(sample: Resource, node: NodeSpec) -> bool:
    gpus = len(node.gpus) if sample.gpu > 1 else (1 if node.gpus else 0)
    return sample.gpu <= gpus and sample.cpu <= node.cpu and sample.memory_gb <= node.memory_gb


def _show(r: Resource) -> str:
    return f"{{gpu: {r.gpu:g}, concurrency: {r.concurrency}, cpu: {r.cpu:g}, memory_gb: {r.memory_gb:g}}}"


def layout_of(pool: Any) -> dict[str, NodeSpec] | None:
    """The pool's layout, read (its problems are ``config.check_layout``'s to report: None here then)."""
    try:
        return parse_cluster_layout(pool.cluster_layout, pool.num_cpus or 0.0, pool.memory_gb or 0.0)
    except ValueError:
        return None


def _check_folder(at: str, value: str | None) -> Iterator[tuple[str, str]]:
    if value is None:
        return
    if not value.strip() or "\0" in value:
        yield at, f"expected a folder path, got {value!r}"
        return
    given = Path(os.path.normpath(Path(value).expanduser().absolute()))
    path = Path(os.path.realpath(given))  # `..` and links resolved: /tmp/../proc/x and a link into /proc are /proc/x
    existing = next((parent for parent in (path, *path.parents) if parent.exists()), Path("/"))
    if not existing.is_dir():
        yield at, f"{str(existing)!r} is a file, not a folder"
        return
    root = "/" if path == Path("/") else None
    system = next((s for s in _SYSTEM for p in (given, path) if p.is_relative_to(s)), root)
    if system is not None:
        shown = "" if str(path) == value else f" (that is {str(path)!r})"
        yield at, f"{value!r}{shown} is under the system folder {system!r}: not a place for files"
    elif existing == path and not os.access(path, os.W_OK | os.X_OK):
        yield at, f"{value!r} is not writable"


def _check_engines(engines: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for name, e in engines.items():
        at = f"$.engines.{name}.options"
        known = HF_OPTIONS if e.backend == "hf" else SGLANG_OPTIONS + _server_args()
        checked = e.backend == "hf" or len(known) > len(SGLANG_OPTIONS)
        for key in e.options if checked else ():
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"{len(known)} known, e.g. {', '.join(known[:8])}"
                yield at, f"unknown {e.backend} option {key!r} ({hint})"
        if e.backend == "sglang" and "weight_version" in e.options:  # one version scheme for every backend
            yield f"{at}.weight_version", ("the sglang backend names weight versions itself (0 at the start, "
                                           "then each update's): leave it out")
        for i, root in enumerate(e.weight_roots or ()):
            if not root or "\0" in root or not Path(root).is_absolute():
                yield f"$.engines.{name}.weight_roots[{i}]", f"expected an absolute folder path, got {root!r}"
        model = e.options.get("model_path")
        if e.backend == "hf" and model is not None and not (Path(str(model)).expanduser() / "config.json").is_file():
            yield f"{at}.model_path", (f"{str(model)!r} is not a local model folder (no config.json); the hf "
                                       f"backend never downloads: unset it for the tiny model")


def _server_args() -> tuple[str, ...]:
    """sglang's ServerArgs fields (a dataclass before 0.5.23, a msgspec Struct since), or () where sglang
    is not installed or its ServerArgs is neither (its options go unchecked)."""
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # not installed, or not importable here (no GPU build): nothing to check against
        return ()
    if dataclasses.is_dataclass(ServerArgs):
        return tuple(f.name for f in dataclasses.fields(ServerArgs))
    fields = getattr(ServerArgs, "__struct_fields__", None)  # 0.5.23 made it a msgspec Struct
    return tuple(fields) if fields else ()



def check_dagger_section(section: Any) -> None:
    """The DAgger section's own rules (``DAggerSchedule.__post_init__``) speak of CLI flags: said
    here of the recipe's field, with its JSON path."""
    if not isinstance(section, dict):
        return  # not an object: the section's conversion says so
    try:
        msgspec.convert(section, DAggerSchedule)
    except msgspec.ValidationError as e:
        text = str(e).split(" - at `", 1)[0]
        flag, sep, reason = text.partition(": ")
        field = next((f for f, name in DAGGER_FLAGS.items() if name == flag), None)
        if sep and field is not None:
            for f, name in DAGGER_FLAGS.items():
                reason = reason.replace(name, f"dagger.{f}")
            raise InputError("", f"$.dagger.{field}", reason) from None

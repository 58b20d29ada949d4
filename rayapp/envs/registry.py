"""Environments by name, as recipes refer to them: a built-in one by its name, a user's own by
import path (``my_pkg.my_env:ENV``, an ``Env``; see ``rayapp.envs.plugin_import``). Each built-in is one
module holding its rows, verifier, agent and DAgger agent:

- ``arithmetic``: the built-in ``a op b`` task, a single-turn chat agent, exact match;
- ``math``: arithmetic and word problems, a multi-turn agent with a calculator tool, exact match;
- ``humaneval``: the 164 HumanEval problems, a chat agent, verified by running the problem's tests
  in a sandbox placed in the sample's bundle;
- ``swe``: the mini-SWE repositories, a multi-turn agent with bash/read_file/write_file tools in a
  sandbox holding the repository, verified by the repository's own tests in that sandbox.

The multi-turn envs (``math``, ``swe``) also have a DAgger agent, used when the evaluator names a
``teacher`` engine: the same tools and verifier, with the roll-in of ``agents/dagger.py``.

A dataset's rows come from, first that is set: its ``path`` (a JSONL or Parquet file,
``datasets/files.py``), its ``source`` (a rows plug-in), or its env's own ``rows``.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from rayapp.envs import arithmetic, humaneval, math, swe, watch
from rayapp.envs.datasets.files import load_file
from rayapp.envs.datasets.source import DatasetSpec
from rayapp.envs.plugin_import import PluginError, is_import_path, load_env, load_rows
from rayapp.envs.protocol import Env
from rayapp.types import Task

ENVS: dict[str, Env] = {e.name: e for e in (arithmetic.ENV, math.ENV, humaneval.ENV, swe.ENV)}
MAX_SOURCE_ROWS = 1_000_000  # rows a source plug-in or an env may make: more is an endless generator, not a dataset


def get_env(name: str) -> Env:
    """A built-in env by name, or a user's by import path; one PluginError when neither."""
    if name in ENVS:
        return ENVS[name]
    if not is_import_path(name):
        raise PluginError(f"{name!r} is not one of {sorted(ENVS)} nor an import path ('package.module:ENV')")
    return load_env(name)


def dataset_rows(cfg: Any, name: str) -> list[Task]:
    """A recipe dataset's (``DatasetConfig``) rows, from its file, its source plug-in or its env.
    ``task_type``, when set, routes them to another evaluator."""
    env = get_env(cfg.env)
    if cfg.path is not None:  # a file's rows carry their task type already (``fields.task_type`` or this)
        return load_file(cfg.path, name, cfg.fields, task_type=cfg.task_type or env.name)
    if cfg.source is not None:
        rows = _read_rows(load_rows(cfg.source), cfg, f"data source {cfg.source!r}")
    elif env.rows is None:
        raise PluginError(f"env {cfg.env!r} has no rows of its own: dataset {name!r} needs a path or a source")
    else:
        rows = _read_rows(env.rows, cfg, f"env {cfg.env!r}")
    if cfg.task_type:
        rows = [msgspec.structs.replace(t, config=msgspec.structs.replace(t.config, task_type=cfg.task_type))
                if isinstance(t, Task) else t for t in rows]  # a non-Task is MultiDataSource's to name
    return rows


def _read_rows(rows: Any, cfg: Any, what: str) -> list[Any]:
    """``rows(cfg)`` read to a list of at most ``MAX_SOURCE_ROWS``; its ``sys.exit`` or KeyboardInterrupt
    is a PluginError, not the end of the process."""
    try:
        with watch.running(f"{what}: its rows(cfg)"):
            out = list(itertools.islice(rows(cfg), MAX_SOURCE_ROWS + 1))
    except SystemExit as e:
        raise PluginError(f"{what}: its rows(cfg) called sys.exit({e.code!r})") from None
    except KeyboardInterrupt:
        raise PluginError(f"{what}: its rows(cfg) raised KeyboardInterrupt") from None
    if len(out) > MAX_SOURCE_ROWS:
        raise PluginError(f"{what}: its rows(cfg) made more than {MAX_SOURCE_ROWS} rows (an endless generator?)")
    return out


def make_dataset(cfg: Any, name: str) -> DatasetSpec:
    """A recipe's dataset (``DatasetConfig``) as a MultiDataSource dataset."""
    return DatasetSpec(name, dataset_rows(cfg, name), weight=cfg.weight, dataset_cfg=dict(cfg.dataset_cfg),
                       n_samples_per_prompt=cfg.n_samples_per_prompt, shuffle=cfg.shuffle)

"""The recipe's environment keys checked before anything starts: each evaluator's ``env``, ``agent``,
``verifier`` and ``tools``, and each dataset's ``env``, ``path``, ``source`` and ``fields``. Built-in
names are looked up, import paths resolved (``rayapp.envs.plugin_import``: the module imported, the object
checked against its kind's protocol), and every problem is (JSON path, reason), first problem first,
as ``check_recipe`` reports them. Dataset files are read by the manager at its start; only
``check_dataset_files`` (``load_recipe``, on the user's side: ``rayapp validate``) reads them ahead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rayapp.envs import watch
from rayapp.envs.datasets.files import load_file, repeated_columns
from rayapp.envs.datasets.rows import DatasetError
from rayapp.envs.plugin_import import PluginError, load_agent_factory, load_rows, load_tool, load_verifier
from rayapp.envs.protocol import Env
from rayapp.envs.registry import ENVS, get_env


def _env(at: str, name: str) -> tuple[Env | None, tuple[str, str] | None]:
    try:
        with watch.field(f"{at}.env"):
            return get_env(name), None
    except PluginError as e:
        return None, (f"{at}.env", str(e))


def check_evaluator_env(at: str, ev: Any) -> Iterator[tuple[str, str]]:
    """An evaluator's env and its plug-ins resolve, and fit together: a verifier or tools replace
    the env's own only where it has them (or a plug-in agent takes them), a teacher needs a DAgger
    agent (the env's, or a plug-in agent, which gets the teacher as ``deps.teacher``)."""
    env, problem = _env(at, ev.env)
    if problem:
        yield problem
    for key, load in (("agent", load_agent_factory), ("verifier", load_verifier)):
        try:
            if getattr(ev, key) is not None:
                with watch.field(f"{at}.{key}"):
                    load(getattr(ev, key))
        except PluginError as e:
            yield f"{at}.{key}", str(e)
    for i, tool in enumerate(ev.tools or ()):
        try:
            with watch.field(f"{at}.tools[{i}]"):
                load_tool(tool)
        except PluginError as e:
            yield f"{at}.tools[{i}]", str(e)
    if env is None or ev.agent is not None or ev.gateway is not None:  # not the env's agent (gateway_config.py)
        return
    if ev.verifier is not None and env.verify is None:
        yield f"{at}.verifier", (f"env {ev.env!r} verifies inside the episode's sandbox, which a verifier "
                                 f"function cannot replace; give an agent plug-in that uses deps.verify")
    if ev.tools is not None and env.tools is None:
        yield f"{at}.tools", f"env {ev.env!r} runs an agent without tools; give an agent plug-in that uses deps.tools"
    if ev.teacher is not None and env.make_dagger_agent is None:
        dagger_envs = sorted(n for n, e in ENVS.items() if e.make_dagger_agent is not None)
        yield f"{at}.teacher", f"env {ev.env!r} has no DAgger agent; DAgger runs on {dagger_envs} or an agent plug-in"


def check_dataset_env(at: str, d: Any) -> Iterator[tuple[str, str]]:
    """A dataset's rows have one place to come from, and the mapping of a file fits."""
    env, problem = _env(at, d.env)
    if problem:
        yield problem
    if d.path is not None and d.source is not None:
        yield f"{at}.source", "a dataset reads a path or a source, not both"
    if d.source is not None:
        try:
            with watch.field(f"{at}.source"):
                load_rows(d.source)
        except PluginError as e:
            yield f"{at}.source", str(e)
    if d.path is None:
        if d.fields != type(d.fields)():
            yield f"{at}.fields", "fields map a file's columns: set path too"
        if d.source is None and env is not None and env.rows is None:
            yield f"{at}.path", f"env {d.env!r} has no rows of its own: give a path or a source"
        return
    repeated = repeated_columns(d.fields)
    if repeated:
        yield f"{at}.fields", f"columns named for two fields: {repeated}"
    if d.fields.task_type is not None and d.task_type is not None:
        yield f"{at}.task_type", "the file's rows carry their task type (fields.task_type): unset one of the two"


def check_dataset_files(recipe: Any) -> Iterator[tuple[str, str]]:
    """Every dataset file read as the manager will read it (``load_recipe`` made relative paths
    absolute against the recipe file's folder), so a bad row or a missing file shows, with the path
    tried, before a cluster starts."""
    for where in ("data", "eval"):
        for name, d in sorted(getattr(recipe, where).items()):
            if d.path is not None:
                try:
                    with watch.field(f"$.{where}.{name}.env"):
                        task_type = d.task_type or get_env(d.env).name
                    load_file(d.path, name, d.fields, task_type=task_type)
                except DatasetError as e:
                    yield f"$.{where}.{name}.path", str(e)

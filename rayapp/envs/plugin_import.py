"""Plug-ins by import path, as a recipe names them: ``"package.module:attr"`` (or ``package.module.attr``).

Each kind has one protocol, checked when the recipe is (``rayapp validate`` and the manager's start),
so a wrong path or object fails before any episode with one ``PluginError`` saying what is wrong:
the module is missing or fails to import, the attribute is missing, or the object has the wrong
type or signature. The recipe wraps it with the field's JSON path. A module's import is bounded:
one that calls ``sys.exit`` is an error, not an exit, and one still importing after
``plugin_timeout_s()`` is an error, not a hang (it is left running on a daemon thread); the error says
whether modules were still loading (slow) or not (blocked). A plug-in is
the user's own (or rayapp's) Python function or class: a C builtin (``os:system``) says nothing of its
shape, and anything of Python's standard library (``os:popen``, ``shutil:rmtree``: ``sys.stdlib_module_names``)
is no plug-in, whatever its shape: both are refused before any import. Each import is reported to
``rayapp.envs.watch`` while it runs.

| kind | recipe field | object |
| --- | --- | --- |
| env | ``evaluators[].env``, ``data.<n>.env`` | an ``Env`` (``rayapp.envs.protocol``) |
| agent | ``evaluators[].agent`` | ``factory(deps: AgentDeps) -> AgentHandler`` (a class taking deps will do) |
| gateway agent | ``evaluators[].gateway.agent`` | ``async agent(client: openai.AsyncOpenAI, task, sandbox) -> Any`` |
| verifier | ``evaluators[].verifier`` | ``verify(sample, result) -> dict[str, float]``, sync or async |
| tool | ``evaluators[].tools[]`` | ``async tool(arguments: dict, sandbox) -> str``, named by its attribute |
| data source | ``data.<n>.source`` | ``rows(cfg: DatasetConfig) -> Iterable[Task]`` |
| batching strategy | ``scheduler.batching`` | ``strategy(tasks, specs) -> list[Batch]`` (or a shipped one by name) |
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rayapp.core.agent import AgentHandler
from rayapp.core.batching import STRATEGIES, BatchingStrategy
from rayapp.envs import watch
from rayapp.envs.agents.tools import TOOLS, ToolFn
from rayapp.envs.protocol import AgentFactory, Env, RowsFn

# Seconds a plug-in module may take to import, and (under ``rayapp validate``) each call into plug-in
# code: an import of ``openai`` or ``agents`` on a loaded machine takes many seconds; the environment
# variable sets another limit where the machine is slower still.
IMPORT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "RAYAPP_PLUGIN_TIMEOUT_S"
# An import that loaded a module within this share of its limit before the end was still making progress.
_RECENT_SHARE = 0.25


class PluginError(ValueError):
    """A plug-in path that does not resolve to an object of its kind's protocol."""


def plugin_timeout_s(environ: Any = None) -> float:
    """The seconds a plug-in import (and a call into plug-in code under ``rayapp validate``) may take:
    ``RAYAPP_PLUGIN_TIMEOUT_S`` when set, else ``IMPORT_TIMEOUT_S``. A value that is not a positive
    number is a ``PluginError`` naming the variable."""
    raw = (os.environ if environ is None else environ).get(TIMEOUT_ENV, "").strip()
    if not raw:
        return IMPORT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise PluginError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def slow_or_stuck(timeout_s: float, loaded: int, since_last_s: float | None) -> str:
    """Why an import is still running after ``timeout_s``: still loading modules near the end (a slow
    import: give it more time) or not (it blocks or waits)."""
    more = f"if it is only slow, allow more with {TIMEOUT_ENV}=<seconds> (rayapp validate --plugin-timeout)"
    if since_last_s is not None and since_last_s <= _RECENT_SHARE * timeout_s:
        return (f"still importing after {timeout_s:g} s, slow: {loaded} modules loaded so far, the last "
                f"{since_last_s:.1f} s ago; {more}")
    idle = "no module loaded since it started" if since_last_s is None else \
        f"no module loaded in its last {since_last_s:.0f} s"
    return f"still importing after {timeout_s:g} s, {idle} (does the module block or wait at import?); {more}"


class _ImportProgress:
    """A finder first on ``sys.meta_path`` that finds nothing but notes, for each thread of a bounded
    import, how many modules it has started to import and when the last began: that import's
    progress, whatever other threads import meanwhile."""

    def __init__(self) -> None:
        self.by_thread: dict[int, tuple[int, float | None]] = {}

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        me = threading.get_ident()
        if me in self.by_thread:
            self.by_thread[me] = (self.by_thread[me][0] + 1, time.monotonic())


_PROGRESS = _ImportProgress()


def _import_bounded(name: str, timeout_s: float) -> Any:
    """``importlib.import_module(name)`` on a daemon thread, waited on for ``timeout_s``: an import
    that blocks (sleeps, waits on a socket or a lock) fails here instead of hanging its caller. Even a
    module already in ``sys.modules`` goes through the thread: one still importing there (it timed out
    before) would block this thread on its lock. The thread's module loads are noted
    (``_ImportProgress``), so a timeout can say whether the import was slow or stuck."""
    box: dict[str, Any] = {}
    if _PROGRESS not in sys.meta_path:
        sys.meta_path.insert(0, _PROGRESS)

    def run() -> None:
        _PROGRESS.by_thread[threading.get_ident()] = (0, None)
        try:
            box["module"] = importlib.import_module(name)
        except BaseException as e:  # SystemExit included: reported by the caller, never taken
            box["error"] = e
        finally:
            _PROGRESS.by_thread.pop(threading.get_ident(), None)

    thread = threading.Thread(target=run, name=f"import {name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        count, last = _PROGRESS.by_thread.get(thread.ident or 0, (0, None))
        since = None if last is None or count <= 1 else time.monotonic() - last  # its first is the module itself
        raise TimeoutError(slow_or_stuck(timeout_s, max(count - 1, 0), since))
    if "error" in box:
        raise box["error"]
    return box["module"]


def is_import_path(name: str) -> bool:
    """Built-in names are bare words; anything with a module part is an import path."""
    return ":" in name or "." in name


def _split(path: str, kind: str) -> tuple[str, str]:
    module, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module or not attr:
        raise PluginError(f"{kind} {path!r}: expected 'package.module:attr'")
    return module, attr


def import_object(path: str, kind: str, timeout_s: float | None = None) -> Any:
    """The object at ``path`` (``module:attr``, the attr may be dotted, or ``module.attr``), its
    module imported within ``timeout_s`` (None: ``plugin_timeout_s()``)."""
    module_name, attr = _split(path, kind)
    top = module_name.partition(".")[0]
    if top in sys.stdlib_module_names or top == "builtins":  # os:popen, subprocess:call, shutil:rmtree
        raise PluginError(f"{kind} {path!r}: {module_name!r} is Python's standard library (built-in), not a "
                          f"plug-in: name a function of your own package (or rayapp's)")
    try:
        with watch.running(f"{kind} {path!r}: importing {module_name!r}"):
            module = _import_bounded(module_name, plugin_timeout_s() if timeout_s is None else timeout_s)
    except TimeoutError as e:
        raise PluginError(f"{kind} {path!r}: importing {module_name!r}: {e}") from None
    except SystemExit as e:
        raise PluginError(f"{kind} {path!r}: importing {module_name!r} called sys.exit({e.code!r})") from None
    except KeyboardInterrupt:
        raise PluginError(f"{kind} {path!r}: importing {module_name!r} raised KeyboardInterrupt") from None
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise PluginError(f"{kind} {path!r}: no module named {e.name!r} (is its package on PYTHONPATH "
                              f"where the manager runs?)") from None
        raise PluginError(f"{kind} {path!r}: importing {module_name!r} failed: {e}") from None
    except Exception as e:  # the user's module raised while importing: say so, not which Ray call saw it
        raise PluginError(f"{kind} {path!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{kind} {path!r}: module {module_name!r} has no attribute {attr!r}"
                              + _namespace_hint(module))
        obj = getattr(obj, part)
    return obj


def _namespace_hint(module: Any) -> str:
    """Why a module lacks what its package defines when a folder of the same name, without an
    ``__init__.py``, came first on the import path: Python imports that folder as an empty namespace
    package (a project folder ``examples/wordplay`` shadows the package ``examples/wordplay/wordplay``
    when ``examples`` is on the path). Empty for a regular module."""
    if getattr(module, "__file__", None) is not None or not hasattr(module, "__path__"):
        return ""
    folders = [str(f) for f in module.__path__]
    leaf = module.__name__.rpartition(".")[2]
    inner = [f for f in folders if (Path(f) / leaf / "__init__.py").is_file() or (Path(f) / f"{leaf}.py").is_file()]
    hint = (f": {module.__name__!r} was imported from {', '.join(folders)}, a folder without __init__.py (an empty "
            f"namespace package), not the package")
    if inner:
        hint += f"; the package is inside it: put {inner[0]} on PYTHONPATH, not its parent (or pip install it)"
    return hint


def check_signature(obj: Any, n_args: int, kind: str, path: str, protocol: str) -> None:
    if not callable(obj):
        raise PluginError(f"{kind} {path!r}: a {type(obj).__name__} is not callable; expected {protocol}")
    if inspect.isbuiltin(obj) or (inspect.isclass(obj) and obj.__module__ == "builtins"):
        raise PluginError(f"{kind} {path!r}: a built-in {type(obj).__name__} ({getattr(obj, '__name__', obj)!r}); "
                          f"expected a Python function: {protocol}")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # no signature to read: say so rather than trust it
        raise PluginError(f"{kind} {path!r}: its signature cannot be read; expected {protocol}") from None
    try:
        signature.bind(*range(n_args))
    except TypeError:
        raise PluginError(f"{kind} {path!r}: takes {signature}, expected {protocol}") from None


def load_env(path: str) -> Env:
    obj = import_object(path, "env")
    if not isinstance(obj, Env):
        raise PluginError(f"env {path!r}: a {type(obj).__name__}, expected a rayapp.envs.protocol.Env")
    return obj


def _check_plain(obj: Any, kind: str, path: str, protocol: str) -> None:
    """A plug-in the wiring calls (not awaits) is a plain function: an ``async def`` one would hand
    back a coroutine where its result belongs."""
    if inspect.iscoroutinefunction(obj):
        raise PluginError(f"{kind} {path!r}: a coroutine function; it is called, not awaited: expected "
                          f"a plain def {protocol}")


def load_agent_factory(path: str) -> AgentFactory:
    obj = import_object(path, "agent")
    protocol = "factory(deps: AgentDeps) -> AgentHandler"
    check_signature(obj, 1, "agent", path, protocol)
    _check_plain(obj, "agent", path, protocol)
    return obj


def check_agent(agent: Any, made_by: str) -> AgentHandler:
    """What an agent factory returned, checked before any episode runs it."""
    if not isinstance(agent, AgentHandler):
        raise PluginError(f"agent {made_by!r}: returned a {type(agent).__name__}, expected an AgentHandler "
                          f"(async run(sample, ctx) and evaluate(sample, result, ctx))")
    return agent


def load_gateway_agent(path: str) -> Callable[..., Awaitable[Any]]:
    """An agent written against the OpenAI API (docs/agents.md): awaited once per episode."""
    obj = import_object(path, "gateway agent")
    protocol = "async def agent(client: openai.AsyncOpenAI, task, sandbox) -> what the verifier reads"
    check_signature(obj, 3, "gateway agent", path, protocol)
    if not inspect.iscoroutinefunction(obj):
        raise PluginError(f"gateway agent {path!r}: not a coroutine function; expected {protocol}")
    return obj


def load_verifier(path: str) -> Any:
    obj = import_object(path, "verifier")
    check_signature(obj, 2, "verifier", path, "verify(sample, result) -> dict[str, float]")
    return obj


def load_tool(name: str) -> tuple[str, ToolFn]:
    """A built-in tool by name, or a plug-in by path: (the name the model calls it by, the tool)."""
    if not is_import_path(name):
        if name not in TOOLS:
            raise PluginError(f"tool {name!r}: not one of {sorted(TOOLS)} nor an import path")
        return name, TOOLS[name]
    obj = import_object(name, "tool")
    protocol = "async tool(arguments: dict, sandbox) -> str"
    check_signature(obj, 2, "tool", name, protocol)
    if not inspect.iscoroutinefunction(obj):
        raise PluginError(f"tool {name!r}: not a coroutine function; expected {protocol}")
    return _split(name, "tool")[1].rpartition(".")[2], obj


def load_tools(names: list[str]) -> dict[str, ToolFn]:
    tools: dict[str, ToolFn] = {}
    for name in names:
        tool_name, fn = load_tool(name)
        if tool_name in tools:
            raise PluginError(f"tool {name!r}: a second tool named {tool_name!r}")
        tools[tool_name] = fn
    return tools


def load_rows(path: str) -> RowsFn:
    obj = import_object(path, "data source")
    protocol = "rows(cfg: DatasetConfig) -> Iterable[Task]"
    check_signature(obj, 1, "data source", path, protocol)
    _check_plain(obj, "data source", path, protocol)
    return obj


def load_strategy(name: str) -> BatchingStrategy:
    """A shipped batching strategy by name (``STRATEGIES``: fifo, longest_first, budget), or a plug-in by path."""
    if not is_import_path(name):
        if name not in STRATEGIES:
            raise PluginError(f"batching strategy {name!r}: not one of {sorted(STRATEGIES)} nor an import path")
        return STRATEGIES[name]
    obj = import_object(name, "batching strategy")
    protocol = "strategy(tasks: list[Task], specs: dict[str, EvaluatorSpec]) -> list[Batch]"
    check_signature(obj, 2, "batching strategy", name, protocol)
    _check_plain(obj, "batching strategy", name, protocol)
    return obj

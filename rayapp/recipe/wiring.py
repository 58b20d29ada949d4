"""A parsed recipe wired into what runs it: evaluator specs (each env's agent bound to its
resources), the rollout data source, the eval sets, the TaskScheduler, and the StepRunner around it.

The host lends what crosses process boundaries: engine clients by name, the pool client (None:
batches run ungated), ``executor`` (runs a plain function where a sample's token is reserved:
the Ray shell's ``run_in_bundle``), ``open_sandbox(token, *, kind, limits, image=...)`` and the
agent ``gateway`` an evaluator's ``gateway:`` agent talks through (None: the host serves none). So the
wiring imports no Ray, and a test wires a recipe with stand-ins.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rayapp.core.contracts import Pool
from rayapp.core.convert import InputError
from rayapp.core.scheduler import TaskScheduler
from rayapp.envs import watch
from rayapp.envs.datasets.source import DatasetSpec, MultiDataSource, eval_tasks
from rayapp.envs.plugin_import import (
    PluginError,
    check_agent,
    load_agent_factory,
    load_gateway_agent,
    load_tools,
    load_verifier,
)
from rayapp.envs.protocol import AgentDeps, Engine, Executor
from rayapp.envs.registry import get_env, make_dataset
from rayapp.envs.sandboxes import limits_from_resource
from rayapp.recipe.config import ARGS_SOURCE, DatasetConfig, EvaluatorConfig, RecipeConfig, RecipeError
from rayapp.recipe.environment import RunEnvironment, read_environment
from rayapp.recipe.runnable import rows_problem
from rayapp.steps.artifacts import EvalDetailsWriter
from rayapp.steps.checkpoint import RolloutCheckpoint
from rayapp.steps.dagger_schedule import DAggerIterations, StepIterations
from rayapp.steps.runner import StepRunner
from rayapp.steps.stacx_env import StacxEnv
from rayapp.types import EvaluatorSpec, Task

SandboxOpener = Callable[..., Awaitable[Any]]
CLIENT_SLACK_S = 30.0  # how much longer a gateway agent's client waits for a call than the engine call may take


def _evaluator_spec(at: str, ev: EvaluatorConfig, engines: Mapping[str, Engine], executor: Executor,
                    open_sandbox: SandboxOpener, gateway: Any = None,
                    request_timeout_s: float = 300.0) -> EvaluatorSpec:
    sb = ev.sandbox
    limits = limits_from_resource(ev.run_resource, wall_seconds=sb.wall_seconds, cpu_seconds=sb.cpu_seconds,
                                  network=sb.network)
    image = {"image": sb.image} if sb.image else {}
    opener = functools.partial(open_sandbox, kind=sb.kind, limits=limits, **image)
    with watch.field(f"{at}.verifier"):
        verify = load_verifier(ev.verifier) if ev.verifier else None
    with watch.field(f"{at}.tools"):
        tools = load_tools(ev.tools) if ev.tools is not None else None
    deps = AgentDeps(engines[ev.engine], executor, opener, teacher=engines[ev.teacher] if ev.teacher else None,
                     verify=verify, tools=tools, gateway=gateway)
    if ev.gateway is not None:
        return _spec(ev, _gateway_agent(at, ev, deps, request_timeout_s))
    with watch.field(f"{at}.agent"):
        factory = load_agent_factory(ev.agent) if ev.agent else None
    field, what = (f"{at}.agent", f"agent {ev.agent!r}") if factory else (f"{at}.env", f"env {ev.env!r}'s agent")
    try:
        with watch.field(field), watch.running(f"{what}: building it with AgentDeps"):
            agent = get_env(ev.env).build_agent(deps, dagger=ev.teacher is not None, factory=factory)
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # the factory's own error, named by its field
        said = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"failed: {type(e).__name__}: {e}"
        raise RecipeError(ARGS_SOURCE, field, f"{what}: building it with AgentDeps {said}") from None
    if factory is not None:  # what a plug-in made is known only now, with the engines at hand
        try:
            check_agent(agent, ev.agent)
        except PluginError as e:
            raise RecipeError(ARGS_SOURCE, f"{at}.agent", str(e)) from None
    return _spec(ev, agent)


def _spec(ev: EvaluatorConfig, agent: Any) -> EvaluatorSpec:
    return EvaluatorSpec(
        evaluator_id=ev.evaluator_id, handler=agent, resource=ev.resource, run_resource=ev.run_resource,
        eval_resource=ev.eval_resource, batch_size=ev.batch_size, default_stopping=ev.default_stopping,
        default_sampling=ev.default_sampling, eval_timeout_s=ev.eval_timeout_s,
    )


def _gateway_agent(at: str, ev: EvaluatorConfig, deps: AgentDeps, request_timeout_s: float) -> Any:
    """An evaluator's ``gateway`` agent (``rayapp.gateway.agents``), scored by the recipe's verifier or
    its env's, over the gateway the host serves."""
    if deps.gateway is None:
        raise RecipeError(ARGS_SOURCE, f"{at}.gateway", "this host serves no agent gateway (the Serve manager "
                                                         "does): run the recipe with serve run or rayapp run")
    from rayapp.gateway.agents import OpenAIAgent  # the gateway's pieces load only for a recipe that uses them

    gw = ev.gateway
    if gw.command is not None:
        from rayapp.gateway.command import CommandAgent

        agent = CommandAgent(list(gw.command), timeout_s=gw.command_timeout_s, collect=tuple(gw.collect))
    else:
        with watch.field(f"{at}.gateway.agent"):
            agent = load_gateway_agent(gw.agent)
    parser = None
    if gw.tool_parser.startswith("sglang:") and not isinstance(deps.gateway, _NoGateway):  # the manager, not validate
        from rayapp.gateway.sglang_tools import sglang_parser

        try:
            parser = sglang_parser(gw.tool_parser.removeprefix("sglang:"))
        except RuntimeError as e:
            raise RecipeError(ARGS_SOURCE, f"{at}.gateway.tool_parser", str(e)) from None
    try:
        # The client waits a little past the engine call's own limit, so the gateway's answer (an error
        # naming the engine's timeout) comes first.
        return OpenAIAgent(deps.gateway, deps.engine, agent, deps.verify or get_env(ev.env).verify,
                           executor=deps.executor, open_sandbox=deps.open_sandbox if gw.sandbox else None,
                           segments=gw.segments, call_timeout_s=request_timeout_s + CLIENT_SLACK_S,
                           tool_parser=parser)
    except RuntimeError as e:  # no openai package here
        raise RecipeError(ARGS_SOURCE, f"{at}.gateway.agent", str(e)) from None


def build_evaluator_specs(cfg: RecipeConfig, engines: Mapping[str, Engine], *, executor: Executor,
                          open_sandbox: SandboxOpener, gateway: Any = None) -> list[EvaluatorSpec]:
    """One EvaluatorSpec per recipe evaluator: its env's agent (the DAgger one when it names a
    teacher; its gateway agent over ``gateway`` when it has one) over the named engines, sandboxes
    limited by its run_resource."""
    return [_evaluator_spec(f"$.evaluators[{i}]", ev, engines, executor, open_sandbox, gateway,
                            cfg.engines[ev.engine].request_timeout_s)
            for i, ev in enumerate(cfg.evaluators)]


class _NoEngine:
    """What ``check_agents`` hands a factory for an engine: building an agent must not call one."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def generate(self, req: Any, timeout_s: float | None = None) -> Any:
        raise RuntimeError(f"engine {self.name!r} called while the agent was only being built")

    async def info(self) -> dict:
        raise RuntimeError(f"engine {self.name!r} called while the agent was only being built")


async def _no_work(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("an executor or sandbox used while the agent was only being built")


class _NoGateway:
    """What ``check_builds`` lends a gateway agent: building it must not open an episode."""

    def open(self, binding: Any) -> Any:
        raise RuntimeError("the gateway used while the agent was only being built")

    async def close(self, episode_id: str) -> Any:
        raise RuntimeError("the gateway used while the agent was only being built")


def check_builds(cfg: RecipeConfig) -> list[tuple[str, str]]:
    """Every evaluator's agent built as the manager will build it (its factory called with its
    AgentDeps, engines that must not be called yet) and every source plug-in's rows made, so a wrong
    factory or source (its rows fail, are none, or are not Tasks) fails here as (JSON path, reason)
    instead of at the deployment."""
    problems = []
    engines = {name: _NoEngine(name) for name in cfg.engines}
    for i, ev in enumerate(cfg.evaluators):
        try:
            _evaluator_spec(f"$.evaluators[{i}]", ev, engines, _no_work, _no_work, _NoGateway())
        except RecipeError as e:
            problems.append((e.path or f"$.evaluators[{i}]", e.reason))
    for where in ("data", "eval"):
        for name, d in sorted(getattr(cfg, where).items()):
            if d.source is not None:
                try:
                    problem = rows_problem(list(_dataset(where, name, d).rows), f"data source {d.source!r}")
                except RecipeError as e:
                    problems.append((e.path or f"$.{where}.{name}", e.reason))
                    continue
                if problem is not None:
                    problems.append((f"$.{where}.{name}.source", problem))
    return problems


def _dataset(where: str, name: str, d: DatasetConfig) -> DatasetSpec:
    """``make_dataset``, a source plug-in's own error (its rows failed) named by its field."""
    try:
        with watch.field(f"$.{where}.{name}.{'env' if d.source is None else 'source'}"):
            return make_dataset(d, name)
    except InputError:  # a file's bad row, a path that does not resolve: said with its place already
        raise
    except PluginError as e:  # its rows said what went wrong (sys.exit, too many rows), naming the source
        if d.source is None:
            raise
        raise RecipeError(ARGS_SOURCE, f"$.{where}.{name}.source", str(e)) from None
    except Exception as e:
        if d.source is None:
            raise
        raise RecipeError(ARGS_SOURCE, f"$.{where}.{name}.source", f"data source {d.source!r}: its rows failed: "
                                                                    f"{type(e).__name__}: {e}") from None


def build_data_source(cfg: RecipeConfig) -> MultiDataSource:
    """The rollout datasets in name order: Serve hands a config's args over with their keys sorted,
    so any other order would make the stream depend on how the recipe reached the process."""
    return MultiDataSource([_dataset("data", name, d) for name, d in sorted(cfg.data.items())], seed=cfg.scheduler.seed)


def build_eval_sets(cfg: RecipeConfig) -> dict[str, list[Task]]:
    """Each eval dataset's first ``n_prompts`` rows, by name."""
    return {name: eval_tasks(_dataset("eval", name, d), d.n_prompts) for name, d in sorted(cfg.eval.items())}


def build_scheduler(cfg: RecipeConfig, engines: Mapping[str, Engine], pool: Pool | None, *, executor: Executor,
                    open_sandbox: SandboxOpener, gateway: Any = None,
                    environment: RunEnvironment | None = None) -> TaskScheduler:
    """``environment``: the user-set variables (default: read from this process's now)."""
    s, env = cfg.scheduler, environment or read_environment(os.environ)
    return TaskScheduler(
        build_evaluator_specs(cfg, engines, executor=executor, open_sandbox=open_sandbox, gateway=gateway),
        build_data_source(cfg), pool, s.scheduler_config(), batching_strategy=s.strategy,
        eval_datasets=build_eval_sets(cfg),
        iteration=(DAggerIterations(cfg.dagger, env.eval_beta, env.static_t_max, observers=[StacxEnv()]) if cfg.dagger
                   else StepIterations(observers=[StacxEnv(dagger=False)])),
    )


def build_step_runner(cfg: RecipeConfig, engines: Mapping[str, Engine], pool: Pool | None, *, executor: Executor,
                      open_sandbox: SandboxOpener, release_previous: Callable[[], Awaitable[int]] | None = None,
                      gateway: Any = None, environment: RunEnvironment | None = None) -> StepRunner:
    """The recipe's scheduler inside its step pipeline: its filters, trajectory folder (reuse),
    checkpoint folder (mid-rollout checkpoints, and the latest steps' results: a restarted manager
    serves a finished step again rather than run it anew) and eval_details folder. ``environment``: the
    user-set variables (default: read from this process's now, the one moment they are read)."""
    s, env = cfg.scheduler, environment or read_environment(os.environ)
    checkpoint = RolloutCheckpoint(s.checkpoint_dir) if s.checkpoint_dir else None
    scheduler = build_scheduler(cfg, engines, pool, executor=executor, open_sandbox=open_sandbox, gateway=gateway,
                                environment=env)
    return StepRunner(scheduler, filters=cfg.filters.chain(), abort_cap=cfg.filters.abort_cap,
                      trajectory_dir=s.trajectory_dir, checkpoint=checkpoint,
                      details=(EvalDetailsWriter(s.save_eval_details, tokens=s.eval_details_tokens)
                               if s.save_eval_details else None),
                      release_previous=release_previous, partial=s.partial, reuse=env.reuse)

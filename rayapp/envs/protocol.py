"""What an environment is, and what an agent is lent: where its tasks come from, which agent runs them,
how they are scored, and the interfaces the agent reaches its host through.

Built-in environments (``rayapp.envs.arithmetic``, ``math``, ``humaneval``, ``swe``) and a user's
own (a recipe's ``env: "my_pkg.my_env:ENV"``) are the same thing: one module holding its rows, its
verifier, its agent and, where it has one, its DAgger agent, and one ``Env`` naming them. An agent is
an ``AgentHandler`` (``rayapp.core.agent``), built per evaluator from ``AgentDeps``: what the host
lends it (engines, the bundle executor, a sandbox opener, the agent gateway) and what the recipe
chose for it (the verifier and tools, a plug-in's or the env's own).

The interfaces of what is lent (``Engine``, ``Executor``, ``Verifier``, and ``EngineTokenizer``, an
engine's tokenizer loaded once) live here, beside ``AgentDeps`` that carries them: every agent
(``envs/agents``, the gateway's), the recipe wiring that lends them and the tests import them from
this one module, which imports no agent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from rayapp.core.agent import AgentHandler
from rayapp.envs.agents.tools import ToolFn
from rayapp.inference.client import GenerateOutput, GenerateRequest
from rayapp.types import AgentResult, Sample, Task, Token

# verify(sample, result) -> the sample's rewards, e.g. {"score": 1.0}; plain or async
Verifier = Callable[[Sample, AgentResult], dict[str, float] | Awaitable[dict[str, float]]]
# executor(token, fn, *args) runs fn(*args) where the token's resources are reserved
Executor = Callable[..., Awaitable[Any]]


class Engine(Protocol):
    """An inference engine as an agent reaches it (the host's engine client)."""

    async def generate(self, req: GenerateRequest, timeout_s: float | None = None) -> GenerateOutput: ...

    async def info(self) -> dict: ...


async def run_inline(token: Token | None, fn: Callable[..., Any], *args: Any) -> Any:
    """The executor when no placement group backs the token: a worker thread of this process."""
    return await asyncio.to_thread(fn, *args)


async def engine_tokenizer(engine: Engine) -> Any:
    """The tokenizer of the model ``engine`` serves (its files, as the engine's ``info`` names them)."""
    from transformers import AutoTokenizer

    info = await engine.info()
    return await asyncio.to_thread(AutoTokenizer.from_pretrained, info["tokenizer_path"], local_files_only=True)


class EngineTokenizer:
    """An engine's tokenizer, loaded once however many episodes ask for it at once: the first episodes
    of a step share one load instead of each loading its own. A load that failed is tried again by
    the next caller."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.value: Any = None
        self._loading: asyncio.Task | None = None

    async def get(self) -> Any:
        if self.value is None:
            loop, loading = asyncio.get_running_loop(), self._loading
            if (loading is None or loading.get_loop() is not loop
                    or (loading.done() and (loading.cancelled() or loading.exception() is not None))):
                self._loading = loading = loop.create_task(engine_tokenizer(self.engine))
            self.value = await asyncio.shield(loading)  # a caller that is cancelled leaves the load to the rest
        return self.value


# open_sandbox(token) -> an open Sandbox where the token's resources are reserved
OpenSandbox = Callable[[Token | None], Awaitable[Any]]
# rows(dataset_config) -> the dataset's tasks; the config is the recipe's DatasetConfig (seed, n_prompts, ...)
RowsFn = Callable[[Any], Iterable[Task]]


@dataclass(frozen=True)
class AgentDeps:
    """What an agent factory gets. ``verify`` and ``tools`` are what the agent should score with and
    offer: the recipe's plug-ins when it names them, else the env's own (``Env.verify``, ``Env.tools``)."""

    engine: Engine
    executor: Executor  # runs a plain function where the sample's token is reserved
    open_sandbox: OpenSandbox
    teacher: Engine | None = None  # the DAgger expert, for make_dagger_agent
    verify: Verifier | None = None  # None: the env's own
    tools: Mapping[str, ToolFn] | None = None  # None: the env's own
    gateway: Any = None  # the agent gateway the host serves (rayapp.gateway.service.Gateway); None: none


AgentFactory = Callable[[AgentDeps], AgentHandler]


@dataclass(frozen=True)
class Env:
    """One environment.

    - ``name``: the task type its rows carry (an evaluator of that id runs them);
    - ``rows(cfg)``: its tasks for a recipe dataset; None when it has none of its own (its datasets
      then name a ``path`` or a ``source``);
    - ``make_agent(deps)``: its agent; ``make_dagger_agent(deps)``: the DAgger one (student
      ``deps.engine``, teacher ``deps.teacher``), None when it has none;
    - ``verify(sample, result) -> {"score": ...}``: its plain verifier, which ``make_agent`` finds
      as ``deps.verify`` (a recipe's ``verifier`` replaces it); None when it verifies inside the
      episode's sandbox, where a plain function cannot stand in;
    - ``tools``: the tools its agent offers by name (``deps.tools``; a recipe's ``tools`` replaces
      them); None when its agent calls no tools.
    """

    name: str
    rows: RowsFn | None
    make_agent: AgentFactory
    make_dagger_agent: AgentFactory | None = None
    verify: Verifier | None = None
    tools: Mapping[str, ToolFn] | None = None

    def build_agent(self, deps: AgentDeps, *, dagger: bool = False,
                    factory: AgentFactory | None = None) -> AgentHandler:
        """The agent for one evaluator: ``factory`` (a recipe's agent plug-in) or the env's own
        (the DAgger one with ``dagger``), handed ``deps`` with the env's verifier and tools where
        ``deps`` names none."""
        make = factory or (self.make_dagger_agent if dagger else self.make_agent)
        if make is None:
            raise ValueError(f"env {self.name!r} has no DAgger agent")
        return make(replace(deps, verify=self.verify if deps.verify is None else deps.verify,
                            tools=self.tools if deps.tools is None else deps.tools))

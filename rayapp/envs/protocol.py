"""What an environment is: where its tasks come from, which agent runs them, how they are scored.

Built-in environments (``rayapp.envs.arithmetic``, ``math``, ``humaneval``, ``swe``) and a user's
own (a recipe's ``env: "my_pkg.my_env:ENV"``) are the same thing: one module holding its rows, its
verifier, its agent and, where it has one, its DAgger agent, and one ``Env`` naming them. An agent is
an ``AgentHandler`` (``rayapp.core.agent``), built per evaluator from ``AgentDeps``: what the host
lends it (engines, the bundle executor, a sandbox opener, the agent gateway) and what the recipe
chose for it (the verifier and tools, a plug-in's or the env's own).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from rayapp.core.agent import AgentHandler
from rayapp.envs.agents.chat import Engine, Executor, Verifier
from rayapp.envs.agents.tools import ToolFn
from rayapp.types import Task, Token

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

"""Environments by name, as recipes refer to them. Each makes its dataset and its agent:

- ``arithmetic``: the built-in ``a op b`` task, a single-turn chat agent, exact match;
- ``math``: arithmetic and word problems, a multi-turn agent with a calculator tool, exact match;
- ``humaneval``: the 164 HumanEval problems, a chat agent, verified by running the problem's tests
  in a sandbox placed in the sample's bundle;
- ``swe``: the mini-SWE repositories, a multi-turn agent with bash/read_file/write_file tools in a
  sandbox holding the repository, verified by the repository's own tests in that sandbox.

The multi-turn envs (``math``, ``swe``) also have a DAgger agent, used when the evaluator names a
``teacher`` engine: the same tools and verifier, with the roll-in of ``agents/dagger.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from rayapp.envs import arithmetic
from rayapp.envs.agents.chat import ChatAgent, Engine, Executor
from rayapp.envs.agents.dagger import DAggerAgent, DAggerRollIn
from rayapp.envs.agents.multiturn import ToolAgent
from rayapp.envs import humaneval, math, swe
from rayapp.envs.datasets.source import DatasetSpec
from rayapp.episode import EpisodeContext
from rayapp.types import AgentResult, Sample, Token

# open_sandbox(token) -> an open Sandbox where the token's resources are reserved
OpenSandbox = Callable[[Token | None], Awaitable[Any]]


@dataclass(frozen=True)
class AgentDeps:
    engine: Engine
    executor: Executor  # runs a plain function where the sample's token is reserved
    open_sandbox: OpenSandbox
    teacher: Engine | None = None  # the DAgger expert, for make_dagger_agent


@dataclass(frozen=True)
class Env:
    rows: Callable[[Any], list[Any]]  # (DatasetConfig) -> the dataset's tasks
    make_agent: Callable[[AgentDeps], Any]
    make_dagger_agent: Callable[[AgentDeps], Any] | None = None  # None: no DAgger variant


class CodeAgent(ChatAgent):
    """Writes a solution in one turn; the problem's tests run in a fresh sandbox in its bundle."""

    def __init__(self, deps: AgentDeps, timeout_s: float = 10.0):
        super().__init__(deps.engine, verify=None)
        self.open_sandbox, self.timeout_s = deps.open_sandbox, timeout_s

    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]:
        sandbox = await self.open_sandbox(ctx.token)
        try:
            return await humaneval.verify_in_sandbox(sandbox, sample.label, result.response, self.timeout_s)
        finally:
            await sandbox.close()


class SweAgent(ToolAgent):
    """Works in a sandbox holding the repository; the same sandbox is verified after the episode."""

    def __init__(self, deps: AgentDeps):
        async def sandbox_for(sample: Sample, ctx: EpisodeContext) -> Any:
            sandbox = await deps.open_sandbox(ctx.token)
            try:
                await swe.prepare_repo(sandbox, sample.label["repo"])
            except BaseException:
                await sandbox.close()
                raise
            return sandbox

        super().__init__(deps.engine, verify=None, tools=["bash", "read_file", "write_file"],
                         executor=deps.executor, sandbox_factory=sandbox_for, keep_sandbox=True)

    async def verify_in(self, sandbox: Any, sample: Sample, result: AgentResult) -> dict[str, float]:
        return await swe.verify_swe(sandbox, sample.label)


class DAggerSweAgent(DAggerRollIn, SweAgent):
    """mini-SWE with the DAgger roll-in: student and teacher act in the same sandbox."""

    def __init__(self, deps: AgentDeps, seed: int = 0):
        if deps.teacher is None:
            raise ValueError("DAggerSweAgent needs a teacher engine")
        super().__init__(deps)
        self.teacher, self.seed = deps.teacher, seed


def _arithmetic_rows(cfg: Any) -> list[Any]:
    return arithmetic.ArithmeticSource(cfg.seed).take(cfg.n_prompts)


ENVS: dict[str, Env] = {
    "arithmetic": Env(_arithmetic_rows, lambda d: ChatAgent(d.engine, arithmetic.verify, d.executor)),
    "math": Env(lambda cfg: math.generate_problems(cfg.n_prompts, cfg.seed),
                lambda d: ToolAgent(d.engine, math.verify, tools=["calculator"], executor=d.executor),
                lambda d: DAggerAgent(d.engine, d.teacher, math.verify, tools=["calculator"], executor=d.executor)),
    "humaneval": Env(lambda cfg: humaneval.load_humaneval(), CodeAgent),
    "swe": Env(lambda cfg: swe.load_swe_tasks(), SweAgent, DAggerSweAgent),
}


def get_env(name: str) -> Env:
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; known: {sorted(ENVS)}")
    return ENVS[name]


def make_dataset(cfg: Any, name: str) -> DatasetSpec:
    """A recipe's dataset (``DatasetConfig``) as a MultiDataSource dataset. ``task_type``, when set,
    routes the rows to another evaluator."""
    rows = get_env(cfg.env).rows(cfg)
    if cfg.task_type:
        rows = [msgspec.structs.replace(t, config=msgspec.structs.replace(t.config, task_type=cfg.task_type))
                for t in rows]
    return DatasetSpec(name, rows, weight=cfg.weight, dataset_cfg=dict(cfg.dataset_cfg),
                       n_samples_per_prompt=cfg.n_samples_per_prompt, shuffle=cfg.shuffle)

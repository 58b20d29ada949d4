"""The arithmetic environment: seeded ``a op b`` problems, a single-turn chat agent, exact match.

``ENV`` is what recipes name ``arithmetic``. The module also exercises the whole scheduler path in
one process with no model: ``toy_policy`` stands in for an inference engine (byte-level tokens,
seeded log-probs, a set error rate, a little latency) so rewards, truncation and aborts all occur.
"""

from __future__ import annotations

import asyncio
import math
import random
import re

from rayapp.core.agent import FunctionAgent
from rayapp.envs.agents.chat import ChatAgent
from rayapp.envs.protocol import AgentDeps, Env
from rayapp.episode import EpisodeContext
from rayapp.record import TerminationReason
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Sample, Task, TaskConfig

BOS, EOS, OFFSET = 1, 2, 3  # byte b is token b + OFFSET


def encode(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode()]


def decode(ids: list[int]) -> str:
    return bytes(i - OFFSET for i in ids if i >= OFFSET).decode(errors="replace")


class ArithmeticSource:
    """An endless, seeded stream of ``a op b`` problems; the cursor makes it resumable. (Recipes mix
    datasets through MultiDataSource, which stamps each task with its dataset's name and config.)"""

    def __init__(self, seed: int = 0, task_type: str = "arithmetic", n_samples: int = 1):
        self.seed, self.task_type, self.n_samples, self.cursor = seed, task_type, n_samples, 0

    def make_task(self, i: int) -> Task:
        rng = random.Random(f"{self.seed}:{i}")
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Task(f"{self.task_type}-{self.seed}-{i}", f"What is {a} {op} {b}?",
                    TaskConfig(self.task_type, n_samples=self.n_samples), label=str(answer))

    def take(self, n: int) -> list[Task]:
        """The next ``n`` tasks of the stream."""
        tasks = [self.make_task(i) for i in range(self.cursor, self.cursor + n)]
        self.cursor += n
        return tasks

    async def get_tasks(self, n: int) -> list[Task]:  # the scheduler's DataSource protocol
        return self.take(n)


def extract_answer(text: str) -> str | None:
    """The last integer in the text, as the exact-match verifier reads it."""
    found = re.findall(r"-?\d+", text)
    return found[-1] if found else None


def verify(sample: Sample, result: AgentResult) -> dict[str, float]:
    return {"score": 1.0 if extract_answer(result.response) == str(sample.label) else 0.0}


def toy_policy(error_rate: float = 0.2, latency_s: float = 0.01, seed: int = 0):
    """A plain agent function: answers right with probability 1 - error_rate."""

    async def run(sample: Sample, ctx: EpisodeContext) -> AgentResult:
        rng = random.Random(f"{seed}:{sample.task_id}:{sample.index}:{ctx.rollout_id}")
        await asyncio.sleep(latency_s * rng.random())
        answer = int(sample.label) + (rng.choice([-1, 1]) * rng.randint(1, 9) if rng.random() < error_rate else 0)
        prompt_ids = [BOS, *encode(str(sample.prompt))]
        response_ids = [*encode(f"The answer is {answer}."), EOS]
        reason, truncated = TerminationReason.STOP, False
        limit = ctx.stopping.max_context_len
        if limit is not None and len(prompt_ids) + len(response_ids) > limit:
            response_ids = response_ids[: max(0, limit - len(prompt_ids))]
            reason, truncated = TerminationReason.MAX_CONTEXT_LEN, True
        temperature = ctx.sampling.temperature if ctx.sampling.temperature is not None else 1.0
        log_probs = [math.log(rng.uniform(0.5, 1.0)) * temperature for _ in response_ids]
        return AgentResult(
            tokens=prompt_ids + response_ids, response_length=len(response_ids),
            response=decode(response_ids), rollout_log_probs=log_probs, loss_mask=[1] * len(response_ids),
            turns=1, termination_reason=reason, truncated=truncated,
        )

    return run


def arithmetic_spec(evaluator_id: str = "arithmetic", *, concurrency: int = 4, batch_size: int | None = 4,
                    gpu: float = 0.25, error_rate: float = 0.2, latency_s: float = 0.01) -> EvaluatorSpec:
    """The example's EvaluatorSpec: each sample holds a quarter GPU and one CPU."""
    return EvaluatorSpec(
        evaluator_id=evaluator_id,
        handler=FunctionAgent(toy_policy(error_rate, latency_s), verify),
        resource=Resource(gpu=concurrency * gpu, concurrency=concurrency, cpu=concurrency, memory_gb=4 * concurrency),
        run_resource=Resource(gpu=gpu, cpu=1, memory_gb=2),
        eval_resource=Resource(gpu=0, cpu=1, memory_gb=4),
        batch_size=batch_size,
    )


def rows(cfg) -> list[Task]:
    """A recipe dataset's rows: the first ``n_prompts`` problems of its ``seed``'s stream."""
    return ArithmeticSource(cfg.seed).take(cfg.n_prompts)


def make_agent(deps: AgentDeps) -> ChatAgent:
    return ChatAgent(deps.engine, deps.verify, deps.executor)


ENV = Env("arithmetic", rows, make_agent, verify=verify)

"""A single-turn chat agent over a real inference engine.

Run phase: the prompt goes through the model's chat template, the engine generates from token ids,
and the result keeps the engine's own token ids and log-probs (never a re-tokenisation of the
text), so what the trainer sees is what was sampled. Eval phase: the verifier runs through
``executor``, which the Ray shell points at the sample's placement-group bundle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from rayapp.core.clock import loop_time
from rayapp.core.termination import EngineConnectionError
from rayapp.envs.agents.base import BaseAgent
from rayapp.episode import RESUME_POINTS, EpisodeContext, ResumePoint
from rayapp.inference.client import FinishReason, GenerateOutput, GenerateRequest
from rayapp.types import AgentResult, Sample, TerminationReason, Token

Verifier = Callable[[Sample, AgentResult], dict[str, float]]
# executor(token, fn, *args) runs fn(*args) where the token's resources are reserved
Executor = Callable[..., Awaitable[Any]]


class Engine(Protocol):
    async def generate(self, req: GenerateRequest, timeout_s: float | None = None) -> GenerateOutput: ...

    async def info(self) -> dict: ...


async def run_inline(token: Token | None, fn: Callable[..., Any], *args: Any) -> Any:
    """The executor when no placement group backs the token: a worker thread of this process."""
    return await asyncio.to_thread(fn, *args)


class ChatAgent(BaseAgent):
    # A single turn has nothing to keep: a sample cut short runs its one turn again (partial rollouts).
    resumable = False

    def __init__(self, engine: Engine, verify: Verifier, executor: Executor = run_inline,
                 system_prompt: str | None = None):
        self.engine, self.verify, self.executor = engine, verify, executor
        self.system_prompt = system_prompt
        self._tokenizer: Any = None

    async def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            info = await self.engine.info()
            self._tokenizer = await asyncio.to_thread(
                AutoTokenizer.from_pretrained, info["tokenizer_path"], local_files_only=True)
        return self._tokenizer

    def resume_point(self, sample: Sample) -> ResumePoint | None:
        """Where ``sample`` goes on from (``RESUME_POINTS``, set by partial rollouts), taken out of
        its metadata; None when it starts afresh or this agent cannot resume (``resumable``)."""
        points = sample.metadata.pop(RESUME_POINTS, None)
        if not self.resumable or not points or sample.index >= len(points) or points[sample.index] is None:
            return None
        return msgspec.convert(points[sample.index], ResumePoint)

    def messages(self, sample: Sample) -> list[dict[str, Any]]:
        if isinstance(sample.prompt, list):
            return sample.prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": sample.prompt}]

    async def run(self, sample: Sample, ctx: EpisodeContext) -> AgentResult:
        tok = await self.tokenizer()
        prompt_ids = list(tok.apply_chat_template(self.messages(sample), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
        sampling = ctx.sampling
        limit = ctx.stopping.max_context_len
        if limit is not None:
            room = limit - len(prompt_ids)
            if room < 1:
                return AgentResult(tokens=prompt_ids, response_length=0, turns=0,
                                   termination_reason=TerminationReason.MAX_CONTEXT_LEN, truncated=True)
            cap = min(room, sampling.max_new_tokens or room)
            sampling = msgspec.structs.replace(sampling, max_new_tokens=cap)
        started = loop_time()
        out = await self.engine.generate(GenerateRequest(prompt_ids, sampling, stop_token_ids=[tok.eos_token_id]))
        if out.finish_reason is FinishReason.ABORT:
            raise EngineConnectionError(f"engine aborted request {out.request_id}")
        ctx.record_turn(1, out.engine, engine_s=loop_time() - started, weight_version=out.weight_version)
        truncated = out.finish_reason is FinishReason.LENGTH
        return AgentResult(
            tokens=prompt_ids + list(out.output_ids), response_length=len(out.output_ids),
            response=out.text, rollout_log_probs=list(out.logprobs), loss_mask=[1] * len(out.output_ids),
            turns=1, termination_reason=TerminationReason.LENGTH if truncated else TerminationReason.STOP,
            truncated=truncated,
        )

    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]:
        return await self.executor(ctx.token, self.verify, sample, result)

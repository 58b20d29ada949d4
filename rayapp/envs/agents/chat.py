"""A single-turn chat agent over a real inference engine.

Run phase: the prompt goes through the model's chat template, the engine generates from token ids,
and the result keeps the engine's own token ids and log-probs (never a re-tokenisation of the
text), so what the trainer sees is what was sampled. Eval phase: the verifier runs through
``executor``, which the Ray shell points at the sample's placement-group bundle.

Cut short mid-turn (partial rollouts: the step went on without the episode), a turn's request is
aborted at the engine and the tokens it had generated go into the episode's ``ResumePoint``
(``partial``); the resumed sample goes on generating that turn from them, under the then current
weights, so nothing the engine did is thrown away. The turn's text is the kept tokens' decoding
followed by the new output's (a multi-byte character split across the cut, or a stop string
spanning it, is the one thing this can miss).
"""

from __future__ import annotations

import inspect
from typing import Any

import msgspec

from rayapp.core.agent import AgentHandler
from rayapp.core.clock import loop_time
from rayapp.core.termination import EngineConnectionError
from rayapp.envs.agents.observation import length_reason, turn_budget
from rayapp.envs.protocol import Engine, EngineTokenizer, Executor, Verifier, run_inline
from rayapp.episode import EPISODE, EpisodeContext
from rayapp.inference.client import (
    DEFAULT_MAX_NEW_TOKENS,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    GenerationCut,
    generate_abortable,
    session_key,
)
from rayapp.record import ResumePoint, TerminationReason
from rayapp.types import AgentResult, Sample

Tail = tuple[list[int], list[float]]  # a cut turn's kept tokens and their log-probs


def cut_tail(point: ResumePoint | None) -> Tail:
    """The tokens (and log-probs) of the cut turn that ``point`` keeps; empty at a turn's end."""
    if point is None or not point.partial:
        return [], []
    return point.tokens[-point.partial:], point.rollout_log_probs[-point.partial:]


class ChatAgent(AgentHandler):
    # Cut short, it keeps the tokens its turn had generated and goes on from them (module docstring).
    resumable = True

    def __init__(self, engine: Engine, verify: Verifier, executor: Executor = run_inline,
                 system_prompt: str | None = None):
        self.engine, self.verify, self.executor = engine, verify, executor
        self.system_prompt = system_prompt
        self._tokenizer = EngineTokenizer(engine)

    async def tokenizer(self) -> Any:
        return await self._tokenizer.get()

    def resume_point(self, sample: Sample) -> ResumePoint | None:
        """Where ``sample`` goes on from (its record's ``start``, set by partial rollouts); None when
        it starts afresh or this agent cannot resume (``resumable``)."""
        return sample.episode.start if self.resumable else None

    def messages(self, sample: Sample) -> list[dict[str, Any]]:
        if isinstance(sample.prompt, list):
            return sample.prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": sample.prompt}]

    async def run(self, sample: Sample, ctx: EpisodeContext) -> AgentResult:
        tok = await self.tokenizer()
        point = self.resume_point(sample)
        if point is not None:  # the turn was cut short: its prompt and what it had generated are kept
            prompt_ids = point.tokens[:point.prompt_len]
            ctx.record.turn_records, ctx.record.resume = list(point.turn_records), point
        else:
            prompt_ids = list(tok.apply_chat_template(self.messages(sample), add_generation_prompt=True,
                                                      tokenize=True, return_dict=False))
        budget = turn_budget(ctx.sampling, ctx.stopping.max_context_len, len(prompt_ids))
        if budget is None:
            return AgentResult(tokens=prompt_ids, response_length=0, turns=0,
                               termination_reason=TerminationReason.MAX_CONTEXT_LEN, truncated=True)
        sampling, room = budget
        out, _ = await self.turn(tok, prompt_ids, cut_tail(point), sampling, 1, sample, ctx)
        truncated = out.finish_reason is FinishReason.LENGTH
        reason = length_reason(sampling, room, out) if truncated else TerminationReason.STOP
        return AgentResult(
            tokens=prompt_ids + list(out.output_ids), response_length=len(out.output_ids),
            response=out.text, rollout_log_probs=list(out.logprobs), loss_mask=[1] * len(out.output_ids),
            turns=1, termination_reason=reason, truncated=truncated,
        )

    async def turn(self, tok: Any, context: list[int], tail: Tail, sampling: Any, turn: int, sample: Sample,
                   ctx: EpisodeContext) -> tuple[GenerateOutput, int]:
        """Model turn ``turn`` after ``context`` (through ``act``), going on from ``tail``, the
        tokens a cut of this turn kept: the output is the whole turn, ``tail`` first. An engine
        that aborted the request on its own is an ``EngineConnectionError``."""
        ids, logprobs = tail
        budget = sampling.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        if ids and budget <= len(ids):  # the cut came as the turn's budget ran out
            ctx.record.turns = turn
            return GenerateOutput("", list(ids), list(logprobs), FinishReason.LENGTH, _decode(tok, ids)), 1
        if ids:
            sampling = msgspec.structs.replace(sampling, max_new_tokens=budget - len(ids))
        # every turn of the episode to one engine replica, which keeps the conversation's KV cache
        session = session_key(EPISODE.get() or f"{sample.task_id}#{sample.index}")
        req = GenerateRequest([*context, *ids], sampling, stop_token_ids=[tok.eos_token_id], session_id=session)
        out, weight = await self.act(req, turn, sample, ctx)
        if out.finish_reason is FinishReason.ABORT:
            raise EngineConnectionError(f"engine aborted request {out.request_id}")
        if ids:
            out = msgspec.structs.replace(out, output_ids=[*ids, *out.output_ids], logprobs=[*logprobs, *out.logprobs],
                                          text=_decode(tok, ids) + out.text)
        return out, weight

    async def act(self, req: GenerateRequest, turn: int, sample: Sample,
                  ctx: EpisodeContext) -> tuple[GenerateOutput, int]:
        """One model turn: the engine's output and the loss weight of its tokens (1: train on them)."""
        started = loop_time()
        out = await self.generate(req, turn, ctx)
        ctx.record_turn(turn, out.engine, engine_s=loop_time() - started, weight_version=out.weight_version)
        return out, 1

    async def generate(self, req: GenerateRequest, turn: int, ctx: EpisodeContext) -> GenerateOutput:
        """The engine's answer to ``req``, model turn ``turn``. Cut short meanwhile, the request is
        aborted at the engine and what it had generated is added to the episode's resume point
        (which then holds ``req``'s context and the cut turn's tokens); the cancellation goes on."""
        try:
            return await generate_abortable(self.engine, req)
        except GenerationCut as cut:
            out, base = cut.output, ctx.record.resume
            if base is None and turn == 1:
                base = ResumePoint(0, list(req.input_ids), len(req.input_ids), [], [])
            if out is not None and out.output_ids and base is not None and base.tokens == req.input_ids:
                record = ctx.turn_record(turn, out.engine, weight_version=out.weight_version)
                ctx.record.resume = base.with_cut_turn(list(out.output_ids), list(out.logprobs), record)
            raise

    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]:
        if inspect.iscoroutinefunction(self.verify):  # a coroutine cannot travel to a bundle: awaited here
            return await self.verify(sample, result)
        return await self.executor(ctx.token, self.verify, sample, result)


def _decode(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)

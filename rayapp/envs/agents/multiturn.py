"""A multi-turn tool-calling agent over a real inference engine.

Token data it guarantees, whatever happens in the episode:
- ``tokens`` = prompt + response; ``loss_mask`` and ``rollout_log_probs`` cover exactly the
  response (``response_length`` entries each);
- model tokens are the engine's own ids with its log-probs and mask 1; environment tokens (tool
  results, the chat template's turn markers) have mask 0 and log-prob 0.0;
- the episode stops by ``StoppingCriteria``: ``max_turns`` model turns, ``max_context_len`` tokens
  in all (generation is capped to the room left, and an observation that does not fit is cut and
  ends the episode), with the reason recorded and ``truncated`` set.

Environment tokens come from the model's own chat template: the text the template adds for a tool
message (plus the next generation prompt) after a closed assistant turn. This assumes a template
that renders each message on its own, as chat templates do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from rayapp.core.termination import EngineConnectionError, SandboxError
from rayapp.envs.agents.chat import ChatAgent, Engine, Executor, Verifier, run_inline
from rayapp.envs.agents.tools import SANDBOX_TOOLS, TOOLS, describe, parse_tool_call, tool_result_message
from rayapp.inference.client import FinishReason, GenerateOutput, GenerateRequest
from rayapp.types import AgentResult, EpisodeContext, Sample

# sandbox_factory(sample, ctx) -> an open Sandbox (closed by the agent at the end of the episode)
SandboxFactory = Callable[[Sample, EpisodeContext], Awaitable[Any]]
_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ToolAgent(ChatAgent):
    def __init__(self, engine: Engine, verify: Verifier | None, *, tools: list[str] | None = None,
                 executor: Executor = run_inline, sandbox_factory: SandboxFactory | None = None,
                 system_prompt: str | None = None, keep_sandbox: bool = False):
        tools = list(tools or ["calculator"])
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown:
            raise ValueError(f"unknown tools {unknown}; known: {sorted(TOOLS)}")
        if SANDBOX_TOOLS & set(tools) and sandbox_factory is None:
            raise ValueError(f"tools {sorted(SANDBOX_TOOLS & set(tools))} need a sandbox_factory")
        super().__init__(engine, verify, executor, system_prompt=(system_prompt or "") + describe(tools))
        self.tools, self.sandbox_factory = tools, sandbox_factory
        # keep_sandbox: the episode's sandbox stays open for the eval phase (``verify_in``), which
        # closes it; a failed run closes it at once.
        self.keep_sandbox = keep_sandbox
        self._kept: dict[int, Any] = {}

    def env_tokens(self, tok: Any, message: dict[str, str]) -> list[int]:
        """The template's tokens for ``message`` and the next generation prompt, after a closed turn."""
        before = tok.apply_chat_template(_PROBE, tokenize=False)
        after = tok.apply_chat_template([*_PROBE, message], add_generation_prompt=True, tokenize=False)
        if not after.startswith(before):
            raise ValueError("the chat template does not render messages one by one")
        return tok.encode(after[len(before):], add_special_tokens=False)

    async def run(self, sample: Sample, ctx: EpisodeContext) -> AgentResult:
        tok = await self.tokenizer()
        prompt = list(tok.apply_chat_template(self.messages(sample), add_generation_prompt=True, tokenize=True,
                                              return_dict=False))
        ids, mask, logprobs = list(prompt), [], []
        limit, max_turns = ctx.stopping.max_context_len, ctx.stopping.max_turns or 1
        reason, truncated, final_text = "max_turns", True, ""
        sandbox, kept = None, False
        if self.sandbox_factory is not None and SANDBOX_TOOLS & set(self.tools):
            sandbox = await self.sandbox_factory(sample, ctx)
        try:
            for turn in range(1, max_turns + 1):
                room = None if limit is None else limit - len(ids)
                if room is not None and room < 1:
                    reason = "max_context_len"
                    break
                cap = ctx.sampling.max_new_tokens or room
                if room is not None:
                    cap = min(room, cap or room)
                sampling = msgspec.structs.replace(ctx.sampling, max_new_tokens=cap)
                # a copy: the request is this turn's state, whoever keeps it (a DAgger label records it)
                req = GenerateRequest(list(ids), sampling, stop_token_ids=[tok.eos_token_id])
                out, weight = await self.act(req, turn, sample, ctx)
                if out.finish_reason is FinishReason.ABORT:
                    raise EngineConnectionError(f"engine aborted request {out.request_id}")
                ids += out.output_ids
                mask += [weight] * len(out.output_ids)
                logprobs += list(out.logprobs)
                final_text = out.text
                if out.finish_reason is FinishReason.LENGTH:
                    reason = "max_context_len" if room is not None and cap == room else "length"
                    break
                parsed = parse_tool_call(out.text)
                if parsed.final:
                    reason, truncated = "stop", False
                    break
                if turn == max_turns:
                    break  # the model still wanted a tool: max_turns
                observation = parsed.error or await self._call_tool(parsed.call, sandbox)
                env = self.env_tokens(tok, tool_result_message(parsed.call.name if parsed.call else "error",
                                                               observation))
                if out.output_ids[-1:] != [tok.eos_token_id]:
                    env = [tok.eos_token_id, *env]  # close the model's turn the way the template does
                if limit is not None and len(ids) + len(env) > limit:
                    env, reason = env[: limit - len(ids)], "max_context_len"
                ids += env
                mask += [0] * len(env)
                logprobs += [0.0] * len(env)
                if reason == "max_context_len":
                    break
            if sandbox is not None and self.keep_sandbox:
                self._kept[id(sample)], kept = sandbox, True
        finally:
            if sandbox is not None and not kept:
                await sandbox.close()
        return AgentResult(tokens=ids, response_length=len(ids) - len(prompt), response=final_text,
                           rollout_log_probs=logprobs, loss_mask=mask, turns=sample.metadata.get("_turns", 0),
                           termination_reason=reason, truncated=truncated)

    async def act(self, req: GenerateRequest, turn: int, sample: Sample,
                  ctx: EpisodeContext) -> tuple[GenerateOutput, int]:
        """One model turn: the engine's output and the loss weight of its tokens (1: train on them)."""
        out = await self.engine.generate(req)
        self._record_turn(sample, ctx, turn, out.engine)
        return out, 1

    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]:
        if not self.keep_sandbox:
            return await super().evaluate(sample, result, ctx)
        sandbox = self._kept.pop(id(sample), None)
        if sandbox is None:
            raise SandboxError(f"no sandbox kept for {sample.task_id}#{sample.index}")
        try:
            return await self.verify_in(sandbox, sample, result)
        finally:
            await sandbox.close()

    async def verify_in(self, sandbox: Any, sample: Sample, result: AgentResult) -> dict[str, float]:
        """The eval phase in the episode's own sandbox (with ``keep_sandbox``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its sandbox but does not verify in it")

    async def _call_tool(self, call: Any, sandbox: Any) -> str:
        if call.name not in self.tools:
            return f"error: unknown tool {call.name!r}; available: {', '.join(self.tools)}"
        return await TOOLS[call.name](call.arguments, sandbox)

    @staticmethod
    def _record_turn(sample: Sample, ctx: EpisodeContext, turn: int, engine: str, **extra: Any) -> None:
        sample.metadata["_turns"] = turn
        where = {"turn": turn, "engine": engine, **extra}
        if ctx.token is not None:
            where |= {"node": ctx.token.node, "gpu_ids": list(ctx.token.gpu_ids)}
        sample.metadata.setdefault("_turn_placement", []).append(where)

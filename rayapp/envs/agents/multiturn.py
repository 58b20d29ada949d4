"""A multi-turn tool-calling agent over a real inference engine.

It exists to run the built-in environments' tool loops with token data a trainer can use as it is.
Invariants, whatever happens in the episode: ``tokens`` = prompt + response, with ``loss_mask`` and
``rollout_log_probs`` covering exactly the response; model tokens are the engine's own ids with its
log-probs and mask 1, environment tokens (tool results, the chat template's markers) mask 0 and
log-prob 0.0; a turn ends at its tool call; the episode stops by ``StoppingCriteria`` with the
reason recorded. For partial rollouts it keeps a ``ResumePoint`` after each complete turn and goes
on from one. Token data, stopping and resume: docs/plugins.md, "The built-in environments and agents".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec

from rayapp.core.termination import SandboxError
from rayapp.envs.agents.chat import ChatAgent, cut_tail
from rayapp.envs.agents.observation import TokenData, length_reason, observation_tokens, turn_budget
from rayapp.envs.agents.tools import (
    SANDBOX_TOOLS,
    TOOLS,
    ParsedTurn,
    ToolFn,
    describe,
    parse_tool_call,
    tool_result_message,
    with_tool_stops,
)
from rayapp.envs.protocol import Engine, Executor, Verifier, run_inline
from rayapp.episode import EpisodeContext
from rayapp.inference.client import FinishReason, GenerateOutput
from rayapp.record import ResumePoint, TerminationReason, ToolReplay
from rayapp.types import AgentResult, Sample

# sandbox_factory(sample, ctx) -> an open Sandbox (closed after the run phase, or with keep_sandbox
# when the episode context closes)
SandboxFactory = Callable[[Sample, EpisodeContext], Awaitable[Any]]


class ToolAgent(ChatAgent):
    resumable = True  # its state is its token data and its sandbox, which replaying its calls rebuilds

    def __init__(self, engine: Engine, verify: Verifier | None, *,
                 tools: list[str] | Mapping[str, ToolFn] | None = None, executor: Executor = run_inline,
                 sandbox_factory: SandboxFactory | None = None, system_prompt: str | None = None,
                 keep_sandbox: bool = False):
        # built-in tools by name, or a mapping of name -> tool (plug-ins: rayapp.envs.plugin_import)
        if tools is None or not isinstance(tools, Mapping):
            names = list(tools or ["calculator"])
            unknown = sorted(set(names) - set(TOOLS))
            if unknown:
                raise ValueError(f"unknown tools {unknown}; known: {sorted(TOOLS)}")
            tools = {name: TOOLS[name] for name in names}
        if SANDBOX_TOOLS & set(tools) and sandbox_factory is None:
            raise ValueError(f"tools {sorted(SANDBOX_TOOLS & set(tools))} need a sandbox_factory")
        super().__init__(engine, verify, executor, system_prompt=(system_prompt or "") + describe(list(tools)))
        self.tools, self.tool_fns, self.sandbox_factory = list(tools), dict(tools), sandbox_factory
        # keep_sandbox: the episode's sandbox stays open for the verify phase (``verify_in``); the
        # episode context holds it and closes it when the episode ends, however it ends.
        self.keep_sandbox = keep_sandbox

    async def run(self, sample: Sample, ctx: EpisodeContext) -> AgentResult:
        tok = await self.tokenizer()
        point = self.resume_point(sample)
        prompt = point.tokens[:point.prompt_len] if point is not None else list(tok.apply_chat_template(
            self.messages(sample), add_generation_prompt=True, tokenize=True, return_dict=False))
        sandbox = await self._open_sandbox(sample, ctx)
        try:
            if point is not None and sandbox is not None:
                for call in point.tool_calls:  # the environment as the kept turns left it
                    await self._call_tool(call, sandbox)
            return await self._episode(tok, prompt, sample, ctx, sandbox, point)
        finally:
            if sandbox is not None and not self.keep_sandbox:
                await sandbox.close()

    async def _open_sandbox(self, sample: Sample, ctx: EpisodeContext) -> Any:
        if self.sandbox_factory is None or not SANDBOX_TOOLS & set(self.tools):
            return None
        sandbox = await self.sandbox_factory(sample, ctx)
        if self.keep_sandbox:
            ctx.keep("sandbox", sandbox, sandbox.close)
        return sandbox

    async def _episode(self, tok: Any, prompt: list[int], sample: Sample, ctx: EpisodeContext,
                       sandbox: Any, point: ResumePoint | None = None) -> AgentResult:
        data, calls, tail = TokenData(list(prompt)), [], cut_tail(point)
        if point is not None:  # the kept turns, as they were (the cut turn's tokens go on in ``tail``)
            kept = len(point.tokens) - point.partial
            data.ids, data.mask = point.tokens[:kept], point.loss_mask[:len(point.loss_mask) - point.partial]
            data.logprobs = point.rollout_log_probs[:len(point.rollout_log_probs) - point.partial]
            ctx.record.turns, ctx.record.turn_records = point.turns, list(point.turn_records)
            ctx.record.dagger_labels = list(point.dagger_labels)
            calls, ctx.record.resume = list(point.tool_calls), point  # cut short again at once: still from here
        limit, max_turns = ctx.stopping.max_context_len, ctx.stopping.max_turns or 1
        # generation pauses after a tool call: what the model would write past it is not its own
        sampling = msgspec.structs.replace(ctx.sampling, stop=with_tool_stops(ctx.sampling.stop))
        reason, final_text = TerminationReason.MAX_TURNS, ""
        for turn in range(point.turns + 1 if point is not None else 1, max_turns + 1):
            budget = turn_budget(sampling, limit, len(data.ids))
            if budget is None:
                reason = TerminationReason.MAX_CONTEXT_LEN
                break
            turn_sampling, room = budget
            out, weight = await self.turn(tok, list(data.ids), tail, turn_sampling, turn, sample, ctx)
            tail = ([], [])
            data.add(out.output_ids, weight, out.logprobs)
            final_text = out.text
            if out.finish_reason is FinishReason.LENGTH:  # the window full (the agent's or the engine's), or the budget
                reason = length_reason(turn_sampling, room, out)
                break
            parsed = parse_tool_call(out.text)
            if parsed.final:
                reason = TerminationReason.STOP
                break
            if turn == max_turns:
                break  # the model still wanted a tool: max_turns
            env, cut = await self._observe(tok, parsed, sandbox, out, None if limit is None else limit - len(data.ids))
            data.add(env, 0)
            if cut:
                reason = TerminationReason.MAX_CONTEXT_LEN
                break
            if parsed.call is not None and parsed.call.name in SANDBOX_TOOLS:
                calls.append(ToolReplay(parsed.call.name, dict(parsed.call.arguments)))
            ctx.record.resume = ResumePoint(turn, list(data.ids), len(prompt), list(data.mask), list(data.logprobs),
                                            list(ctx.record.turn_records), list(calls),
                                            list(ctx.record.dagger_labels))
        return AgentResult(tokens=data.ids, response_length=len(data.ids) - len(prompt), response=final_text,
                           rollout_log_probs=data.logprobs, loss_mask=data.mask, turns=ctx.record.turns or 0,
                           termination_reason=reason, truncated=reason is not TerminationReason.STOP)

    async def _observe(self, tok: Any, parsed: ParsedTurn, sandbox: Any, out: GenerateOutput,
                       room: int | None) -> tuple[list[int], bool]:
        """The environment's tokens after a turn that asked for a tool (the tool's answer in the
        chat template), and whether they had to be cut to the ``room`` left in the context."""
        observation = parsed.error or await self._call_tool(parsed.call, sandbox)
        message = tool_result_message(parsed.call.name if parsed.call else "error", observation)
        return observation_tokens(tok, [message], out.output_ids, room)

    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]:
        if not self.keep_sandbox:
            return await super().evaluate(sample, result, ctx)
        try:
            sandbox = ctx.kept("sandbox")
        except KeyError:
            raise SandboxError(f"no sandbox kept for {sample.task_id}#{sample.index}") from None
        return await self.verify_in(sandbox, sample, result)

    async def verify_in(self, sandbox: Any, sample: Sample, result: AgentResult) -> dict[str, float]:
        """The verify phase in the episode's own sandbox (with ``keep_sandbox``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its sandbox but does not verify in it")

    async def _call_tool(self, call: Any, sandbox: Any) -> str:
        if call.name not in self.tools:
            return f"error: unknown tool {call.name!r}; available: {', '.join(self.tools)}"
        return await self.tool_fns[call.name](call.arguments, sandbox)


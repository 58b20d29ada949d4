"""The agent gateway's service: one OpenAI-compatible entry point per running episode (docs/agents.md).

It exists so an agent written against the OpenAI API trains like a native one: ``Gateway.open``
binds an episode (its engine, tokenizer and ``EpisodeContext``) to a base URL and a key of its own,
``handle`` answers its routes (chat completions, ``/responses``, ``/completions``, streamed or not),
and ``close`` ends it and passes on what the trainer needs (``EpisodeLog``). Each call checks the key
before the body, then the body, plans the exact ids the engine continues from, enforces the
episode's budgets, generates and records the turn. Invariant: a key opens only its own episode and
stops working the moment the episode ends, a call then in flight being aborted at the engine. Pure:
no Ray, no HTTP server. Routes, budgets and sampling in full: docs/agents.md, "The endpoint".
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from rayapp.core.clock import loop_time
from rayapp.envs.agents.observation import length_reason, turn_budget
from rayapp.envs.agents.tools import with_tool_stops
from rayapp.envs.protocol import Engine
from rayapp.episode import EpisodeContext
from rayapp.gateway.accounting import Conversation, Segment, SegmentReason
from rayapp.gateway.episodes import EpisodeKeys
from rayapp.gateway.openai_api import ApiError, parse_chat, parse_completion, plain_message
from rayapp.gateway.responses import parse_responses, response_body
from rayapp.gateway.tool_calls import ToolParser, parse_reply, tool_mode, tools_tokenizer
from rayapp.inference.client import FinishReason, GenerateOutput, GenerateRequest, generate_abortable, session_key
from rayapp.record import TerminationReason
from rayapp.types import SamplingParams

__all__ = ["EpisodeBinding", "EpisodeLog", "Gateway", "Reply"]

log = logging.getLogger(__name__)

ROUTES = ("chat/completions", "completions", "responses", "models")
CALL_TIMEOUT_S = 600.0  # one engine call; past it the request is aborted at the engine (504)
CLOSE_TIMEOUT_S = 15.0  # close() waits this long for cancelled calls (their abort is bounded by 10 s)
# a body's bound from the episode's context: JSON bytes per token of context, generous (escaped text,
# tool schemas a template leaves out), and a floor for small contexts
BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 1 << 20
OFFLOAD_BYTES = 64 << 10  # a body this large is decoded, templated and tokenized in a worker thread
T = TypeVar("T")


@dataclass(frozen=True)
class EpisodeBinding:
    episode_id: str  # unique per running sample, no "/"
    engine: Engine
    tokenizer: Any
    ctx: EpisodeContext
    model: str = "rayapp"  # the name GET /models lists; any model name in a request is accepted
    tool_parser: ToolParser | None = None  # None: tool_calls.parse_reply's own


@dataclass
class Reply:
    """What a route answers: a JSON ``body`` (OpenAI's shape or its error shape), or an SSE ``stream``."""

    status: int
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None


@dataclass
class EpisodeLog:
    """What ``close`` hands back: every segment (in the order of their first call), the counts of
    why segments started, the model calls answered (chat and text completions: each is a model turn,
    and ``ctx.record.turns`` counts the same), and the termination a budget set (None: no budget
    ended the episode; the agent's own ending is the adapter's to classify)."""

    segments: list[Segment]
    reasons: dict[str, int]
    calls: int
    termination: TerminationReason | None


@dataclass(eq=False)
class _Episode:
    binding: EpisodeBinding
    convo: Conversation
    started: int = 0  # calls the engine was asked (max_turns counts these)
    answered: int = 0
    termination: TerminationReason | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)
    completions: list[Segment] = field(default_factory=list)
    closed: bool = False  # its log is handed back: nothing may be recorded into it any more

    def end(self, reason: TerminationReason) -> None:
        if self.termination is None:  # the first budget that ended it is the episode's reason
            self.termination = reason


class Gateway:
    def __init__(self, base_url: str, *, call_timeout_s: float = CALL_TIMEOUT_S):
        self.base_url = base_url.rstrip("/")
        self.call_timeout_s = call_timeout_s
        self.keys = EpisodeKeys()
        self._episodes: dict[str, _Episode] = {}

    def open(self, binding: EpisodeBinding) -> tuple[str, str]:
        """The episode's base URL (``.../gateway/<id>/v1``) and its key; ValueError for an id in use."""
        tok = tools_tokenizer(binding.tokenizer)
        key = self.keys.open(binding.episode_id)
        self._episodes[binding.episode_id] = _Episode(binding, Conversation(tok))
        return f"{self.base_url}/{binding.episode_id}/v1", key

    async def close(self, episode_id: str) -> EpisodeLog:
        """End the episode: its key answers 410 at once, its calls in flight are cancelled (aborted at
        the engine) and have ended when this returns. KeyError for an episode not open."""
        ep = self._episodes.pop(episode_id, None)
        if ep is None:
            raise KeyError(f"episode {episode_id!r} is not open on this gateway")
        self.keys.close(episode_id)
        ep.closed = True
        for task in ep.tasks:
            task.cancel()
        if ep.tasks:
            await asyncio.wait(set(ep.tasks), timeout=CLOSE_TIMEOUT_S)
        reasons = Counter(ep.convo.reasons)
        if ep.completions:
            reasons[SegmentReason.COMPLETION] += len(ep.completions)
        segments = sorted([*ep.convo.segments, *ep.completions], key=lambda s: s.turns[0][0])
        return EpisodeLog(segments, {str(k): v for k, v in reasons.items()}, ep.answered, ep.termination)

    def __len__(self) -> int:
        return len(self._episodes)

    def admit(self, episode_id: str, authorization: str | None) -> int | None:
        """The most bytes a body for the episode may have (None: its context is unbounded), once its
        key is right; else the ApiError (401 / 404 / 410). What the HTTP side asks before it reads a
        body, so a caller without the key, or a body no context of the episode could hold, costs
        nothing to refuse."""
        self.keys.check(episode_id, authorization)
        limit = self._episodes[episode_id].binding.ctx.stopping.max_context_len
        return None if limit is None else max(MIN_BODY_BYTES, limit * BYTES_PER_TOKEN)

    async def handle(self, episode_id: str, route: str, authorization: str | None, body: bytes) -> Reply:
        """Answer ``route`` for the episode; bad input is an error Reply, never an exception."""
        try:
            self.keys.check(episode_id, authorization)
            ep = self._episodes[episode_id]
            if route != "models":
                _not_ended(ep)
            if route == "models":
                return Reply(200, {"object": "list", "data": [
                    {"id": ep.binding.model, "object": "model", "created": 0, "owned_by": "rayapp"}]})
            if route in ("chat/completions", "responses"):
                return await self._tracked(ep, self._chat(ep, body, route == "responses"))
            if route == "completions":
                return await self._tracked(ep, self._completion(ep, body))
            raise ApiError(404, f"no route {route[:64]!r} here; the gateway serves {', '.join(ROUTES)}",
                           code="unknown_url")
        except ApiError as e:
            return Reply(e.status, e.body())
        except Exception as e:  # a bug here: the agent still gets OpenAI's shape, and the log the trace
            log.exception("gateway: %s for episode %r failed", route[:64], episode_id[:256])
            return Reply(500, ApiError(500, f"the gateway failed: {type(e).__name__}: {str(e)[:500]}",
                                       code="gateway_error").body())

    async def _tracked(self, ep: _Episode, work: Awaitable[Reply]) -> Reply:
        """Run one call as a task the episode knows, so ``close`` can cancel it; a call cut by
        ``close`` answers 410 (a caller cancelled itself sees its cancellation)."""
        task = asyncio.ensure_future(work)
        ep.tasks.add(task)
        task.add_done_callback(ep.tasks.discard)
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise
            raise ApiError(410, f"episode {ep.binding.episode_id!r} ended while this call ran; its "
                                "generation was aborted", code="episode_ended") from None

    # -- the routes ------------------------------------------------------------------------------

    async def _chat(self, ep: _Episode, body: bytes, responses: bool = False) -> Reply:
        """A chat completion; with ``responses``, a Responses API call as the chat call it stands for."""
        rec = ep.convo.snapshot()

        def plan() -> tuple[Any, Any, Any]:
            req = parse_responses(body) if responses else parse_chat(body)
            tools = [msgspec.to_builtins(t) for t in req.tools] if tool_mode(req.tools, req.tool_choice) else None
            return req, tools, ep.convo.plan(rec, req.messages, tools)

        req, tools, call = await _off_loop(plan, len(body))
        sampling, room, turn = self._admit(ep, len(call.ids), req, req.budget(), bool(tools))
        out = await self._generate(ep, call.ids, sampling, turn)
        tok = ep.convo.tok
        reply = parse_reply(tok, _reply_text(tok, out, sampling.stop, bool(tools)), call.text, tools,
                            ep.binding.tool_parser)
        message = reply.message()
        ep.convo.record(call, out.output_ids, out.logprobs, message, index=turn - 1)
        self._done(ep, out, sampling, room)
        finish = "length" if out.finish_reason is FinishReason.LENGTH else "tool_calls" if reply.tool_calls else "stop"
        logprobs = {"content": _logprobs(tok, out)} if req.logprobs else None
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": ep.binding.model}
        usage = _usage(len(call.ids), out)
        if responses:
            return Reply(200, response_body(ep.binding.model, message, finish, usage, logprobs and logprobs["content"]))
        if not req.stream:
            return Reply(200, {**head, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}]})
        head["object"] = "chat.completion.chunk"

        def chunk(delta: dict[str, Any], finish: str | None = None, lps: Any = None) -> dict[str, Any]:
            return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lps}]}

        chunks = [chunk({"role": "assistant", "content": ""})]
        if message["content"] or logprobs:  # the log-probs of every token ride with the content
            chunks.append(chunk({"content": message["content"] or ""}, lps=logprobs))
        if reply.tool_calls:
            chunks.append(chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(reply.tool_calls)]}))
        chunks.append(chunk({}, finish))
        if req.stream_options is not None and req.stream_options.include_usage:
            chunks.append({**head, "choices": [], "usage": usage})
        return Reply(200, stream=_sse(chunks))

    async def _completion(self, ep: _Episode, body: bytes) -> Reply:
        tok = ep.convo.tok

        def plan() -> tuple[Any, list[int]]:
            req = parse_completion(body)
            return req, list(req.prompt) if isinstance(req.prompt, list) else list(tok.encode(req.prompt))

        req, prompt = await _off_loop(plan, len(body))
        sampling, room, turn = self._admit(ep, len(prompt), req, req.max_tokens, False)
        out = await self._generate(ep, prompt, sampling, turn)
        n = len(out.output_ids)
        ep.completions.append(Segment(ids=prompt + list(out.output_ids), prompt_len=len(prompt),
                                      reason=SegmentReason.COMPLETION, mask=[1] * n,
                                      logprobs=[float(x) for x in out.logprobs],
                                      turns=[(turn - 1, len(prompt), len(prompt) + n)]))
        self._done(ep, out, sampling, room)
        text = _reply_text(tok, out, sampling.stop, False)
        finish = "length" if out.finish_reason is FinishReason.LENGTH else "stop"
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": ep.binding.model}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if not req.stream:
            return Reply(200, {**head, "choices": [choice], "usage": _usage(len(prompt), out)})
        chunks = [{**head, "choices": [{**choice, "finish_reason": None}]},
                  {**head, "choices": [{**choice, "text": "", "finish_reason": finish}]}]
        if req.stream_options is not None and req.stream_options.include_usage:
            chunks.append({**head, "choices": [], "usage": _usage(len(prompt), out)})
        return Reply(200, stream=_sse(chunks))

    # -- budgets, the engine ---------------------------------------------------------------------

    def _admit(self, ep: _Episode, prompt_len: int, req: Any, asked: int | None,
               tools: bool) -> tuple[SamplingParams, int | None, int]:
        """The call's sampling, the context room it has (None: no limit) and its turn number; or the
        400 of a budget it is past (which ends the episode with that reason)."""
        _not_ended(ep)  # again: a call of the episode may have ended it while this one was planned
        ctx = ep.binding.ctx
        max_turns = ctx.stopping.max_turns or 1
        if ep.started >= max_turns:
            ep.end(TerminationReason.MAX_TURNS)
            raise ApiError(400, f"this episode's max_turns ({max_turns} model calls) is used up; the episode is over "
                                "its turn budget", code="max_turns_exceeded")
        base = ctx.sampling
        cap = base.max_new_tokens
        asked = min(asked, cap) if asked is not None and cap is not None else asked
        limit = ctx.stopping.max_context_len
        if limit is not None and (prompt_len >= limit or (asked is not None and prompt_len + asked > limit)):
            ep.end(TerminationReason.MAX_CONTEXT_LEN)
            raise ApiError(400, f"this episode's max_context_len is {limit} tokens; this call asks for {prompt_len} "
                                f"in the messages" + (f" and {asked} in the completion" if asked is not None else "") +
                                "; the episode is over its context budget", param="messages",
                           code="context_length_exceeded")
        own = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop = [*(base.stop or []), *(s for s in own if s not in (base.stop or []))]
        sampling = msgspec.structs.replace(
            base, temperature=_pick(req.temperature, base.temperature), top_p=_pick(req.top_p, base.top_p),
            seed=_pick(req.seed, base.seed), max_new_tokens=asked if asked is not None else cap,
            stop=(with_tool_stops(stop) if tools else stop) or None)
        sampling, room = turn_budget(sampling, limit, prompt_len)
        ep.started += 1
        return sampling, room, ep.started

    async def _generate(self, ep: _Episode, ids: list[int], sampling: SamplingParams, turn: int) -> GenerateOutput:
        tok, engine = ep.convo.tok, ep.binding.engine
        # the episode is the session: its calls stay on one engine replica, whose prefix/KV cache holds its turns
        req = GenerateRequest(list(ids), sampling, stop_token_ids=[tok.eos_token_id],
                              session_id=session_key(ep.binding.episode_id))
        started = loop_time()
        try:
            async with asyncio.timeout(self.call_timeout_s):
                out = await generate_abortable(engine, req)
        except TimeoutError:
            raise ApiError(504, f"the engine did not answer within {self.call_timeout_s:g} s; the request was "
                                "aborted at the engine", code="engine_timeout") from None
        except ValueError as e:  # the agent sees one line; the log keeps the whole error
            log.info("gateway: the engine refused a call of episode %r: %s", ep.binding.episode_id, e)
            raise ApiError(400, f"the engine refused the request: {plain_message(e)}", code="invalid_value") from None
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # the engine's replica failed or could not be reached
            log.warning("gateway: the engine failed a call of episode %r: %s", ep.binding.episode_id, e)
            raise ApiError(503, f"the engine failed: {plain_message(e, named=True)}", code="engine_error") from None
        if out.finish_reason is FinishReason.ABORT:
            raise ApiError(503, f"the engine aborted request {out.request_id}", code="engine_error")
        if ep.closed:  # answered as the episode ended (its abort came too late): the log is final
            raise ApiError(410, f"episode {ep.binding.episode_id!r} ended while this call ran", code="episode_ended")
        ep.binding.ctx.record_turn(turn, out.engine, engine_s=loop_time() - started,
                                   weight_version=out.weight_version)
        return out

    def _done(self, ep: _Episode, out: GenerateOutput, sampling: SamplingParams, room: int | None) -> None:
        ep.answered += 1
        if out.finish_reason is FinishReason.LENGTH and \
                length_reason(sampling, room, out) is TerminationReason.MAX_CONTEXT_LEN:
            ep.end(TerminationReason.MAX_CONTEXT_LEN)


async def _off_loop(work: Callable[[], T], size: int) -> T:
    """``work()``, in a worker thread for a body of ``OFFLOAD_BYTES`` or more (a small one costs less
    than the thread hop)."""
    return await asyncio.to_thread(work) if size >= OFFLOAD_BYTES else work()


def _not_ended(ep: _Episode) -> None:
    if ep.termination is not None:
        raise ApiError(410, f"episode {ep.binding.episode_id!r} has ended at its {ep.termination} "
                            "budget; its sample is final", code="episode_ended")


def _pick(asked: Any, default: Any) -> Any:
    return asked if asked is not None else default


def _reply_text(tok: Any, out: GenerateOutput, stop: list[str] | None, tools: bool) -> str:
    """The reply's text from the engine's ids: cut before the stop string that ended it (OpenAI leaves
    it out), except a tool call's own closing tag, which the tool-call parser reads."""
    text = tok.decode(list(out.output_ids), skip_special_tokens=True)
    if out.finish_reason is not FinishReason.STOP or not stop:
        return text
    found = [(i, s) for s in stop if (i := text.find(s)) >= 0]
    if not found:
        return text  # ended by an end-of-turn token
    at, s = min(found)
    return text[:at + len(s)] if tools and s in with_tool_stops(None) else text[:at]


def _logprobs(tok: Any, out: GenerateOutput) -> list[dict[str, Any]]:
    """One entry per generated token, as the engine gave it (the end-of-turn token included)."""
    pieces = [tok.decode([t], skip_special_tokens=False) for t in out.output_ids]
    return [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
            for p, lp in zip(pieces, out.logprobs, strict=True)]


def _usage(prompt_len: int, out: GenerateOutput) -> dict[str, int]:
    n = len(out.output_ids)
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


async def _sse(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"

"""One episode's conversation as the trainer will see it: the gateway's token accounting.

An agent speaking the OpenAI API sends its whole message history on every call; the trainer needs
one token sequence in which every token is either an id the engine generated (loss mask 1, with the
engine's log-prob) or a token the chat template rendered (mask 0), never a re-tokenisation of
generated text. ``Conversation`` keeps that sequence in two steps per call, ``prepare`` (the ids the
engine continues from) and ``record`` (commit the reply), so a call the engine never answers leaves
nothing behind; a request that does not extend the recording starts a new segment, its reason
counted (``reasons``). Invariant: each reply's context in a segment is exactly what the engine was
given. How and why segments start: docs/agents.md, "What is recorded" and "The mismatch counters".
Pure: no Ray, no HTTP; a Hugging Face tokenizer.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
from jinja2 import TemplateError

from rayapp.envs.agents.observation import closing_text, turn_end
from rayapp.gateway.openai_api import ApiError

__all__ = ["Call", "Conversation", "Recorded", "Segment", "SegmentReason"]

_ROLES = ("system", "developer", "user", "assistant", "tool")


class SegmentReason(enum.StrEnum):
    """Why a new segment started instead of the recording being extended."""

    HISTORY_EDITED = "history_edited"
    TOOLS_CHANGED = "tools_changed"
    TEMPLATE_REWRITE = "template_rewrite"
    CONCURRENT = "concurrent"
    COMPLETION = "completion"  # a text completion (``/completions``): its own segment, never a chat's continuation


class Segment(msgspec.Struct):
    """One token sequence for the trainer: ``ids`` (the prompt's ``prompt_len`` first), and for the
    response ``mask`` (1: engine ids, 0: template tokens) and ``logprobs`` (0.0 on template tokens).
    ``turns`` holds ``(call, start, end)`` per reply: the episode's call index and where its ids sit
    in ``ids``. ``reason`` says why the segment started (None: the episode's first)."""

    ids: list[int]
    prompt_len: int
    reason: SegmentReason | None = None
    mask: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)
    turns: list[tuple[int, int, int]] = msgspec.field(default_factory=list)


class Call(msgspec.Struct, frozen=True):
    """A planned call: the engine continues from ``ids``. ``added`` is what the plan puts after the
    recording (the whole prompt when ``fresh``: a new segment, for ``reason``); ``text`` is the
    template's text of the prompt; ``base`` the recording's version it was planned on."""

    ids: list[int]
    added: list[int]
    fresh: bool
    reason: SegmentReason | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    text: str
    base: int


class Recorded(NamedTuple):
    """A snapshot of a conversation's recording (``Conversation.snapshot``): the last segment's ids
    (None: nothing recorded), the recorded messages and tools, the last prompt text, the version."""

    ids: list[int] | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    text: str
    version: int


class Conversation:
    """One episode's token accounting (module docstring)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.segments: list[Segment] = []  # all but the last are closed
        self.reasons: Counter[str] = Counter()
        self._messages: list[dict[str, Any]] = []  # recorded: the last call's messages and its reply
        self._tools: list[dict[str, Any]] | None = None
        self._text = ""  # the last recorded call's prompt text
        self._version = 0  # bumped by every record

    def prepare(self, messages: Sequence[Any], tools: Sequence[Any] | None = None) -> Call:
        """The plan of a chat call with these messages (OpenAI's, as dicts or ``Message``s) and tools."""
        return self.plan(self.snapshot(), messages, tools)

    def snapshot(self) -> Recorded:
        """The recording as it stands, for ``plan``: taken where calls are recorded (the event loop)."""
        ids = list(self.segments[-1].ids) if self.segments else None
        return Recorded(ids, self._messages, self._tools, self._text, self._version)

    def plan(self, rec: Recorded, messages: Sequence[Any], tools: Sequence[Any] | None = None) -> Call:
        """``prepare`` on ``rec``: reads nothing of this conversation but its tokenizer, so it may run
        in another thread; a reply recorded meanwhile makes the call ``concurrent`` (``record``)."""
        msgs = [_message(m, i) for i, m in enumerate(messages)]
        tools = [_tool(t) for t in tools] if tools else None
        if rec.ids is None:
            return self._fresh(msgs, tools, None, rec.version)
        if _canon(tools) != _canon(rec.tools):
            return self._fresh(msgs, tools, SegmentReason.TOOLS_CHANGED, rec.version)
        n = len(rec.messages)
        if len(msgs) < n or any(_key(a) != _key(b) for a, b in zip(msgs, rec.messages, strict=False)):
            return self._fresh(msgs, tools, SegmentReason.HISTORY_EDITED, rec.version)
        # the recorded messages stand for the request's equal ones: what the gateway returned is what
        # the engine generated from (an agent's copy may lack e.g. the reasoning it was sent)
        convo = rec.messages + msgs[n:]
        closed, full = self._render(rec.messages, tools, False), self._render(convo, tools, True)
        end_text, _ = turn_end(self.tok)
        if not (closed.startswith(rec.text) and closed.endswith(end_text) and full.startswith(closed)):
            return self._fresh(msgs, tools, SegmentReason.TEMPLATE_REWRITE, rec.version)
        # what closes the engine's turn as the template does (less what the engine generated of it)
        added = self._encode(closing_text(self.tok, rec.ids) + full[len(closed):])
        return Call(ids=rec.ids + added, added=added, fresh=False, reason=None, messages=convo, tools=tools,
                    text=full, base=rec.version)

    def record(self, call: Call, output_ids: Sequence[int], logprobs: Sequence[float], message: Any,
               index: int | None = None) -> Segment:
        """The engine's reply to ``call``: its ``output_ids`` and their ``logprobs`` as the engine gave
        them, and ``message``, the assistant message returned to the agent. Returns its segment.
        ``index`` is the call's index in the episode for ``Segment.turns`` (default: this
        conversation's count of records; the gateway passes its own, which counts every route)."""
        if len(logprobs) != len(output_ids):
            raise ValueError(f"record: {len(output_ids)} output ids but {len(logprobs)} log-probs")
        reply = _message(message, len(call.messages))
        if reply["role"] != "assistant":
            raise ValueError(f"record: the reply is an assistant message, not {reply['role']!r}")
        reason = call.reason
        if call.base != self._version:  # another call's reply was recorded since this one was planned
            reason = reason or SegmentReason.CONCURRENT
        if call.fresh or call.base != self._version:
            self.segments.append(Segment(ids=list(call.ids), prompt_len=len(call.ids), reason=reason))
            if reason is not None:
                self.reasons[reason] += 1
        seg = self.segments[-1]
        if not call.fresh and call.base == self._version:
            seg.ids += call.added
            seg.mask += [0] * len(call.added)
            seg.logprobs += [0.0] * len(call.added)
        seg.turns.append((self._version if index is None else index, len(seg.ids), len(seg.ids) + len(output_ids)))
        seg.ids += output_ids
        seg.mask += [1] * len(output_ids)
        seg.logprobs += [float(x) for x in logprobs]
        self._messages, self._tools, self._text = [*call.messages, reply], call.tools, call.text
        self._version += 1
        return seg

    def _fresh(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               reason: SegmentReason | None, base: int) -> Call:
        text = self._render(msgs, tools, True)
        ids = self._encode(text)
        return Call(ids=ids, added=ids, fresh=True, reason=reason, messages=msgs, tools=tools, text=text,
                    base=base)

    def _render(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None, prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=prompt, tokenize=False)
        except TemplateError as e:
            raise ApiError(400, f"the model's chat template refused the messages: {e}", param="messages") from None

    def _encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))  # the template writes its own markers


def _message(m: Any, i: int) -> dict[str, Any]:
    """An OpenAI message as the chat template takes it: text content, unset fields left out."""
    d = msgspec.to_builtins(m) if isinstance(m, msgspec.Struct) else m
    if not isinstance(d, dict) or d.get("role") not in _ROLES:
        raise ApiError(400, f"messages[{i}]: expected a message with a role in {_ROLES}", param=f"messages[{i}]")
    content = d.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ApiError(400, f"messages[{i}].content: text parts only", param=f"messages[{i}].content")
        content = "".join(p.get("text", "") for p in content)
    out = {"role": d["role"], "content": content or ""}
    out.update((k, d[k]) for k in ("name", "tool_call_id", "reasoning_content") if d.get(k) is not None)
    if d.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                             for c in d["tool_calls"]]
    return out


def _tool(t: Any) -> dict[str, Any]:
    """An OpenAI tool as the chat template takes it (a typed one's unset fields left out)."""
    d = msgspec.to_builtins(t)
    return {**d, "function": {k: v for k, v in d.get("function", {}).items() if v is not None}}


def _key(m: dict[str, Any]) -> tuple:
    """What must be equal for a message to count as the recorded one (reasoning is not compared:
    agents need not send it back, and the recorded copy is the one the engine continues from)."""
    calls = tuple((c["id"], c["function"]["name"], _canon(c["function"]["arguments"])) for c in m.get("tool_calls", ()))
    return m["role"], m["content"], m.get("name"), m.get("tool_call_id"), calls


def _canon(value: Any) -> str:
    """JSON text with sorted keys (a JSON string is parsed first): a client re-serialising tool-call
    arguments or tool schemas with other spacing or key order sends the same thing."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True)

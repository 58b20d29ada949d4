"""Tool calls through the gateway: rendering tools into the prompt, and the model's text back into
OpenAI ``tool_calls``.

Parsing is transformers' maintained response parser (``tokenizer.parse_response`` with a
``response_template``, transformers >= 5.25): a tokenizer that ships its own ``response_template``
is parsed with it (and the prompt as ``prefix``, since such templates may prefill part of the
reply); any other one with ``HERMES``, the declarative template of the Hermes-style format the
project's native agents and the tiny model use (``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``, rayapp/envs/agents/tools.py). Nothing here parses by hand. A reply whose tool-call
region is not JSON stays text (no tool calls, finish ``stop``), as OpenAI-compatible servers answer it:
the model's tokens are recorded either way, and the agent sees what the model wrote.

Rendering: a tokenizer whose chat template renders tools and tool calls is used as it is; one whose
template does not (the tiny model's) renders with ``hermes_tools.jinja`` beside this module, a
superset of the tiny template (the same text without tools), on a copy of the tokenizer made once
per tokenizer: the shipped model files are never changed.

``tool_choice``: ``auto`` (or unset) renders and parses; ``none`` neither renders nor parses (the
request is a conversation without tools, and the model's text is its content). ``required`` and a
named function are refused by name: honouring them needs constrained decoding, which the engines
behind the gateway do not offer, and a prompt that merely asks would be a promise the gateway cannot
keep.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from rayapp.gateway.openai_api import ApiError

__all__ = ["HERMES", "ParsedReply", "ToolParser", "openai_call", "parse_reply", "tool_mode", "tools_tokenizer"]

TEMPLATE = Path(__file__).with_name("hermes_tools.jinja")

# The reply is parsed on its own (prefix ""): this format prefills nothing, so the anchor never matters.
HERMES: dict[str, Any] = {
    "start_anchor_pattern": r"\A",
    "fields": {
        # text around the calls, kept as written (joined, then stripped once)
        "content": {"content": "text", "content_args": {"strip": False}, "repeats": True, "join": ""},
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                       "transform": {"type": "function",
                                     "function": {"name": "{content.name}", "arguments": "{content.arguments}"}}},
    },
}

_PROBE_LISTED = "rayapp_probe_listed"  # a tool offered but not called: only the tools' rendering shows it
_PROBE_ARGUMENT = "rayapp_probe_argument"
_PROBE_TOOLS = [{"type": "function", "function": {"name": name, "description": "rayapp probe",
                                                  "parameters": {"type": "object", "properties": {}}}}
                for name in ("rayapp_probe", _PROBE_LISTED)]
_PROBE = [{"role": "user", "content": "x"},
          {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
              "name": "rayapp_probe", "arguments": json.dumps({_PROBE_ARGUMENT: 1})}}]},
          {"role": "tool", "tool_call_id": "call_0", "content": "y"}]

_lock = threading.Lock()
_with_tools: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, the one that renders tools)


def renders_tools(tok: Any) -> bool:
    """Whether ``tok``'s chat template shows the tools it is given (their names at least: a model may
    have learnt tools by name alone, as the tiny one did) and an assistant's tool call."""
    try:
        text = tok.apply_chat_template(_PROBE, tools=_PROBE_TOOLS, tokenize=False)
    except (TemplateError, ValueError, TypeError, KeyError):
        return False
    return _PROBE_LISTED in text and _PROBE_ARGUMENT in text


def tools_tokenizer(tok: Any) -> Any:
    """The tokenizer the gateway renders with: ``tok`` itself when its template renders tools, else a
    copy with ``hermes_tools.jinja`` (made once per tokenizer and shared by every episode)."""
    with _lock:
        hit = _with_tools.get(id(tok))
        if hit is not None and hit[0] is tok:
            return hit[1]
    out = tok
    if not renders_tools(tok):
        out = copy.deepcopy(tok)
        out.chat_template = TEMPLATE.read_text()
    with _lock:
        _with_tools[id(tok)] = (tok, out)  # the tokenizer is held: its id is never reused meanwhile
    return out


def tool_mode(tools: list[Any] | None, tool_choice: Any) -> bool:
    """Whether tools are rendered and parsed for a request (module docstring), or ApiError(400)
    naming a ``tool_choice`` the gateway cannot honour."""
    if tool_choice in (None, "auto"):
        return bool(tools)
    if tool_choice == "none":
        return False
    if tool_choice == "required":
        raise ApiError(400, "tool_choice 'required' is not supported by the rayapp gateway (the engines behind it "
                            "cannot force a tool call); use 'auto'", param="tool_choice", code="unsupported_parameter")
    raise ApiError(400, "tool_choice naming a function is not supported by the rayapp gateway (the engines behind "
                        "it cannot force a tool call); use 'auto'", param="tool_choice", code="unsupported_parameter")


class ParsedReply:
    """The assistant message a reply becomes: ``content`` (None when only tool calls), ``tool_calls``
    in OpenAI's shape (ids ``call_<hex>``), and ``reasoning`` when the template separates it."""

    __slots__ = ("content", "reasoning", "tool_calls")

    def __init__(self, content: str | None, tool_calls: list[dict[str, Any]], reasoning: str | None = None):
        self.content, self.tool_calls, self.reasoning = content, tool_calls, reasoning

    def message(self) -> dict[str, Any]:
        """The assistant message as OpenAI returns it (and as the gateway records it)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        return out


# a recipe's own reading of a reply's tool calls (gateway.tool_parser): (text, tools) -> the message
ToolParser = Callable[[str, list[dict[str, Any]]], ParsedReply]


def parse_reply(tok: Any, text: str, prefix: str, tools: list[dict[str, Any]] | None,
                parser: ToolParser | None = None) -> ParsedReply:
    """``text`` (the model's reply, special tokens removed) as an assistant message; tool calls are
    looked for only when ``tools`` are given (``tool_mode``), by ``parser`` when the recipe names one
    (``gateway.tool_parser``: ``rayapp.gateway.sglang_tools``), else as the module docstring says."""
    if not tools:
        return ParsedReply(text, [])
    if parser is not None:
        return parser(text, tools)
    own = getattr(tok, "response_template", None)
    try:
        parsed = tok.parse_response(text, own or HERMES, prefix=prefix if own else "", tools=tools)
    except (ValueError, KeyError, TypeError):  # a call region that is not JSON: the reply stays text
        return ParsedReply(text, [])
    calls = [openai_call(c) for c in parsed.get("tool_calls") or []]
    if any(c is None for c in calls):
        return ParsedReply(text, [])
    content = parsed.get("content")
    content = content.strip() if isinstance(content, str) else None
    reasoning = parsed.get("thinking") or parsed.get("reasoning_content")
    return ParsedReply(content or (None if calls else ""), calls, reasoning if isinstance(reasoning, str) else None)


def openai_call(call: Any) -> dict[str, Any] | None:
    """One parsed call in OpenAI's shape with a fresh id; None when it has no function name."""
    fn = call.get("function", call) if isinstance(call, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        return None
    args = fn.get("arguments", {})
    args = args if isinstance(args, str) else json.dumps(args if args is not None else {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}

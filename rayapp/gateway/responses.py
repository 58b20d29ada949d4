"""The Responses API's subset that the OpenAI Agents SDK uses, served as the chat call it stands for.

The Agents SDK's default model (``OpenAIResponsesModel``) calls ``POST /responses``. ``parse_responses``
turns such a request into a chat request: ``instructions`` a system message, message items messages,
``function_call`` items the tool calls of the assistant message before them (the SDK sends a reply's
text and its calls back as separate items: they are one assistant message again, the one the gateway
recorded), ``function_call_output`` items tool messages, function tools chat tools,
``max_output_tokens`` the call's budget. The chat route then runs it: the same token accounting, the
same budgets. ``response_body`` answers its reply as output items: an assistant ``message`` with one
``output_text`` (with the engine's log-probs when ``include`` asks for them), then a ``function_call``
per tool call.

Served: plain (not streamed) calls with text and function tools. Refused by name: streaming, state kept
on the server (``previous_response_id``, ``conversation``, ``store``), reasoning options, non-text
input, other tool and item types, and what the chat route refuses.

Pure: no Ray, no HTTP server.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from rayapp.gateway.openai_api import ApiError, ChatCompletionRequest, Count, _parse, parse_chat

__all__ = ["ResponsesRequest", "parse_responses", "response_body"]

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value served
_TEXT_PARTS = ("input_text", "output_text")
_ROLES = ("system", "developer", "user", "assistant")


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A ``POST /responses`` body. Fields the gateway cannot honour are kept only to be refused by
    name (``unsupported``) when set to anything but their no-op value."""

    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    max_output_tokens: Count | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    truncation: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    max_tool_calls: int | None = None

    def unsupported(self) -> list[str]:
        """Names of options set to something the gateway cannot do."""
        out = [k for k in ("stream", "store", "background", "previous_response_id", "conversation", "reasoning",
                           "prompt", "top_logprobs", "max_tool_calls") if getattr(self, k)]
        out += ["include"] if any(i != LOGPROBS for i in self.include or ()) else []
        out += ["truncation"] if self.truncation not in (None, "disabled") else []
        out += ["text"] if self.text not in (None, {}, {"format": {"type": "text"}}) else []
        return out


def parse_responses(body: bytes) -> ChatCompletionRequest:
    """A ``POST /responses`` body as the chat request it stands for, or ApiError(400) naming the field
    (``input[i]...``, ``tools[i]``) or the option refused."""
    req = _parse(body, ResponsesRequest, "responses")
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    open_reply = False  # the last message is an assistant one its function_call items still add to
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise ApiError(400, f"responses: input[{i}].role: expected one of {', '.join(_ROLES)}, "
                                    f"got {role!r}"[:300], param=f"input[{i}].role")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
            open_reply = role == "assistant"
        elif kind == "function_call":
            function = {"name": _field(item, "name", i), "arguments": _field(item, "arguments", i, empty=True)}
            call = {"id": _field(item, "call_id", i), "type": "function", "function": function}
            if not open_reply:
                messages.append({"role": "assistant", "content": None})
                open_reply = True
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", i),
                             "content": _text(item.get("output"), f"input[{i}].output")})
            open_reply = False
        else:
            raise ApiError(400, f"responses: input[{i}] is a {kind!r} item; the rayapp gateway takes message, "
                                "function_call and function_call_output items", param=f"input[{i}].type",
                           code="unsupported_parameter")
    chat = {"model": req.model, "messages": messages, "temperature": req.temperature, "top_p": req.top_p,
            "max_completion_tokens": req.max_output_tokens, "logprobs": LOGPROBS in (req.include or ()),
            "parallel_tool_calls": req.parallel_tool_calls, "metadata": req.metadata, "user": req.user}
    if req.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        choice = req.tool_choice
        chat["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": str(choice.get("name"))}}
    return parse_chat(msgspec.json.encode({k: v for k, v in chat.items() if v is not None}))


def response_body(model: str, message: dict[str, Any], finish: str, usage: dict[str, int],
                  logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The chat reply ``message`` (its ``finish`` reason, ``usage`` and log-probs) as a Response."""
    output: list[dict[str, Any]] = []
    if message.get("content") or not message.get("tool_calls"):
        output.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                       "status": "completed", "content": [{"type": "output_text", "text": message.get("content") or "",
                                                           "annotations": [], "logprobs": logprobs or []}]})
    for call in message.get("tool_calls") or ():
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    cut = finish == "length"
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()), "model": model,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
            "instructions": None, "metadata": {}, "output": output, "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "temperature": None, "top_p": None,
            "text": {"format": {"type": "text"}},
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}}


def _text(content: Any, where: str) -> str:
    """Text content, or a list of text parts joined; ApiError naming a part that is not text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"responses: {where}: expected text or a list of text parts", param=where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"responses: {where}[{j}] is of type {kind!r}; the rayapp gateway takes text "
                                f"parts only ({', '.join(_TEXT_PARTS)})", param=f"{where}[{j}]")
        out.append(part["text"])
    return "".join(out)


def _field(item: dict[str, Any], name: str, i: int, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not (value or empty):
        raise ApiError(400, f"responses: input[{i}].{name}: expected a{'' if empty else ' non-empty'} string, "
                            f"got {value!r}"[:300],
                       param=f"input[{i}].{name}")
    return value


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool as a chat one (the same fields, one level down)."""
    if tool.get("type") != "function":
        raise ApiError(400, f"responses: tools[{i}] is a {tool.get('type')!r} tool; the rayapp gateway serves "
                            "function tools only", param=f"tools[{i}].type", code="unsupported_parameter")
    fields = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fields}
